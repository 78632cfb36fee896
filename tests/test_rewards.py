"""Unit tests of the reward registry: worked values from ../shared/notes/reward-formulas.md, both completion formats,
GSM8K golds, names, errors, pickling, import isolation, doctests and the bounded symbolic check."""

from __future__ import annotations

import doctest
import importlib
import math
import pickle
import re
import subprocess
import sys
import threading
import time

import pytest

import rewards
from rewards import get_reward

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def both_formats(texts: list[str]) -> list[list]:
    """The same completions as plain strings and as conversational messages."""
    return [texts, [chat(text) for text in texts]]


# ----------------------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
        (r"\boxed 5$ and more", "5"),
        (r"\boxed{}", ""),
        (r"\boxed{unclosed", None),
        (r"\boxed{1}\boxed{", None),  # the last box is truncated: no answer
        ("no box at all", None),
        (r"\boxedx", None),
    ],
)
def test_extract_boxed(text, expected):
    assert rewards.extract_boxed(text) == expected


def test_completion_text_formats():
    assert rewards.completion_text("plain") == "plain"
    assert rewards.completion_text(chat("msg")) == "msg"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert rewards.completion_text(parts) == "ab"
    tool_use = [chat("first")[0], {"role": "tool", "content": "42"}, chat("final")[0]]
    assert rewards.completion_text(tool_use) == "first\nfinal"
    assert rewards.completion_text(12) == "" and rewards.completion_text([{"content": None}]) == ""


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,234", 1234.0),
        ("72", 72.0),
        (72, 72.0),
        ("-3.5", -3.5),
        ("", None),
        (None, None),
        ("no number", None),
    ],
)
def test_gold_number(gold, expected):
    assert rewards.gold_number(gold) == expected


# ----------------------------------------------------------------------------------------------- boxed_answer

# Seed-rule consequences listed in the notes (§5).
BOXED_CASES = [
    (r"\boxed{1,000}", "#### 1,000", 1.0),
    (r"\boxed{\$18.00}", "#### 18", 1.0),
    (r"\boxed{x = -3}", "-3", 1.0),
    (r"\boxed{5\%}", "5", 1.0),
    (r"\boxed{3\text{ apples}}", "3", 1.0),
    (r"\fbox{42}", "42", 1.0),
    (r"\boxed{\frac{1}{2}}", "12", 1.0),  # the seed rule's known false positives
    (r"\boxed{10^{3}}", "103", 1.0),
    (r"\boxed{2\times10^3}", "2103", 1.0),
    (r"\boxed{1.2.3}", "1.2", -1.0),
    (r"\boxed{--5}", "5", -1.0),
    ("\\boxed{\u22125}", "5", -1.0),  # U+2212 and en-dash minus signs are "-" (they were dropped: +1 against 5)
    ("\\boxed{\u2013 5}", "#### -5", 1.0),
    (r"\boxed{\pm 5}", "5", 1.0),  # the seed rule keeps no sign but "-": a known false positive
    (r"\boxed{5-3}", "2", -1.0),
    (r"\boxed{-}", "0", -1.0),
    (r"\boxed{}", "0", -1.0),
    ("The answer is 72.", "72", -1.0),
    (r"\boxed{73}", "Work... #### 72", -1.0),
    (r"\boxed{9" + "9" * 500 + "}", "9", -1.0),  # overflows a float: not a number
]


@pytest.mark.parametrize("completions_format", ["plain", "chat"])
def test_boxed_answer_seed_rule(completions_format):
    texts = [text for text, _, _ in BOXED_CASES]
    completions = texts if completions_format == "plain" else [chat(text) for text in texts]
    got = rewards.boxed_answer(
        prompts=["q"] * len(texts), completions=completions, answer=[g for _, g, _ in BOXED_CASES]
    )
    assert got == [expected for _, _, expected in BOXED_CASES]


