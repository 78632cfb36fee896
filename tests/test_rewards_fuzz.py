"""Property tests: every registry reward, on >= 10,000 random and adversarial completions each, returns one finite
float (or None) per completion within its documented range, never raises and never hangs.

Hypothesis draws the inputs of each batch (random text with control characters and odd unicode, and the seed of the
random generator that mixes it with adversarial pieces: deep nesting, unbalanced braces, huge numbers, 100 kB strings,
tag floods, towers of powers, malformed messages). Each example is one TRL-sized call of BATCH completions.
"""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rewards import get_reward

BATCH = 500
EXAMPLES = 20  # 20 x 500 = 10,000 completions per reward

_BIG = 100_000
ADVERSARIAL = [
    "{" * _BIG,
    "}" * 1000 + "\\boxed{" * 2000,
    "\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
    "\\boxed{" + "9" * _BIG + "}",
    "\\fbox{" + "-" * 5000 + "." * 5000 + "}",
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{2^2^2^2^2}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{99999999!}",
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{0/0}",
    "\\boxed{nan}",
    "\\boxed{inf}",
    "\\boxed{1e999}",
    "\\boxed{\\sqrt{-1}}",
    "\\boxed{\\infty}",
    "\\boxed ",
    "\\boxed",
    "\\boxed 7$",
    "\\boxed{\\text{" + "a" * 5000 + "}}",
    "\\boxed{" + "x+" * 3000 + "1}",
    "<think>\n" * 10_000,
    "\n</think>\n<answer>\n" * 5000,
    "<think>\n" + "\n</think>\n<answer>\n" * 3000 + "\n</answer" * 3000,
    "<answer>" * 10_000,
    "<think>x</think><answer>" + "Ann is a knight " * 5000 + "</answer>",
    "Step 1:" * 10_000,
    "Step " + "1" * 10_000,
    "\n-" * 20_000,
    "knight knave " * 5000,
    "\x00\x01\x02\x1b[31m\x7f\u200b\ufeff\ud800\U0001f600",
    "\\" * 10_000,
    "$" * 10_000,
    "#### " + "9" * 500,
    "a" * _BIG,
]
SNIPPETS = [
    "\\boxed{",
    "}",
    "{",
    "\\fbox{",
    "<think>\n",
    "\n</think>\n",
    "<answer>\n",
    "\n</answer>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "Step 3:",
    "First,",
    "\n- ",
    "1,234",
    "-7.5",
    "\\frac{1}{2}",
    "\\sqrt{2}",
    "^{",
    "!",
    "Ann is a knight",
    "Bob is a knave",
    "\\$",
    "\\%",
    "^\\circ",
    "\\,",
    "####",
]
GOLDS = [
    "#### 1,234",
    "72",
    72,
    "-3",
    "\\frac{1}{2}",
    "(1,2)",
    "\\text{(C)}",
    "x^2+1",
    "",
    None,
    "9" * 400,
    "\\boxed{5}",
    "1e999",
    ["not", "a", "string"],
]
MALFORMED = [
    None,
    5,
    3.5,
    {"content": None},
    [{"role": "assistant", "content": ["x", 1]}],
    [{"role": "user"}],
    [[]],
    [{"role": "assistant", "content": {"nested": "dict"}}],
]

# The range each reward promises (None always allowed).
RANGES = {
    "boxed_answer": (-1.0, 1.0),
    "math_equivalence": (0.0, 1.0),
    "think_answer_format": (0.0, 1.0),
    "tag_count": (0.0, 1.0),
    "reasoning_steps": (0.0, 1.0),
    "cosine_scaled": (-1.0, 1.0),
    "kimi_length": (-0.5, 0.5),
    "repetition_penalty": (-1.0, 0.0),
    "soft_overlong": (-1.0, 0.0),
    "kk_logic": (-3.0, 3.0),
}


