"""Peers' test inputs through our rewards: math-verify's own suite, TRL's and open-r1's reward tests. Every verdict
that differs from the peer's is listed with the reason it is intended (issue 13, acceptance for Part A).

Cost: about 3 s (195 math-verify vectors, a few dozen symbolic).
"""

from __future__ import annotations

import math

import pytest
from _math_verify_vectors import (
    CHAIN,
    GOLD_BOXES_APART,
    LAST_BOX,
    MATH_VERIFY_CASES,
    MV_FALSE_CREDIT,
    SOLUTION_GOLD,
)

from rewards import get_reward

# Why math_equivalence and math-verify's test suite disagree, one reason per kind of case.
REASONS = {
    LAST_BOX: "a completion's answer is its last box, as in the MATH/lm-eval/verl graders; math-verify reads every "
    "box of a completion as a list, which would also credit a model that boxes several candidates",
    CHAIN: "`x = 5+5+1 = 7 = 11` states two different numbers (7 and 11); math-verify keeps the last one",
    MV_FALSE_CREDIT: "1 - 1/e is not 1 + 1/e: math-verify's suite pins its own false credit here",
    SOLUTION_GOLD: "a gold column holds an answer: a whole solution without \\boxed or #### is prose, so None "
    "(math-verify searches it for the last `$...$`)",
    GOLD_BOXES_APART: "boxes in a gold form one answer only when nothing but `and`, commas or spacing separates them "
    "(`\\boxed{1} papers and \\boxed{2} bins` is the last box), and `\\\\boxed` (a literal backslash) is no box",
}


def test_math_verify_suite():
    reward = get_reward("math_equivalence", timeout_seconds=10.0)
    values = reward(completions=[case[2] for case in MATH_VERIFY_CASES], answer=[case[1] for case in MATH_VERIFY_CASES])
    got = [None if value is None else int(value) for value in values]
    assert got == [case[4] for case in MATH_VERIFY_CASES]
    differences = [case for case in MATH_VERIFY_CASES if case[4] != case[3]]
    assert all(case[5] in REASONS for case in differences)
    assert all(case[5] == "" for case in MATH_VERIFY_CASES if case[4] == case[3])
    # every difference is a stricter verdict, never extra credit: where math-verify's suite expects 0, so do we
    assert all(case[3] == 1 for case in differences)
    assert len(MATH_VERIFY_CASES) == 195 and len(differences) == 19


# ----------------------------------------------------------------------------------------------- TRL and open-r1


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_trl_and_open_r1_accuracy_vectors():
    """trl tests/test_rewards.py (TestAccuracyReward) and open-r1 tests/test_rewards.py (TestRewards): same values."""
    reward = get_reward("math_equivalence")
    completions = [r"\boxed{\frac{63}{400}}", r"\boxed{\frac{63}{400}}", r"\boxed{\frac{64}{400}}", r"\boxed{3}"]
    golds = [r"\frac{63}{400}", "63/400", r"\frac{63}{400}", "6"]
    assert reward(completions=[chat(c) for c in completions], answer=golds) == [1.0, 1.0, 0.0, 0.0]
    # unparsable golds are skipped (TRL: None), whatever the completion
    unparsable = reward(
        completions=[chat("Answer is forty two."), chat(r"Some other content. \boxed{43}."), chat(r"\boxed{42}")],
        answer=["Answer is forty two.", "Answer is forty three.", "forty two"],
    )
    assert unparsable == [None, None, None]


def test_trl_reasoning_accuracy_vectors_and_the_intended_difference():
    """trl's `reasoning_accuracy_reward` ignores boxes inside the reasoning; math_equivalence reads the last box
    wherever it is (pair it with `think_answer_format` to demand the format). Same verdicts otherwise."""
    reward = get_reward("math_equivalence")
    completions = [
        r"<think> Reasoning content </think> \boxed{\frac{63}{400}}",
        r"Reasoning content </think> \boxed{\frac{63}{400}}",
        r"<think> Reasoning content </think> \boxed{\frac{64}{400}}",
        r"<think> The answer is \boxed{42} </think> Here's a wrong answer: \boxed{43}.",
        r"Correct answer \frac{63}{400} but completely missing reasoning content",
        r"<think> My answer is \boxed{42} </think> Some other text.",  # TRL: 0.0 (box inside the reasoning)
    ]
    golds = [r"\frac{63}{400}"] * 3 + [r"\boxed{42}", r"\frac{63}{400}", r"\boxed{42}"]
    assert reward(completions=[chat(c) for c in completions], answer=golds) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_trl_and_open_r1_cosine_vectors():
    """trl TestCosineScaledReward counts tokens (same as ours); open-r1 counts characters, so its vectors are given
    here as tokens: its "20-character" completion is the 22 characters of the box (padding only lengthens)."""
    reward = get_reward("cosine_scaled", max_len=100)
    right, wrong, gold = r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"\frac{1}{3}"
    cases = [(right, 25, 0.92678), (right, 75, 0.57322), (wrong, 25, -0.92678), (wrong, 75, -0.57322)]
    cases += [(right, 50, 0.75), (wrong, 50, -0.75), (right, 0, 1.0), (right, 100, 0.5), (wrong, 0, -1.0)]
    cases += [(wrong, 100, -0.5)]
    values = reward(
        completions=[chat(text) for text, _, _ in cases],
        completion_ids=[[1] * length for _, length, _ in cases],
        answer=[gold] * len(cases),
    )
    assert values == [pytest.approx(expected, abs=1e-4) for _, _, expected in cases]
    open_r1 = reward(
        completions=[r"\boxed{\frac{63}{400}}", r"\boxed{\frac{63}{400}}", r"\boxed{\frac{64}{400}}"] * 1
        + [r"\boxed{\frac{64}{400}}"],
        completion_ids=[[0] * 22, [0] * 80, [0] * 22, [0] * 80],
        answer=[r"\frac{63}{400}"] * 4,
    )
    assert open_r1 == [pytest.approx(v, abs=5e-3) for v in (0.943, 0.547, -0.942, -0.547)]  # assertAlmostEqual(2)


def test_open_r1_len_reward_difference_on_unparsable_golds():
    """open-r1's `len_reward` treats an unparsable gold as correct (0.5 for the shortest); kimi_length skips the
    group (None): with no gold there is no correctness to shape lengths by."""
    reward = get_reward("kimi_length")
    values = reward(
        prompts=["p", "p"],
        completions=[r"\boxed{answer}", r"\boxed{answer} " + "x" * 10],
        completion_ids=[[0] * 15, [0] * 26],
        answer=["unparseable_latex", "unparseable_latex"],
    )
    assert values == [None, None]
    math_group = reward(
        prompts=["p"] * 4,
        completions=[r"\boxed{\frac{63}{400}}", r"\boxed{\frac{63}{400}}", r"\boxed{\frac{64}{400}}"] * 1
        + [r"\boxed{\frac{64}{400}}"],
        completion_ids=[[0] * 22, [0] * 33, [0] * 22, [0] * 33],
        answer=[r"\frac{63}{400}"] * 4,
    )
    assert math_group[0] > math_group[1] and math_group[2] >= math_group[3] and not any(map(math.isnan, math_group))