def test_boxed_answer_rlinf_variant_and_gsm8k_gold(shared_data):
    import json

    rows = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:50]]
    reward = get_reward("boxed_answer", correct=5.0, incorrect=-5.0)
    finals = [row["answer"].split("####")[1].strip() for row in rows]
    completions = [rf"so \boxed{{{final}}}" for final in finals] + [rf"\boxed{{{final}1}}" for final in finals]
    assert reward(completions=completions, answer=[row["answer"] for row in rows] * 2) == [5.0] * 50 + [-5.0] * 50
    assert reward.is_correct(completions=completions[:2], answer=[rows[0]["answer"], "no gold"]) == [True, None]


# ----------------------------------------------------------------------------------------------- math_equivalence

EQUIVALENCE_CASES = [
    (r"\frac{1}{2}", r"\frac12", True),
    (r"\frac{1}{2}", "0.5", True),
    (r"\frac{3}{4}", r"\tfrac34", True),
    (r"\sqrt{2}", r"\sqrt2", True),
    (r"2\sqrt{3}", r"\sqrt{12}", True),
    ("1000", r"1\,000", True),
    ("1000", "1{,}000", True),
    ("#### 1,234", "1234", True),
    ("(1,2)", "(1, 2)", True),
    ("[1,2)", "[1,2)", True),
    (r"\{1,2\}", r"\{2,1\}", True),
    (r"\text{(C)}", "C", True),
    (r"30^\circ", "30", True),
    ("5", r"5\%", True),
    ("10", r"10\text{ cm}", True),
    (r"\frac{14}{3}", r"4\frac{2}{3}", True),
    ("x^2+1", "1+x^2", True),
    ("-3", "x = -3", True),
    ("18", r"\$18.00", True),
    (r"\frac{63}{400}", r"\frac{64}{400}", False),
    ("6", "3", False),
    ("(1,2)", "(2, 1)", False),
    ("x^2+1", "x^2-1", False),
    ("3", r"\text{three}", False),
    ("52_8", "52_9", False),  # math-verify drops the base subscript; compared literally
    ("4210_{5}", "4210_5", True),
    (r"15\mbox{ cm}^2", r"15\mbox{ cm}^3", False),  # math-verify drops the unit with its power
    (r"15\mbox{ cm}^2", "15", True),
]


@pytest.mark.parametrize("completions_format", ["plain", "chat"])
def test_math_equivalence_cases(completions_format):
    golds = [gold for gold, _, _ in EQUIVALENCE_CASES]
    texts = [rf"Final: \boxed{{{answer}}}" for _, answer, _ in EQUIVALENCE_CASES]
    completions = texts if completions_format == "plain" else [chat(text) for text in texts]
    got = rewards.math_equivalence(completions=completions, answer=golds)
    assert got == [1.0 if expected else 0.0 for _, _, expected in EQUIVALENCE_CASES]


def test_math_equivalence_open_r1_vectors_and_unparseable_gold():
    reward = get_reward("math_equivalence")
    completions = [r"\boxed{\frac{63}{400}}", r"\boxed{\frac{64}{400}}", r"\boxed{3}", "no box", r"\boxed{1}"]
    golds = [r"\frac{63}{400}", r"\frac{63}{400}", "6", "6", r"\text{}"]
    assert reward(completions=completions, answer=golds) == [1.0, 0.0, 0.0, 0.0, None]


def test_math_equivalence_prescreen_rejects_towers_without_sympy():
    from rewards._verify import shared_pool

    timeouts_before = shared_pool().timeouts
    completions = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2^2^2^2}", r"\boxed{10^{123456}}", r"\boxed{100000!}"]
    assert rewards.math_equivalence(completions=completions, answer=["x"] * 4) == [0.0] * 4
    assert shared_pool().timeouts == timeouts_before


# ----------------------------------------------------------------------------------------------- format rewards


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nreason\n</think>\n<answer>\n42\n</answer>", 1.0),
        ("<think>\n\n</think>\n<answer>\n42\n</answer>", 1.0),  # empty think
        ("<think>\nr\n</think>\n<answer>\n42\n</answer>\nextra text", 1.0),  # MULTILINE `$`
        ("<think>\nr\n</think>\n<answer>\n1\n</answer>\n<answer>\n2\n</answer>", 1.0),
        ("<think>\nr\n</think>\n<answer>\n42\n</answer> same line", 0.0),
        ("<think>a</think><answer>b</answer>", 0.0),
        (" <think>\nr\n</think>\n<answer>\n42\n</answer>", 0.0),
        ("<think>\nr\n</think>\n<answer>\n</answer>", 0.0),
    ],
)
def test_think_answer_format_matches_open_r1(text, expected):
    pattern = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
    assert (1.0 if re.match(pattern, text, re.DOTALL | re.MULTILINE) else 0.0) == expected  # the vector is right
    for completions in both_formats([text]):
        assert rewards.think_answer_format(completions=completions) == [expected]


