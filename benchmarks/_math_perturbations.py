r"""The MATH-500 differential: `math_equivalence` vs math-verify on every gold, its neighbour and 20+ perturbations.

For each MATH-500 gold `g` the answers are: `g` itself, the next problem's gold, and perturbations of `g` whose
verdict is known by construction (`expected`): wrong ones (an appended variable `3x`, `3i`, `+ i`, a second clause
`3 \text{ or } 4`, `3, 4`, a sign flip, an off-by-one number) and right ones (rounding to 6 and 12 decimals, which
math-verify's 6-decimal rule accepts; thousands separators; `\dfrac`; spacing; a known unit; `^\circ`; `\$`;
`x = g`). Rounding to 2 decimals is right only when that loses nothing at 6 decimals (math-verify's rule), which the
label computes exactly. `expected` is None where construction cannot tell (a sign flip of `\pm`, the next gold when
it is not a plain number).

math-verify runs as `trl.rewards.accuracy_reward` runs it: gold `parse("$g$")` with the default extraction, answer
`parse("\boxed{a}")` with TRL's LaTeX configuration, `verify(gold, answer)`; its own timeouts off (tests run under
pytest-timeout's SIGALRM). Used by `benchmarks/rewards_throughput.py` (all 500 golds) and
`tests/test_rewards_differential.py` (a seeded part of them).
"""

from __future__ import annotations

import json
import logging
import random
import re
from fractions import Fraction
from pathlib import Path

OTHER_CLAUSE = ("7", "8")  # a second value, chosen to differ from the gold's


def load_golds(data_dir: Path) -> list[str]:
    return [json.loads(line)["answer"] for line in (data_dir / "math500" / "test.jsonl").read_text().splitlines()]


def gold_value(gold: str) -> Fraction | None:
    """The exact value of a gold that is a plain number (`42`, `-3`, `\\frac{14}{3}`, `5.4`), else None. Written here
    without the reward's parser, so labels do not depend on the code under test."""
    text = gold.strip().replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return Fraction(text)
    fraction = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", text) or re.fullmatch(r"(-?)\\frac(\d)(\d)", text)
    if fraction:
        value = Fraction(int(fraction.group(2)), int(fraction.group(3)))
        return -value if fraction.group(1) else value
    return None


def _decimal(value: Fraction, places: int) -> str:
    """`value` rounded half away from zero to `places` decimals, as text."""
    scaled = abs(value) * 10**places
    rounded = int(scaled + Fraction(1, 2))
    sign = "-" if value < 0 and rounded else ""
    digits = str(rounded).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def _agrees_at_six_decimals(value: Fraction, written: str) -> bool:
    """math-verify's rule for a decimal answer: equal once both are rounded to 6 decimals (half to even)."""

    def six(number: Fraction) -> int:
        return round(number * 10**6)

    return six(Fraction(written)) == six(value)


def perturbations(gold: str, next_gold: str) -> list[tuple[str, str, bool | None]]:
    """(kind, answer, expected) for one gold: expected True = equivalent, False = not, None = unknown."""
    value = gold_value(gold)
    zero = value == 0 or bool(re.search(r"(?<![\d.])0$", gold))  # `... = 0` times x is still `... = 0`
    others = [o for o in OTHER_CLAUSE if o not in gold]
    other = others[0] if others else "91"
    has_pm = "\\pm" in gold
    infinite = "\\infty" in gold
    is_text = gold.startswith("\\text")
    cases: list[tuple[str, str, bool | None]] = [("self", gold, True)]
    next_value = gold_value(next_gold)
    if "".join(next_gold.split()) == "".join(gold.split()):
        cases.append(("next_gold", next_gold, True))
    elif value is not None and next_value is not None:
        cases.append(("next_gold", next_gold, value == next_value))
    else:
        cases.append(("next_gold", next_gold, None))
    wrong_unless_zero = None if zero else False
    for kind, suffix in (("append_x", "x"), ("append_space_x", " x"), ("append_n", "n"), ("append_k", "k")):
        cases.append((kind, gold + suffix, wrong_unless_zero))
    cases.append(("append_i", gold + "i", wrong_unless_zero))
    cases.append(("append_space_i", gold + " i", wrong_unless_zero))
    cases.append(("plus_i", gold + " + i", False))
    cases.append(("or_text", gold + " \\text{ or } " + other, False))
    cases.append(("or_plain", gold + " or " + other, False))
    cases.append(("and_text", gold + " \\text{ and } " + other, False))
    cases.append(("comma_other", gold + ", " + other, False))
    cases.append(("but_maybe", gold + " \\text{, but maybe } " + other, False))
    cases.append(("or_maybe", gold + " \\text{ or maybe } " + other, False))
    cases.append(("and_plain", gold + " and " + other, False))
    cases.append(("semicolon_other", gold + "; " + other, False))
    cases.append(("text_then_x", gold + "\\text{ hmm }x", False))  # words in \text are no unit: never dropped
    cases.append(("append_y", gold + "y", wrong_unless_zero))
    cases.append(("times_two", "2(" + gold + ")", None if zero or infinite else False))
    cases.append(("plus_one", gold + " + 1", None if infinite else False))
    cases.append(("squared", "(" + gold + ")^2", None if infinite or value in (0, 1) or has_pm else False))
    cases.append(("equals_other", gold + " = " + other, None if value == Fraction(other) else False))
    flipped = gold[1:].lstrip() if gold.startswith("-") else "-" + gold
    cases.append(("sign_flip", flipped, None if (zero or has_pm) else False))
    if value is not None:
        cases.append(("off_by_one", str(value + 1) if value.denominator == 1 else _decimal(value + 1, 3), False))
        for places in (2, 6, 12):
            written = _decimal(value, places)
            cases.append((f"round{places}", written, _agrees_at_six_decimals(value, written)))
        if value.denominator == 1 and abs(value) >= 1000:
            grouped = f"{abs(value.numerator):,}"
            sign = "-" if value < 0 else ""
            cases.append(("thousands_bang", sign + grouped.replace(",", ",\\! "), True))
            cases.append(("thousands_comma", sign + grouped, True))
            cases.append(("thousands_thin", sign + grouped.replace(",", "\\,"), True))
        numerator, denominator = value.numerator, value.denominator
        if denominator == 1:
            numerator, denominator = numerator * 2, 2
        sign = "-" if numerator < 0 else ""
        cases.append(("dfrac", f"{sign}\\dfrac{{{abs(numerator)}}}{{{denominator}}}", True))
        cases.append(("unit_text", gold + "\\text{ cm}", True))
        cases.append(("unit_words", gold + " \\text{ dollars}", True))
        cases.append(("degrees", gold + "^\\circ", True))
        cases.append(("dollar_sign", "\\$" + gold, True))
        cases.append(("assignment", "x = " + gold, True))
    if not is_text and not re.search(r"\d,", gold):
        spaced = re.sub(r"\s*([+=,]|(?<![{^(\[,\s])-)\s*", r" \1 ", gold).strip()
        if spaced != gold:
            cases.append(("spaced", spaced, True))
        if not re.search(r"\\[A-Za-z]+\s+[A-Za-z0-9]|\d\s+\d|\\text", gold):
            unspaced = re.sub(r"\s+", "", gold)
            if unspaced != gold:
                cases.append(("unspaced", unspaced, True))
    if "\\frac" in gold:
        cases.append(("dfrac_swap", gold.replace("\\frac", "\\dfrac"), True))
    return cases


