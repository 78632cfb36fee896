"""Synthetic reasoning tasks generated in-process: multi-step arithmetic and knights-and-knaves puzzles.

The offline demo, the GPU learning benchmark and tests need tasks with a verifiable answer and a difficulty knob,
without downloading anything. Both generators are deterministic functions of their seed (row `i` depends only on
`seed` and `i`), so a dataset can be rebuilt bit-for-bit anywhere.

- Arithmetic rows carry `prompt`, `question`, `answer` (a number string, the `boxed_answer` reward's gold column)
  and `solution` (worked steps ending in `\\boxed{answer}`, usable as an SFT target).
- Knights-and-knaves rows follow the shared K&K format (`quiz`, `names`, `solution` list of bool with True = knight,
  `solution_text`, `solution_text_format` "(1) Name is a knight\\n...", `statements` as the nested-tuple string) so
  the `kk_logic` reward grades them like the public data set. The generator keeps a puzzle only when the brute-force
  solver finds exactly one consistent assignment.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator
from typing import Any

from datasets import Dataset

BOXED_INSTRUCTION = "Answer in \\boxed{}."  # short: byte-level tiny models pay per character
KK_INSTRUCTION = (
    "Reason inside <think> </think>, then state the identity of each person inside <answer> </answer>, "
    "e.g. <answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>."
)
ARITHMETIC_OPERATIONS = ("+", "-", "*")
KK_MIN_PEOPLE, KK_MAX_PEOPLE = 2, 8
KK_NAMES = (
    "Alice", "Ben", "Chloe", "David", "Emma", "Finn", "Grace", "Henry", "Isla", "Jack", "Kate", "Liam", "Mia",
    "Noah", "Olivia", "Paul", "Quinn", "Ruby", "Sam", "Tess", "Uma", "Victor", "Wendy", "Xavier", "Yara", "Zoe",
)  # fmt: skip
_AGENTS = ("Ann", "Bob", "Cara", "Dan", "Eve", "Max", "Lily", "Omar", "Pia", "Ravi")
_ITEMS = ("apples", "marbles", "coins", "books", "stickers", "pens", "shells", "cards")


# ----------------------------------------------------------------------------------------------- arithmetic


def _as_range(value: int | tuple[int, int] | list[int], name: str, lowest: int) -> tuple[int, int]:
    low, high = (value, value) if isinstance(value, int) else tuple(value)
    if low < lowest or high < low:
        raise ValueError(
            f"{name} must be an int >= {lowest} or a (min, max) pair with {lowest} <= min <= max, got {value!r}."
        )
    return int(low), int(high)


def arithmetic_example(
    rng: random.Random,
    num_steps: int | tuple[int, int] = (1, 3),
    max_value: int = 20,
    max_factor: int = 3,
    operations: tuple[str, ...] = ARITHMETIC_OPERATIONS,
    style: str = "word",
    instruction: str = BOXED_INSTRUCTION,
) -> dict[str, Any]:
    """One arithmetic problem drawn from `rng`: a start value in [1, max_value] and `num_steps` operations.

    `+` adds a number in [1, max_value]; `-` subtracts at most the running total (answers stay >= 0, as in a word
    problem); `*` multiplies by a factor in [2, max_factor]. `style="word"` writes a story ("Ann has 3 apples. She
    gets 4 more."), `style="expression"` a bracketed expression ("(3 + 4) * 2"), evaluated left to right.
    """
    steps_low, steps_high = _as_range(num_steps, "num_steps", 1)
    unknown = set(operations) - set(ARITHMETIC_OPERATIONS)
    if not operations or unknown:
        raise ValueError(f"operations must be a non-empty subset of {ARITHMETIC_OPERATIONS}, got {operations!r}.")
    if max_value < 1 or max_factor < 2:
        raise ValueError(f"max_value must be >= 1 and max_factor >= 2, got {max_value} and {max_factor}.")
    if style not in ("word", "expression"):
        raise ValueError(f"style must be 'word' or 'expression', got {style!r}.")

    total = rng.randint(1, max_value)
    agent, item = rng.choice(_AGENTS), rng.choice(_ITEMS)
    expression, story, work = str(total), [f"{agent} has {total} {item}."], []
    for _ in range(rng.randint(steps_low, steps_high)):
        operation = rng.choice(operations)
        if operation == "-" and total == 0:
            operation = "+"
        if operation == "+":
            operand = rng.randint(1, max_value)
            result, sentence = total + operand, f"{agent} gets {operand} more."
        elif operation == "-":
            operand = rng.randint(1, total)
            result, sentence = total - operand, f"{agent} gives away {operand}."
        else:
            operand = rng.randint(2, max_factor)
            word = {2: "doubles", 3: "triples"}.get(operand, f"grows {operand} times")
            result, sentence = total * operand, f"Then the number of {item} {word}."
            if "+" in expression or "-" in expression:
                expression = f"({expression})"
        expression = f"{expression} {operation} {operand}"
        work.append(f"{total}{operation}{operand}={result}")
        story.append(sentence)
        total = result
    if style == "word":
        question = " ".join(story) + f" How many {item} does {agent} have now?"
    else:
        question = f"{expression} = ?"
    answer = str(total)
    return {
        "prompt": f"{question} {instruction}".strip(),
        "question": question,
        "answer": answer,
        "solution": "\n".join(work) + f"\n\\boxed{{{answer}}}",
        "num_steps": len(work),
    }


def arithmetic_examples(seed: int = 0, **difficulty: Any) -> Iterator[dict[str, Any]]:
    """Arithmetic rows without end: row `i` is drawn from its own generator seeded with (`seed`, `i`)."""
    for index in itertools.count():
        yield arithmetic_example(random.Random(f"arithmetic-{seed}-{index}"), **difficulty)


def make_arithmetic_dataset(num_examples: int, seed: int = 0, **difficulty: Any) -> Dataset:
    """`num_examples` arithmetic rows; `difficulty` goes to `arithmetic_example` (num_steps, max_value, style, ...)."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    return Dataset.from_list(list(itertools.islice(arithmetic_examples(seed, **difficulty), num_examples)))


# ---------------------------------------------------------------------------------------- knights and knaves

# A statement is a nested tuple in the public K&K data set's notation: ("telling-truth", i), ("lying", i),
# ("not", s), ("and", s, t), ("or", s, t), ("->", s, t), ("<=>", s, t).
Statement = tuple


def evaluate(statement: Statement, knights: tuple[bool, ...] | list[bool]) -> bool:
    """Truth of `statement` when person `i` is a knight iff `knights[i]`."""
    kind = statement[0]
    if kind == "telling-truth":
        return knights[statement[1]]
    if kind == "lying":
        return not knights[statement[1]]
    if kind == "not":
        return not evaluate(statement[1], knights)
    left, right = evaluate(statement[1], knights), evaluate(statement[2], knights)
    if kind == "and":
        return left and right
    if kind == "or":
        return left or right
    if kind == "->":
        return (not left) or right
    if kind == "<=>":
        return left == right
    raise ValueError(f"unknown statement kind {kind!r} in {statement!r}")


def solve(statements: list[Statement] | tuple[Statement, ...]) -> list[tuple[bool, ...]]:
    """Every assignment (True = knight) under which each person's statement is true exactly when they are a knight.

    Brute force over the 2^n assignments: n <= 8 people means at most 256 checks.
    """
    count = len(statements)
    return [
        knights
        for knights in itertools.product((True, False), repeat=count)
        if all(evaluate(statement, knights) == knights[person] for person, statement in enumerate(statements))
    ]


def _random_statement(rng: random.Random, count: int) -> Statement:
    def atom() -> Statement:
        return (rng.choice(("telling-truth", "lying")), rng.randrange(count))

    kind = rng.choice(("atom", "not", "and", "or", "->", "<=>", "same"))
    if kind == "atom":
        return atom()
    if kind == "not":
        return ("not", ("telling-truth", rng.randrange(count)))
    if kind == "same":  # "X and Y are the same type"
        first, second = rng.sample(range(count), 2)
        return ("<=>", ("telling-truth", first), ("telling-truth", second))
    first, second = atom(), atom()
    while second[1] == first[1]:
        second = atom()
    return (kind, first, second)


def _render(statement: Statement, names: list[str]) -> str:
    kind = statement[0]
    if kind == "telling-truth":
        return f"{names[statement[1]]} is a knight"
    if kind == "lying":
        return f"{names[statement[1]]} is a knave"
    if kind == "not":
        return f"{names[statement[1][1]]} is not a knight"
    left, right = statement[1], statement[2]
    if kind == "<=>" and left[0] == right[0] == "telling-truth":
        return f"{names[left[1]]} and {names[right[1]]} are the same type"
    words = {"and": "{} and {}", "or": "{} or {}", "->": "if {} then {}", "<=>": "{} if and only if {}"}[kind]
    return words.format(_render(left, names), _render(right, names))


def kk_example(rng: random.Random, num_people: int, max_attempts: int = 1000) -> dict[str, Any]:
    """One knights-and-knaves puzzle with `num_people` people and exactly one solution.

    Draws a hidden assignment, gives each person a random statement that is true iff they are a knight, and
    redraws one person's statement until the brute-force solver finds a single consistent assignment.
    """
    if not KK_MIN_PEOPLE <= num_people <= KK_MAX_PEOPLE:
        raise ValueError(f"num_people must be in [{KK_MIN_PEOPLE}, {KK_MAX_PEOPLE}], got {num_people}.")
    names = rng.sample(KK_NAMES, num_people)
    knights = tuple(rng.random() < 0.5 for _ in range(num_people))

    def consistent_statement(speaker: int) -> Statement:
        while True:
            statement = _random_statement(rng, num_people)
            if evaluate(statement, knights) == knights[speaker]:
                return statement

    statements = [consistent_statement(person) for person in range(num_people)]
    for _ in range(max_attempts):
        if len(solve(statements)) == 1:
            break
        person = rng.randrange(num_people)
        statements[person] = consistent_statement(person)
    else:  # pragma: no cover - never seen for n <= 8, kept so a bug cannot loop forever
        raise RuntimeError(f"no unique {num_people}-person puzzle after {max_attempts} redraws")

    said = ("says", "claims", "states", "tells you")
    lines = [f'{names[p]} {rng.choice(said)}: "{_capitalize(_render(s, names))}."' for p, s in enumerate(statements)]
    roles = ["knight" if knight else "knave" for knight in knights]
    listing = ", ".join(names[:-1]) + f", and {names[-1]}" if num_people > 2 else " and ".join(names)
    quiz = (
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves "
        f"always lie. You meet {num_people} inhabitants: {listing}. "
        + " ".join(lines)
        + " So who is a knight and who is a knave?"
    )
    clauses = [f"{name} is a {role}" for name, role in zip(names, roles)]
    return {
        "quiz": quiz,
        "names": names,
        "solution": list(knights),
        "solution_text": ", ".join(clauses[:-1]) + f", and {clauses[-1]}."
        if num_people > 2
        else " and ".join(clauses) + ".",
        "solution_text_format": "\n".join(f"({index}) {clause}" for index, clause in enumerate(clauses, start=1)),
        "statements": repr(tuple(statements)),
        "num_people": num_people,
    }


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def make_kk_dataset(
    num_examples: int,
    seed: int = 0,
    num_people: int | tuple[int, int] = (2, 4),
    instruction: str = KK_INSTRUCTION,
) -> Dataset:
    """`num_examples` unique-solution puzzles with a `prompt` (quiz + answer-format instruction) column added."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}.")
    return Dataset.from_list(list(itertools.islice(kk_examples(seed, num_people, instruction), num_examples)))


def kk_examples(
    seed: int = 0, num_people: int | tuple[int, int] = (2, 4), instruction: str = KK_INSTRUCTION
) -> Iterator[dict[str, Any]]:
    """Puzzles without end, with their `prompt`: puzzle `i` comes from its own generator seeded with (`seed`, `i`)."""
    low, high = _as_range(num_people, "num_people", KK_MIN_PEOPLE)
    if high > KK_MAX_PEOPLE:
        raise ValueError(f"num_people must be at most {KK_MAX_PEOPLE} (brute-force solver), got {num_people!r}.")
    for index in itertools.count():
        rng = random.Random(f"kk-{seed}-{index}")
        row = kk_example(rng, rng.randint(low, high))
        yield {"prompt": f"{row['quiz']}\n{instruction}".strip(), **row}


# ------------------------------------------------------------------------------------ train / validation split

# One problem in VALIDATION_SHARE is held out for validation, chosen by a stable hash of its text.
VALIDATION_SHARE = 4
# Draws in a row that add no row before a split is declared too small for its problem space.
MAX_FRUITLESS_DRAWS = 5000


def held_out(question: str) -> bool:
    """Whether a problem is on the validation side: a stable hash of its text (not Python's salted `hash`), so the
    sides depend on neither the seed nor the split sizes, and no problem is ever on both."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % VALIDATION_SHARE == 0


class ProblemSpaceTooSmall(ValueError):
    """The generator's settings give fewer problems than a split asks for."""


def split_rows(examples: Iterator[dict[str, Any]], size: int, validation: bool, key: str) -> list[dict[str, Any]]:
    """`size` rows of one side of a generated task (`key`: the problem-text column the side is read from).

    Validation rows are distinct held-out problems; training rows are the other problems and may repeat (a small
    space such as the demo's 144 one-step problems is drawn many times). Raises `ProblemSpaceTooSmall` when
    `MAX_FRUITLESS_DRAWS` draws in a row add nothing."""
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    fruitless = 0
    while len(rows) < size:
        row = next(examples)
        text = row[key]
        if held_out(text) != validation or (validation and text in seen):
            fruitless += 1
            if fruitless >= MAX_FRUITLESS_DRAWS:
                side = (f"{len(rows)} distinct validation problems" if validation else "no training problems")
                raise ProblemSpaceTooSmall(
                    f"these settings give only {side} (one problem in {VALIDATION_SHARE}, chosen by a hash of its "
                    f"text, is held out for validation), fewer than the {size} asked for: lower "
                    f"{'num_validation' if validation else 'num_train'} or widen the task (arithmetic: max_value, "
                    "num_steps, max_factor, style word; knights and knaves: num_people)"
                )
            continue
        fruitless = 0
        seen.add(text)
        rows.append(row)
    return rows