def test_prefilled_think():
    completion = "reasoning\n</think>\n<answer>\n42\n</answer>"
    assert rewards.think_answer_format(completions=[completion]) == [0.0]
    assert get_reward("think_answer_format", prefilled_think=True)(completions=[completion]) == [1.0]
    assert rewards.tag_count(completions=[completion]) == [0.75]
    assert get_reward("tag_count", prefilled_think=True)(completions=[completion]) == [1.0]


def test_tag_count_vectors():
    full = "<think>\na\n</think>\n<answer>\nb\n</answer>"
    texts = [full, full.replace("<think>\n", ""), "nothing", full + full]
    for completions in both_formats(texts):
        assert rewards.tag_count(completions=completions) == [1.0, 0.75, 0.0, 0.0]


def test_reasoning_steps_vectors():
    texts = [
        "Step 1: a\nStep 2: b\nStep 3: c",
        "First, a. Second, b. Next, c. Finally, d.",
        "First, a. Finally, b.",
        "1. a\n2. b\n3. c",
        "plain",
        "intro\n- a\n* b",
    ]
    for completions in both_formats(texts):
        assert rewards.reasoning_steps(completions=completions) == [1.0, 1.0, 2 / 3, 1 / 3, 0.0, 2 / 3]


# ----------------------------------------------------------------------------------------------- length rewards