class MathVerify:
    """math-verify configured as `trl.rewards.accuracy_reward` uses it, with its signal timeouts off."""

    def __init__(self) -> None:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify

        for logger in ("math_verify", "latex2sympy2_extended"):  # TRL's `equations=True` warns on every parse
            logging.getLogger(logger).setLevel(logging.CRITICAL)
        self.parse, self.verify = parse, verify
        self.answer_config = [
            LatexExtractionConfig(
                normalization_config=NormalizationConfig(
                    nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed="all", units=True
                ),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
        ]
        self._golds: dict[str, list] = {}

    def __call__(self, gold: str, answer: str) -> bool | None:
        if gold not in self._golds:
            self._golds[gold] = self.parse(f"${gold}$", extraction_mode="first_match", parsing_timeout=None)
        gold_parsed = self._golds[gold]
        if not gold_parsed:
            return None
        answer_parsed = self.parse(
            f"\\boxed{{{answer}}}", extraction_config=self.answer_config, extraction_mode="first_match",
            parsing_timeout=None,
        )
        try:
            return bool(self.verify(gold_parsed, answer_parsed, timeout_seconds=None))
        except Exception:
            return None


def run(golds: list[str], indices: list[int], reward, math_verify: MathVerify | None) -> list[dict]:
    """One record per (gold, answer): kind, expected, ours (True/False/None), math-verify's verdict."""
    records = []
    for index in indices:
        gold, next_gold = golds[index], golds[(index + 1) % len(golds)]
        cases = perturbations(gold, next_gold)
        verdicts = reward.is_correct(
            completions=[f"The answer is $\\boxed{{{answer}}}$." for _, answer, _ in cases], answer=[gold] * len(cases)
        )
        for (kind, answer, expected), ours in zip(cases, verdicts):
            theirs = math_verify(gold, answer) if math_verify is not None else None
            records.append(
                {"index": index, "gold": gold, "kind": kind, "answer": answer, "expected": expected,
                 "ours": ours, "math_verify": theirs}
            )  # fmt: skip
    return records


def seeded_indices(count: int, total: int = 500, seed: int = 13) -> list[int]:
    return sorted(random.Random(seed).sample(range(total), count))


def summary_table(records: list[dict]) -> list[str]:
    """One markdown row per perturbation kind: how many, the known verdict, false credit by each side, and the
    disagreements with who is right."""
    lines = [
        "| kind | comparisons | known right / wrong / unknown | math_equivalence credits a wrong one | math-verify "
        "credits a wrong one | misses a right one (ours / math-verify) | disagreements (ours right / unknown) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    kinds = list(dict.fromkeys(record["kind"] for record in records))  # in the order perturbations() makes them
    for kind in kinds + ["all"]:
        rows = records if kind == "all" else [record for record in records if record["kind"] == kind]
        right = sum(r["expected"] is True for r in rows)
        wrong = sum(r["expected"] is False for r in rows)
        ours_false = sum(r["expected"] is False and r["ours"] is True for r in rows)
        theirs_false = sum(r["expected"] is False and r["math_verify"] is True for r in rows)
        ours_missed = sum(r["expected"] is True and r["ours"] is not True for r in rows)
        theirs_missed = sum(r["expected"] is True and r["math_verify"] is not True for r in rows)
        disagreements = [r for r in rows if r["ours"] != r["math_verify"]]
        ours_right = sum(r["expected"] is not None and r["ours"] == r["expected"] for r in disagreements)
        label = "**all**" if kind == "all" else f"`{kind}`"
        unknown, ours_unknown = len(rows) - right - wrong, len(disagreements) - ours_right
        lines.append(
            f"| {label} | {len(rows)} | {right} / {wrong} / {unknown} | {ours_false} | {theirs_false} "
            f"| {ours_missed} / {theirs_missed} | {len(disagreements)} ({ours_right} / {ours_unknown}) |"
        )
    return lines
