"""Synthetic tasks: arithmetic answers are right, K&K puzzles have exactly one solution, everything is seeded."""

import ast
import random
import re

import pytest

from prorl_trl.data.synthetic import (
    KK_MAX_PEOPLE,
    KK_MIN_PEOPLE,
    arithmetic_example,
    evaluate,
    kk_example,
    make_arithmetic_dataset,
    make_kk_dataset,
    solve,
)


def _replay(solution: str) -> int:
    """Check each worked step `a<op>b=c` with plain integer arithmetic and return the boxed value."""
    *steps, boxed = solution.split("\n")
    value = None
    for step in steps:
        left, op, right, result = re.fullmatch(r"(\d+)([-+*])(\d+)=(\d+)", step).groups()
        assert value is None or int(left) == value, "each step must start from the previous result"
        expected = {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}[op]
        assert int(result) == expected
        value = expected
    assert boxed == f"\\boxed{{{value}}}"
    return value


@pytest.mark.parametrize("style", ["word", "expression"])
def test_arithmetic_answers_follow_the_worked_steps(style):
    dataset = make_arithmetic_dataset(200, seed=3, num_steps=(1, 4), max_value=30, style=style)
    for row in dataset:
        assert _replay(row["solution"]) == int(row["answer"]) >= 0
        assert 1 <= row["num_steps"] <= 4
        assert "\\boxed{}" in row["prompt"] and row["question"] in row["prompt"]


def test_arithmetic_expression_style_evaluates_to_the_answer():
    for index in range(100):
        row = arithmetic_example(random.Random(index), num_steps=(1, 3), style="expression")
        tree = ast.parse(row["question"].removesuffix(" = ?"), mode="eval")  # parse only numbers and + - *
        assert all(
            isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
            for n in ast.walk(tree)
        )
        assert _evaluate_tree(tree.body) == int(row["answer"])


def _evaluate_tree(node):
    if isinstance(node, ast.Constant):
        return node.value
    left, right = _evaluate_tree(node.left), _evaluate_tree(node.right)
    return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}[type(node.op)]


def test_arithmetic_difficulty_knobs():
    easy = make_arithmetic_dataset(100, num_steps=1, max_value=5, operations=("+",))
    assert set(easy["num_steps"]) == {1} and max(int(a) for a in easy["answer"]) <= 10
    hard = make_arithmetic_dataset(100, num_steps=5, max_value=50)
    assert set(hard["num_steps"]) == {5}


def test_arithmetic_is_deterministic_by_seed():
    first, again = make_arithmetic_dataset(50, seed=7), make_arithmetic_dataset(50, seed=7)
    assert first.to_list() == again.to_list()
    assert first.to_list() != make_arithmetic_dataset(50, seed=8).to_list()
    assert make_arithmetic_dataset(10, seed=7).to_list() == first.to_list()[:10], "row i depends on (seed, i) only"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": (3, 1)}, "num_steps"),
        ({"operations": ("/",)}, "operations"),
        ({"style": "latex"}, "style"),
        ({"max_value": 0}, "max_value"),
    ],
)
def test_arithmetic_rejects_bad_difficulty(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_arithmetic_dataset(1, **kwargs)


def test_solver_on_a_hand_checked_puzzle():
    # A says "B is a knave"; B says "A and B are the same type" -> only A knight, B knave... check by hand:
    # (T,F): A true statement "B knave" ok; B knave says "same type" (false) ok. (F,T): A lies "B knave" ok;
    # B knight says "same type" false -> inconsistent. (T,T): A says B knave, false -> no. (F,F): A lies ok;
    # B knave says "same" which is true -> no.
    statements = [("lying", 1), ("<=>", ("telling-truth", 0), ("telling-truth", 1))]
    assert solve(statements) == [(True, False)]
    assert evaluate(("->", ("telling-truth", 0), ("lying", 1)), (False, False))
    assert not evaluate(("or", ("telling-truth", 0), ("lying", 1)), (False, True))


@pytest.mark.parametrize("num_people", range(KK_MIN_PEOPLE, KK_MAX_PEOPLE + 1))
def test_kk_puzzles_have_exactly_one_solution(num_people):
    for seed in range(40):
        row = kk_example(random.Random(seed), num_people)
        statements = ast.literal_eval(row["statements"])  # data, not code: literal_eval only
        assert solve(statements) == [tuple(row["solution"])]
        assert len(row["names"]) == len(set(row["names"])) == num_people
        for index, (name, knight) in enumerate(zip(row["names"], row["solution"]), start=1):
            role = "knight" if knight else "knave"
            assert row["solution_text_format"].split("\n")[index - 1] == f"({index}) {name} is a {role}"
            assert f"{name} is a {role}" in row["solution_text"]
            assert name in row["quiz"]


def test_kk_dataset_is_deterministic_and_mixes_sizes():
    first = make_kk_dataset(30, seed=1, num_people=(2, 8))
    assert first.to_list() == make_kk_dataset(30, seed=1, num_people=(2, 8)).to_list()
    assert first.to_list() != make_kk_dataset(30, seed=2, num_people=(2, 8)).to_list()
    assert len(set(first["num_people"])) > 3
    assert all(row["prompt"].startswith(row["quiz"]) and "<answer>" in row["prompt"] for row in first)


@pytest.mark.parametrize("num_people", [1, 9, (2, 9), (5, 3)])
def test_kk_rejects_sizes_the_solver_cannot_handle(num_people):
    with pytest.raises(ValueError, match="num_people"):
        make_kk_dataset(1, num_people=num_people)


def test_kk_rows_are_graded_by_the_kk_logic_reward():
    from rewards import get_reward

    reward = get_reward("kk_logic")
    rows = make_kk_dataset(20, seed=4, num_people=(2, 8)).to_list()
    right = [f"<think>...</think><answer>{row['solution_text_format']}</answer>" for row in rows]
    flipped = [text.replace("knight", "KNAVE").replace("knave", "knight").replace("KNAVE", "knave") for text in right]
    for columns in (
        {"names": [r["names"] for r in rows], "solution": [r["solution"] for r in rows]},
        {"solution_text_format": [r["solution_text_format"] for r in rows]},
    ):
        assert reward(completions=right, **columns) == [3.0] * len(rows)
        assert reward(completions=flipped, **columns) == [-0.5] * len(rows)


def test_arithmetic_rows_are_graded_by_the_boxed_answer_reward():
    from rewards import get_reward

    reward = get_reward("boxed_answer")
    rows = make_arithmetic_dataset(50, seed=5, num_steps=(1, 3))
    assert reward(completions=rows["solution"], answer=rows["answer"]) == [1.0] * 50
    wrong = [f"\\boxed{{{int(answer) + 1}}}" for answer in rows["answer"]]
    assert reward(completions=wrong, answer=rows["answer"]) == [-1.0] * 50