def test_cosine_scaled_vectors_tokens_and_clamp():
    reward = get_reward("cosine_scaled", max_len=100, checker="boxed_answer")
    right, wrong = r"\boxed{7}", r"\boxed{8}"
    lengths = [22, 80, 0, 100, 150, 200]
    for completions in both_formats([right] * 6 + [wrong] * 6):
        got = reward(completions=completions, completion_ids=[[1] * n for n in lengths * 2], answer=["7"] * 12)
        expected = [0.9426, 0.5477, 1.0, 0.5, 0.5, 0.5, -0.9426, -0.5477, -1.0, -0.5, -0.5, -0.5]
        assert [round(value, 4) for value in got] == expected
    # against TRL's own formula (same clamp, same token lengths)
    from trl.rewards import get_cosine_scaled_reward

    trl_reward = get_cosine_scaled_reward(max_len=100)
    ids = [[1] * 50, [1] * 50]
    trl_values = trl_reward([chat(r"\boxed{\frac{1}{3}}"), chat(r"\boxed{\frac{1}{2}}")], [r"\frac{1}{3}"] * 2, ids)
    ours = get_reward("cosine_scaled", max_len=100)(
        completions=[r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"], completion_ids=ids, answer=[r"\frac{1}{3}"] * 2
    )
    assert ours == pytest.approx(trl_values) and ours == [0.75, -0.75]


def test_cosine_scaled_custom_values_and_none_gold():
    reward = get_reward(
        "cosine_scaled",
        max_len=10,
        min_value_wrong=-10.0,
        max_value_wrong=0.0,
        min_value_correct=1.0,
        max_value_correct=2.0,
        checker="boxed_answer",
    )
    got = reward(
        completions=[r"\boxed{1}", r"\boxed{2}", r"\boxed{1}"],
        completion_ids=[[0], [0] * 10, [0]],
        answer=["1", "1", "no gold"],
    )
    assert [round(v, 4) for v in got[:2]] == [round(1 + 0.5 * (1 + math.cos(math.pi / 10)), 4), 0.0]
    assert got[2] is None


def test_kimi_length_vectors_groups_and_equal_lengths():
    reward = get_reward("kimi_length", checker="boxed_answer")
    right, wrong = r"\boxed{7}", r"\boxed{8}"
    texts = [right, wrong, right, wrong, right, wrong]
    ids = [[0] * 100, [0] * 150, [0] * 200, [0] * 300, [0] * 5, [0] * 5]
    prompts = ["p1"] * 4 + [[{"role": "user", "content": "p2"}]] * 2
    for completions in both_formats(texts):
        got = reward(prompts=prompts, completions=completions, completion_ids=ids, answer=["7"] * 6)
        assert got == [0.5, 0.0, 0.0, -0.5, 0.0, 0.0]


def test_repetition_penalty_vectors_match_trl():
    reward = get_reward("repetition_penalty", ngram_size=2, max_penalty=-1.0)
    ids = [[1, 2, 3, 4], [5, 5, 5, 5, 5], [7], [1, 2, 1, 2, 1, 2]]
    for completions in both_formats(["x"] * 4):
        assert reward(completions=completions, completion_ids=ids) == [0.0, -0.75, 0.0, -0.6]
    # "this is a this is a test": n=2, p=-1 -> -1/3; n=3, p=-2 -> -0.4
    sentence = [[1, 2, 3, 1, 2, 3, 4]]
    assert reward(completions=["x"], completion_ids=sentence) == [pytest.approx(-1 / 3)]
    assert get_reward("repetition_penalty", ngram_size=3, max_penalty=-2.0)(completion_ids=sentence) == [
        pytest.approx(-0.4)
    ]
    # word vectors of the notes, on token ids standing for words: "A B C A B C" (n=3) -> -0.25
    assert rewards.repetition_penalty(completion_ids=[[1, 2, 3, 1, 2, 3], [1, 1, 1, 1], [1, 2, 1, 2]]) == [
        -0.25,
        -0.5,
        0.0,
    ]
    with pytest.raises(ValueError, match="max_penalty must be <= 0"):
        get_reward("repetition_penalty", max_penalty=0.5)


def test_soft_overlong_vectors():
    reward = get_reward("soft_overlong", max_completion_len=20480, soft_punish_cache=4096)
    lengths = [16384, 16385, 18432, 20480, 30000]
    for completions in both_formats(["x"] * 5):
        got = reward(completions=completions, completion_ids=[[0] * n for n in lengths])
        assert [round(v, 6) for v in got] == [0.0, -0.000244, -0.5, -1.0, -1.0]
    reward.max_completion_len, reward.soft_punish_cache = 100, 20  # a phase callback changes the cap
    assert reward(completion_ids=[[0] * 50, [0] * 90, [0] * 110]) == [0.0, -0.5, -1.0]
    assert reward.__name__ == "soft_overlong"  # metric name stays stable
    hard = get_reward("soft_overlong", max_completion_len=10, soft_punish_cache=0)
    assert hard(completion_ids=[[0] * 10, [0] * 11]) == [0.0, -1.0]


def test_length_rewards_need_completion_ids():
    with pytest.raises(TypeError, match="soft_overlong.*completion_ids"):
        rewards.soft_overlong(completions=["x"])


# ----------------------------------------------------------------------------------------------- kk_logic

KK_GOOD = "<think>reasoning</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>"


@pytest.mark.parametrize(
    "text, expected",
    [
        (KK_GOOD, 3.0),
        (KK_GOOD.replace("Oliver is a knave", "Oliver is a knight"), -0.5),
        (KK_GOOD.replace("(1) Zoey", "Knights tell the truth. (1) Zoey"), -1.0),  # extra "Knight" breaks parsing
        ("<think>reasoning</think> Zoey is a knight, Oliver is a knave", -3.0),  # no <answer>
        ("<think><think>" + KK_GOOD[7:], -3.0),  # duplicate <think> with a right answer
        ("<answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer><think>x</think>", -3.0),  # wrong order
    ],
)
def test_kk_logic_vectors(text, expected):
    for completions in both_formats([text]):
        by_bools = rewards.kk_logic(completions=completions, names=[["Zoey", "Oliver"]], solution=[[True, False]])
        by_text = rewards.kk_logic(
            completions=completions, solution_text_format=["(1) Zoey is a knight\n(2) Oliver is a knave"]
        )
        assert by_bools == by_text == [expected]


def test_kk_logic_prefilled_think_and_real_data(shared_data):
    import json

    row = json.loads((shared_data / "kk" / "3ppl_test.jsonl").read_text().splitlines()[0])
    body = "\n".join(
        f"({i + 1}) {name} is a {'knight' if role else 'knave'}"
        for i, (name, role) in enumerate(zip(row["names"], row["solution"]))
    )
    completion = f"Let me think.</think><answer>{body}</answer>"
    columns = {"names": [row["names"]], "solution": [row["solution"]], "quiz": [row["quiz"]]}
    assert rewards.kk_logic(completions=[completion], **columns) == [-3.0]
    reward = get_reward("kk_logic", prefilled_think=True)
    assert reward(completions=[completion], **columns) == [3.0]
    assert reward.is_correct(completions=[completion], **columns) == [True]
    assert reward.__name__ == "kk_logic_prefilled_thinkTrue"


# ----------------------------------------------------------------------------------------------- registry


def test_available_and_unknown_name():
    assert set(rewards.available()) >= {
        "boxed_answer",
        "math_equivalence",
        "think_answer_format",
        "tag_count",
        "reasoning_steps",
        "cosine_scaled",
        "kimi_length",
        "repetition_penalty",
        "soft_overlong",
        "kk_logic",
    }
    with pytest.raises(ValueError, match="Did you mean 'boxed_answer'"):
        get_reward("boxed_answr")
    with pytest.raises(TypeError, match="reward 'tag_count' does not take"):
        get_reward("tag_count", max_len=3)


def test_names_are_unique_stable_and_overridable():
    names = [
        get_reward("boxed_answer").__name__,
        get_reward("boxed_answer", correct=5.0, incorrect=-5.0).__name__,
        get_reward("cosine_scaled").__name__,
        get_reward("cosine_scaled", max_len=512).__name__,
        get_reward("cosine_scaled", checker="boxed_answer").__name__,
        get_reward("soft_overlong", max_completion_len=1024, soft_punish_cache=256).__name__,
    ]
    assert len(set(names)) == len(names)
    assert names[0] == "boxed_answer" and names[3] == "cosine_scaled_max_len512"
    assert get_reward("boxed_answer", correct=5.0, incorrect=-5.0).__name__ == names[1]  # stable
    assert get_reward("boxed_answer", name="acc").__name__ == "acc"
    for name in rewards.BUILTIN_REWARDS:
        assert getattr(rewards, name).__name__ == name  # the default instance behind `rewards.<name>`


def test_register_function_factory_and_class():
    @rewards.register("test_len_fn")
    def length_reward(completions, scale=1.0, **kwargs):
        return [scale * len(rewards.completion_text(c)) for c in completions]

    @rewards.register("test_len_factory")
    def make_length_reward(scale=1.0):
        def reward(completions, **kwargs):
            return [scale * len(c) for c in completions]

        reward.__name__ = f"test_len_factory_{scale}"
        return reward

    @rewards.register("test_len_class")
    class LengthReward:
        def __init__(self, scale=1.0):
            self.scale = scale

        def __call__(self, completions, **kwargs):
            return [self.scale * len(c) for c in completions]

    try:
        assert {"test_len_fn", "test_len_factory", "test_len_class"} <= set(rewards.available())
        fn = get_reward("test_len_fn", scale=2.0)
        assert fn(completions=["ab", chat("abc")]) == [4.0, 6.0] and fn.__name__ == "test_len_fn_scale2.0"
        assert get_reward("test_len_fn").__name__ == "test_len_fn"
        assert get_reward("test_len_factory", scale=3.0)(completions=["ab"]) == [6.0]
        instance = get_reward("test_len_class", scale=0.5)
        assert instance(completions=["ab"]) == [1.0] and instance.__name__ == "test_len_class"
        with pytest.raises(ValueError, match="already registered"):
            rewards.register("boxed_answer")(length_reward)
        with pytest.raises(ValueError, match="identifier"):
            rewards.register("bad name")
    finally:
        for name in ("test_len_fn", "test_len_factory", "test_len_class"):
            rewards.registry._USER_REWARDS.pop(name, None)


def test_missing_gold_column_is_one_clear_error():
    for name in ("boxed_answer", "math_equivalence", "cosine_scaled", "kimi_length"):
        reward = get_reward(name)
        with pytest.raises(rewards.MissingColumnError) as error:
            reward(prompts=["q"], completions=[r"\boxed{1}"], completion_ids=[[1]], solution=["1"], trainer_state=None)
        message = str(error.value)
        assert f"'{reward.__name__}'" in message or name in message
        assert "'answer'" in message and "['solution']" in message and "answer_key" in message
    with pytest.raises(rewards.MissingColumnError, match="kk_logic.*'names'.*'solution_text_format'.*\\['quiz'\\]"):
        rewards.kk_logic(completions=["x"], quiz=["q"])
    assert get_reward("boxed_answer", answer_key="solution")(completions=[r"\boxed{1}"], solution=["1"]) == [1.0]


def test_check_columns_raises_the_first_call_error_before_training():
    """The same error as the first reward call, from the dataset's column names alone (no generation needed)."""
    for name in ("boxed_answer", "math_equivalence", "cosine_scaled", "kimi_length", "kk_logic"):
        reward = get_reward(name)
        with pytest.raises(rewards.MissingColumnError) as at_call:
            reward(prompts=["q"], completions=[r"\boxed{1}"], completion_ids=[[1]], solution=["1"], quiz=["q"])
        with pytest.raises(rewards.MissingColumnError) as early:
            rewards.check_columns([rewards.tag_count, reward], ["prompt", "solution", "quiz"])
        # same reward, same missing column; the early one lists the dataset's columns (TRL passes `prompt` as prompts)
        assert str(early.value).split(", but ")[0] == str(at_call.value).split(", but ")[0]
        assert "['prompt', 'quiz', 'solution']" in str(early.value) and "['quiz', 'solution']" in str(at_call.value)
    columns = ["prompt", "answer", "names", "solution"]
    rewards.check_columns([get_reward(name) for name in rewards.BUILTIN_REWARDS], columns)  # all satisfied
    rewards.check_columns(get_reward("kk_logic"), ["prompt", "solution_text_format"])  # the other gold form
    rewards.check_columns([lambda completions, **kwargs: [0.0]], ["prompt"])  # plain functions are not checked
    with pytest.raises(rewards.MissingColumnError, match="'kk_logic'.*'names' \\+ 'solution'"):
        rewards.check_columns([get_reward("kk_logic")], ["prompt", "solution"])


def test_rewards_are_picklable_and_keep_their_name():
    for name in rewards.available():
        restored = pickle.loads(pickle.dumps(rewards.__dict__[name]))
        assert restored.__name__ == name
    restored = pickle.loads(pickle.dumps(get_reward("boxed_answer", correct=5.0, incorrect=-5.0)))
    assert restored(completions=[r"\boxed{2}"], answer=["2"]) == [5.0]


def test_is_correct_helper():
    kwargs = dict(completions=[r"\boxed{2}", r"\boxed{3}", "x"], answer=["2", "2", "2"])
    for name in ("boxed_answer", "math_equivalence"):
        assert rewards.is_correct(get_reward(name), **kwargs) == [True, False, False]
        reward = get_reward(name)
        assert (reward.correct, reward.incorrect) in {(1.0, -1.0), (1.0, 0.0)}
    with pytest.raises(TypeError, match="not a correctness reward"):
        rewards.is_correct(rewards.tag_count, **kwargs)


def test_import_is_light_and_independent_of_prorl_trl():
    heavy = "('prorl_trl', 'sympy', 'math_verify', 'trl', 'torch')"
    code = f"import sys, rewards; print(sorted(m for m in {heavy} if m in sys.modules))"
    output = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert output.stdout.strip() == "[]"


KK_ANN = "<think>x</think><answer>Ann is a knight</answer>"


def test_every_reward_scores_with_prorl_trl_unimportable():
    """Not only the import: each default reward scores a batch, with the same values as here, while any import of
    prorl_trl fails (a failed lazy import inside a reward would otherwise only show up as fallback values)."""
    import json

    batch = dict(
        prompts=["p"] * 3,
        completions=["<think>\nStep 1: a Step 2: b Step 3: c\n</think>\n<answer>\n\\boxed{3}\n</answer>", "x", KK_ANN],
        completion_ids=[[1, 2], [1, 1, 1, 1], [0] * 18432],
        answer=["3"] * 3,
        names=[["Ann"]] * 3,
        solution=[[True]] * 3,
    )
    code = """import json, sys
sys.modules["prorl_trl"] = None  # `import prorl_trl` now raises ImportError
import rewards
batch = json.loads(sys.argv[1])
print(json.dumps({name: getattr(rewards, name)(**batch) for name in rewards.BUILTIN_REWARDS}))
"""
    output = subprocess.run(
        [sys.executable, "-c", code, json.dumps(batch)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert output.returncode == 0, output.stderr
    expected = {name: getattr(rewards, name)(**batch) for name in rewards.BUILTIN_REWARDS}
    assert json.loads(output.stdout) == expected
    # every reward gives at least one value that is not its fallback (0.0, or -3.0 for kk_logic)
    for name in ("boxed_answer", "math_equivalence", "think_answer_format", "tag_count", "reasoning_steps"):
        assert expected[name][0] == 1.0, name
    assert expected["kk_logic"] == [-1.0, -3.0, 3.0] and expected["soft_overlong"] == [0.0, 0.0, -0.5]
    assert expected["repetition_penalty"][1] == -0.5 and expected["kimi_length"][0] == 0.5
    assert expected["cosine_scaled"][2] == -0.5


def test_guard_trl_grpo_script_resolves_dotted_reward_paths():
    """Guard (trl==1.16.0): `trl grpo` resolves `--reward_funcs a.b` with importlib + getattr inline in main(); the
    end-to-end run through that code is in test_rewards_trainer.py."""
    import inspect

    grpo = importlib.import_module("trl.scripts.grpo")

    source = inspect.getsource(grpo.main)
    assert 'module_path, func_name = func_name.rsplit(".", 1)' in source and "getattr(module, func_name)" in source


@pytest.mark.parametrize(
    "module",
    [
        "rewards._text",
        "rewards._numbers",
        "rewards._polynomial",
        "rewards._screen",
        "rewards.correctness",
        "rewards.formatting",
        "rewards.length",
        "rewards.logic",
        "rewards.registry",
    ],
)
def test_docstring_examples(module):
    """Every docstring Example runs and prints the literal list of rewards (``` fences are markdown, not output)."""

    class FenceParser(doctest.DocTestParser):
        def parse(self, string, name="<string>"):
            return super().parse(re.sub(r"^\s*```.*$", "", string, flags=re.MULTILINE), name)

    tests = doctest.DocTestFinder(parser=FenceParser()).find(importlib.import_module(module))
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    try:
        for test in tests:
            runner.run(test)
    finally:
        rewards.registry._USER_REWARDS.pop("shorter_is_better_demo", None)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0


def test_kk_logic_reads_gold_roles_of_any_bool_kind_and_refuses_unknown_words():
    """A `solution` column of numpy bools (a dataset built with pandas), 0/1 or "True"/"False" text scored every
    right answer -0.5 before 2026-11-29 (`str(numpy.True_).lower()` is "true", not a role); an unknown role word
    gives None (TRL skips the row) instead of a score no completion can earn."""
    import numpy as np

    from rewards import get_reward

    kk = get_reward("kk_logic")
    right = "<think>x</think><answer>(1) Ann is a knight\n(2) Bob is a knave</answer>"
    solutions = [[True, False], [np.bool_(True), np.bool_(False)], [1, 0], ["True", "False"], ["knight", "knave"]]
    for solution in solutions:
        assert kk(completions=[right], names=[["Ann", "Bob"]], solution=[solution]) == [3.0], solution
    assert kk(completions=[right], names=[["Ann", "Bob"]], solution=[["knight", "spy"]]) == [None]