def build_batch(rng, drawn_texts: list[str]) -> dict:
    """One call's keyword arguments: BATCH completions mixing drawn text, snippets and adversarial pieces."""
    completions, completion_ids, prompts = [], [], []
    for _ in range(BATCH):
        roll = rng.random()
        if roll < 0.02:
            completion = rng.choice(MALFORMED)
        else:
            pieces = []
            for _ in range(rng.randint(1, 6)):
                source = rng.random()
                if source < 0.03:
                    pieces.append(rng.choice(ADVERSARIAL))
                elif source < 0.5:
                    pieces.append(rng.choice(SNIPPETS))
                else:
                    pieces.append(rng.choice(drawn_texts))
            text = "".join(pieces)
            completion = text if rng.random() < 0.5 else [{"role": "assistant", "content": text}]
        completions.append(completion)
        ids_roll = rng.random()
        if ids_roll < 0.01:
            completion_ids.append(None)
        else:
            length = rng.choice([0, 1, 2, 3, rng.randint(0, 64), rng.randint(0, 5000)])
            completion_ids.append([rng.randint(0, 3) for _ in range(min(length, 64))] * max(1, length // 64))
        prompts.append(rng.choice(["p1", "p2", [{"role": "user", "content": "p3"}]]))
    solutions = [
        rng.choice([[True, False], [False, False, True], [], ["knight", "knave"], None]) for _ in range(BATCH)
    ]
    names = [rng.choice([["Ann", "Bob"], ["Ann", "Bob", "Cy"], [], ["A(b", "*"]]) for _ in range(BATCH)]
    for index in range(BATCH):  # only rows whose names and solution have the same length are valid data
        if solutions[index] is None or len(solutions[index]) != len(names[index]):
            solutions[index] = [True] * len(names[index])
    return dict(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        answer=[rng.choice(GOLDS) for _ in range(BATCH)],
        names=names,
        solution=solutions,
        trainer_state=None,
    )


REWARD_PARAMS = {
    "cosine_scaled": {"max_len": 100},
    "soft_overlong": {"max_completion_len": 64, "soft_punish_cache": 16},
}


@pytest.mark.parametrize("name", sorted(RANGES))
def test_reward_never_raises_and_stays_finite(name):
    reward = get_reward(name, **REWARD_PARAMS.get(name, {}))
    low, high = RANGES[name]
    seen = {"completions": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(drawn=st.lists(st.text(max_size=80), min_size=1, max_size=16), seed=st.integers(0, 2**32 - 1))
    def check(drawn, seed):
        batch = build_batch(random.Random(seed), drawn)
        values = reward(**batch)
        assert isinstance(values, list) and len(values) == BATCH
        for value in values:
            assert value is None or (isinstance(value, float) and math.isfinite(value) and low <= value <= high), value
        seen["completions"] += BATCH

    check()
    assert seen["completions"] >= 10_000


@given(
    st.lists(
        st.sampled_from(["<think>\n", "\n</think>\n", "<answer>\n", "\n</answer>", "\n", "x", "<", ">"]), max_size=14
    ).map("".join)
)
@settings(max_examples=1500, deadline=None, derandomize=True, database=None)
def test_think_answer_format_equals_open_r1_regex(text):
    """The linear-time matcher accepts exactly what open-r1's backtracking regex accepts."""
    pattern = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
    expected = 1.0 if re.match(pattern, text, re.DOTALL | re.MULTILINE) else 0.0
    assert get_reward("think_answer_format")(completions=[text]) == [expected]


@given(
    st.lists(st.sampled_from(["<answer>", "</answer>", "a", "<think>", "</think>", "\n"]), max_size=14).map("".join)
)
@settings(max_examples=1000, deadline=None, derandomize=True, database=None)
def test_last_answer_equals_logic_rl_regex(text):
    from rewards.logic import _last_answer

    matches = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    assert _last_answer(text) == (matches[-1].strip() if matches else None)
