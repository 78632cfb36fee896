"""`math_equivalence` never gives false credit (issue 13, items 1, 2, 4, 5, 6, 7): every reproducer of the issue,
both directions of each, and the fast-path pieces (numbers with units, polynomials, the screen) on their own.

math-verify appears here as a peer, configured as `trl.rewards.accuracy_reward` configures it (see
benchmarks/_math_perturbations.py); where the verdicts differ the test says which one is right and why.
"""

from __future__ import annotations

import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

import rewards
from rewards import get_reward
from rewards._numbers import quantities_match, read_quantity, split_unit
from rewards._polynomial import read_polynomial
from rewards._screen import is_math_gold, misread, text_gold_key, unsafe, without_calls

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _math_perturbations import MathVerify  # noqa: E402


@pytest.fixture(scope="module")
def math_verify():
    return MathVerify()


def grade(pairs, **params):
    """math_equivalence on (boxed answer, gold) pairs."""
    reward = get_reward("math_equivalence", **params)
    return reward(completions=[rf"\boxed{{{answer}}}" for answer, _ in pairs], answer=[gold for _, gold in pairs])


# ----------------------------------------------------------------------------------------------- item 1

FALSE_CREDIT = [  # (answer, gold): letters and clauses are never units
    ("3x", "3"),
    ("3i", "3"),
    ("2n", "2"),
    ("y = 3x", "3"),
    ("5 or six", "5"),
    ("4", "4i"),
    ("2", "2k"),  # MATH-500 has gold 2k: answer 2 scored 1.0
    ("2d", "2"),  # math-verify drops `d`, `t`, `m`, ... as unit names
    ("5 m", "5"),
    ("3t", "3"),
    (r"5 \quad 6", "11"),  # math-verify adds numbers separated by spaces
    (r"5\;6", "11"),
    ("5 6", "56"),
    ("7 = 5", "5"),  # math-verify keeps the right side of any equation
    ("2+2 = 5", "5"),
    ("x = 7 = 11", "11"),
    (r"0 \text{, but maybe } 7", "0"),  # a zero absorbs words multiplied in as symbols
    ("0 but 7", "0"),
    (r"5\text{ apples}", "5"),  # not a known unit: never stripped
    (r"15\text{ cm}", r"15\text{ m}"),  # two different units
    (r"15\mbox{ cm}^3", r"15\mbox{ cm}^2"),
]


def test_no_false_credit_from_letters_words_or_clauses():
    assert grade(FALSE_CREDIT) == [0.0] * len(FALSE_CREDIT)


def test_math_verify_credits_some_of_them(math_verify):
    """The peer's verdicts on the same pairs: these are math-verify's false credits that the screen exists for."""
    credited = [(answer, gold) for answer, gold in FALSE_CREDIT if math_verify(gold, answer)]
    assert set(credited) >= {("2d", "2"), ("5 m", "5"), ("3t", "3"), (r"5 \quad 6", "11"), ("7 = 5", "5")}
    assert (r"0 \text{, but maybe } 7", "0") in credited and (r"5\text{ apples}", "5") in credited


KNOWN_UNITS = [  # stripped, because they are known units or wrappers
    (r"5\text{ cm}", "5"),
    (r"5 \mbox{ meters}", "5"),
    ("5 dollars", "5"),
    (r"\$5", "5"),
    (r"30^\circ", "30"),
    (r"30^{\circ}", r"30 \text{ degrees}"),
    (r"\text{12}", "12"),
    (r"864 \text{ square inches}", r"864 \mbox{ inches}^2"),
    (r"\frac{270}{7}", r"\frac{270}7\text{ degrees}"),
    ("x = 5", "5"),
    ("5", "x=5"),
]


def test_known_units_and_wrappers_still_count():
    assert grade(KNOWN_UNITS) == [1.0] * len(KNOWN_UNITS)


# ----------------------------------------------------------------------------------------------- item 2


def test_golds_that_are_not_math_give_none_and_text_golds_compare_as_text():
    pairs = [
        ("42", "forty two"),
        ("3", "N/A"),
        ("1", "proof omitted"),
        ("two forty", "forty two"),  # math-verify: both are f*o*r*t*y*t*w*o, so 1.0
        ("1", ""),
        (r"\text{Monday}", r"\text{Monday}"),
        ("monday", r"\text{Monday}"),
        (r"\text{yadnom}", r"\text{Monday}"),  # same letters, other word
        ("(C)", r"\text{(C)}"),
        ("C", r"\text{(C)}"),
        (r"\text{(D)}", r"\text{(C)}"),
        (r"\textbf{Evelyn}", r"\text{Evelyn}"),
    ]
    assert grade(pairs) == [None, None, None, None, None, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_length_rewards_skip_problems_whose_gold_is_not_math():
    """cosine_scaled and kimi_length shape lengths only where correctness is known."""
    completions = [r"\boxed{42}", r"\boxed{41}", r"\boxed{42}", r"\boxed{41}"]
    ids = [[0] * 10, [0] * 20, [0] * 10, [0] * 20]
    golds = ["forty two", "forty two", "42", "42"]
    cosine = get_reward("cosine_scaled", max_len=100)(completions=completions, completion_ids=ids, answer=golds)
    assert cosine[:2] == [None, None] and all(isinstance(value, float) for value in cosine[2:])
    prompts = ["p1", "p1", "p2", "p2"]
    kimi = get_reward("kimi_length")(prompts=prompts, completions=completions, completion_ids=ids, answer=golds)
    assert kimi == [None, None, 0.5, -0.5]


# ----------------------------------------------------------------------------------------------- items 4, 5, 7


ROUNDING = [  # (answer, gold, expected): math-verify's 6-decimal rule, both directions of percent
    ("0.333333", "1/3", True),
    ("0.0833333333333333", r"\frac{1}{12}", True),
    ("0.333333333333", "1/3", True),
    ("0.3333", "1/3", False),
    ("0.33", "1/3", False),
    ("0.1", r"10\%", True),
    (r"10\%", "0.1", True),
    ("10", r"10\%", True),  # two integers compare without the percent sign (math-verify)
    (r"5\%", "5", True),
    (r"50\%", r"\frac{1}{2}", True),
    ("12.5", r"12.5\%", False),  # a decimal percent is its value/100 (math-verify)
    ("5.0", "5", True),
    ("5.0000001", "5", False),  # against an integer only exact equality counts (sympy: Integer != Float)
    ("10.0000001", "10.0", True),
    ("1.9999999", "2.0", True),
    ("5.000001", "5.0", False),
    (r"100\%", "1.0", True),
]
# The one deliberate difference: two decimals both written beyond 6 places compare at the shorter one's precision.
STRICTER_THAN_MATH_VERIFY = [(".0000673", ".0000672", False), ("0.3333334", "0.3333333", False)]


def test_rounding_follows_math_verify(math_verify):
    pairs = [(answer, gold) for answer, gold, _ in ROUNDING]
    expected = [expected for _, _, expected in ROUNDING]
    assert grade(pairs) == [1.0 if value else 0.0 for value in expected]
    assert [math_verify(gold, answer) for answer, gold in pairs] == expected
    stricter = [(answer, gold) for answer, gold, _ in STRICTER_THAN_MATH_VERIFY]
    assert grade(stricter) == [0.0, 0.0] and [math_verify(gold, answer) for answer, gold in stricter] == [True, True]
    assert grade([("0.08333333", "0.0833333333333333"), ("0.5000001", "0.5"), ("0.54", "0.5")]) == [1.0, 1.0, 0.0]


def test_thousands_separators():
    pairs = [
        (r"11,\! 111,\! 111,\! 100", "11111111100"),
        (r"32,\! 349", "32349"),
        (r"32,\!349", "32349"),
        ("32,349", "32349"),
        (r"32\,349", "32349"),
        ("32{,}349", "32349"),
        ("32 349", "32349"),
        (r"10, \!080", "10080"),
    ]
    assert grade(pairs) == [1.0] * len(pairs)
    assert grade([("3,49", "349"), ("0,349", "349")]) == [0.0, 0.0]


# 2026-11-29 review against math-verify: each was ours 1 / its 0 (the first three: a grouped gold was read as the
# list 58, 500 in any order) or ours 0 / its 1 (the percents and x^0)
PEER_REVIEW = [
    ("500, 58", "58,500", False),  # MATH-500's license-plate gold
    ("500,58", "58,500", False),
    ("234, 1", "1,234", False),
    ("58,500", "58,500", True),
    ("58500", "58,500", True),
    (r"200\%", "2", True),  # two integers: with or without the percent sign
    ("2", r"200\%", True),
    (r"100\%", "1", True),
    ("x^0", "1", True),
    ("2x^0", "2", True),
    ("3x^2+x^0", "3x^2+1", True),
    (r"\frac x2", r"\frac{2}{x}", False),
]
# Intended difference from math-verify as TRL configures it (`malformed_operators=False`, our peer): a letter argument
# without braces is one token, as LaTeX reads it and as `\frac12` already was; math-verify's defaults agree with us.
LETTER_TOKENS = [(r"\sqrt x", r"\sqrt{x}"), (r"2\sqrt x", r"2\sqrt{x}"), (r"\frac x2", r"\frac{x}{2}")]


def test_review_cases_agree_with_math_verify(math_verify):
    pairs = [(answer, gold) for answer, gold, _ in PEER_REVIEW]
    expected = [expected for _, _, expected in PEER_REVIEW]
    assert grade(pairs, timeout_seconds=10.0) == [1.0 if value else 0.0 for value in expected]
    assert [math_verify(gold, answer) for answer, gold in pairs] == expected
    assert grade([("1,234, 5", "1,234"), ("3", r"200\%")]) == [0.0, 0.0]
    assert grade(LETTER_TOKENS) == [1.0] * 3
    assert [math_verify(gold, answer) for answer, gold in LETTER_TOKENS] == [False] * 3


def test_numpy_golds_are_read_not_skipped():
    """`Dataset.with_format("numpy")` gives np.int64 / np.float64 golds; they were None (every sample skipped)."""
    import numpy as np

    golds = [np.int64(5), np.float64(5.0), np.int32(-3)]
    completions = [r"\boxed{5}", r"\boxed{5}", r"\boxed{-3}"]
    assert get_reward("math_equivalence")(completions=completions, answer=golds) == [1.0, 1.0, 1.0]
    assert get_reward("boxed_answer")(completions=completions, answer=golds) == [1.0, 1.0, 1.0]


def test_numeric_gold_against_answers_without_digits_goes_to_the_symbolic_check():
    pairs = [(r"\frac{a}{a}", "1"), (r"e^{i\pi}", "-1"), ("i^2", "-1"), (r"\text{one}", "1"), ("x", "1")]
    assert grade(pairs, timeout_seconds=10.0) == [1.0, 1.0, 1.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------------- item 6


def test_extract_boxed_is_linear_in_nesting_depth():
    """200k-deep nesting took 1.4-2 s (every `}` searched the rest of the text for `{`). The ratio of 4x the depth
    to 1x is ~4 when linear and ~16 when quadratic. This process's CPU time, best of five: wall time also counts the
    waits for a core that other test processes hold (a 2-worker run on 2 cores measured a ratio of 14 in wall time)."""

    def seconds(depth: int) -> float:
        text = r"\boxed{" + "{" * depth + "1" + "}" * depth + "}"
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            assert rewards.extract_boxed(text) == "{" * depth + "1" + "}" * depth
            best = min(best, time.process_time() - start)
        return best

    assert seconds(200_000) / seconds(50_000) < 9
    assert seconds(200_000) < 1.0


# ----------------------------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5 dollars", ("5", "dollar")),
        (r"15\mbox{ cm}^2", ("15", "cm^2")),
        (r"15\text{ cm^2}", ("15", "cm^2")),
        ("3 square feet", ("3", "ft^2")),
        (r"7 \text{ m}", ("7", "m")),
        ("7 m", ("7 m", None)),
        ("3x", ("3x", None)),
        ("3i", ("3i", None)),
        (r"5\text{ or six}", (r"5\text{ or six}", None)),
        (r"\text{cm}", (r"\text{cm}", None)),
    ],
)
def test_split_unit_strips_only_known_units(text, expected):
    assert split_unit(text) == expected


def test_read_quantity_and_tie_rounding():
    assert read_quantity("-1,234.50").value == Fraction("-1234.5") and read_quantity("-1,234.50").decimal
    assert read_quantity(r"\frac{-3}{-4}").value == Fraction(3, 4)
    assert read_quantity("y = 2").variable == "y" and read_quantity("2y") is None
    assert read_quantity(r"1,23") is None and read_quantity("0,5") is None
    # an exact tie at the 7th decimal is left to sympy (its result depends on the binary float it reads)
    assert quantities_match(read_quantity("0.0000005"), read_quantity("0.0")) is None
    assert rewards.as_rational(r"12\%") == Fraction(3, 25)


def test_read_polynomial():
    assert read_polynomial("(a+5)(b+2)") == read_polynomial("ab + 2a + 5b + 10")
    assert read_polynomial(r"F_{1}F_{20} + F_{2}F_{19}") == read_polynomial("F_{19}F_2 + F_{20}F_1")
    assert read_polynomial("3R^2") == read_polynomial("3r^2")  # math-verify reads symbols in lower case
    assert read_polynomial("6 - 5i") == read_polynomial("6 + 5i^3")  # i alone is the imaginary unit
    assert read_polynomial(r"\sqrt{12}") == read_polynomial(r"2\sqrt{3}")  # square roots reduce exactly
    assert read_polynomial(r"\sqrt{6}\sqrt{10}") == read_polynomial(r"2\sqrt{15}")
    assert read_polynomial(r"(1+\sqrt{2})^2") == read_polynomial(r"3+2\sqrt{2}")
    assert read_polynomial(r"3\sqrt{13}") != read_polynomial(r"3\sqrt{14}")
    unread = [r"\sqrt{x}", r"\frac{1}{\sqrt{2}}", "2.5x", "f(x)", "x^12", r"4\frac{2}{3}", "(x+1)^{9999}", "x2"]
    for declined in unread + ["2 3", "x + i", "e^2", "[1,2)"]:
        assert read_polynomial(declined) is None, declined


def test_screen_pieces():
    assert [is_math_gold(g) for g in ["forty two", "N/A", "n/a", "2xy", r"\cot x", "p - q", "six"]] == [
        False, False, False, True, True, True, False,
    ]  # fmt: skip
    assert text_gold_key(r"\text{(A)}, \text{(C)}") == "a , c" and text_gold_key(r"\text{12}") is None
    assert unsafe("ab(a+b)") and not unsafe("a(b+c)") and not unsafe(r"\operatorname{lcm}(4,6)")
    assert not unsafe(without_calls("ab(a+b)")) and not unsafe(without_calls("eval(1)"))
    assert grade([("ab(a+b)", "a^2b+ab^2"), ("a^2b + ab^2", "ab(a+b)"), ("ab(a-b)", "ab(a+b)")]) == [1.0, 1.0, 0.0]
    assert not misread(r"1 \text{ or } 2", "1, 2") and misread(r"x \text{ maybe}", "x")


def test_tuples_intervals_and_sets_compare_element_by_element():
    pairs = [
        ("(6, 31, -1)", "(6,31,-1)", 1.0),
        ("(6,31,-2)", "(6,31,-1)", 0.0),
        ("(2, 1)", "(1,2)", 0.0),  # a tuple is ordered
        (r"\{2, 1\}", r"\{1,2\}", 1.0),  # a set is not
        ("-2, 1", "1,-2", 1.0),  # neither is a bare list (math-verify reads it as a set)
        ("(3, 5]", "(3,4]", 0.0),
        ("(2, +\\infty)", "(2,\\infty)", 1.0),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \frac{\pi}{2})", 1.0),
        ("[1, 2)", "(1,2)", 0.0),  # other brackets: math-verify decides (an interval is not a tuple)
    ]
    assert grade([(answer, gold) for answer, gold, _ in pairs]) == [expected for _, _, expected in pairs]


def test_long_answers_are_read_in_linear_time():
    """A long run of spaces before a unit-like ending made the unit search rescan the run from every position
    (20 s for 20k spaces); every fast-path regex is linear: 4x the length costs ~4x, not ~16x (CPU time of this
    process, best of five, as in the test above)."""

    def seconds(length: int) -> float:
        bodies = ["x" + " " * length + "!", "1" + " " * length + "%", " x" * (length // 2), "a" * length + "("]
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for body in bodies:
                rewards.math_equivalence._fast_check(rf"\boxed{{{body}}}", "5")
            best = min(best, time.process_time() - start)
        return best

    assert seconds(200_000) / seconds(50_000) < 9
    assert seconds(200_000) < 2.0


def test_no_credit_from_made_up_golds_or_several_unknowns_and_long_boxes_end_at_once():
    """Found on 2026-11-29 against the data and math-verify: `boxed_answer`'s `0-9 . -` filter made numbers of golds
    that are not one (`\\sqrt{2}` -> 2, `\\frac{1}{2}` -> 12, `2\\sqrt{3}` -> 23) and of a float gold's `1e+16`
    (116); `math_equivalence` credited `x=5, y=5` for 5; boxes of thousands of characters took seconds to minutes
    in the training process before the length screen."""
    boxed, math = get_reward("boxed_answer"), get_reward("math_equivalence")
    golds = [r"\sqrt{2}", r"\frac{1}{2}", r"2\sqrt{3}", "#### 1,234", 1e16, 1e-05]
    answers = [r"\boxed{2}", r"\boxed{12}", r"\boxed{23}", r"\boxed{1234}", r"\boxed{10000000000000000}",
               r"\boxed{0.00001}"]
    assert boxed(completions=answers, answer=golds) == [None, None, None, 1.0, 1.0, 1.0]
    assert boxed(completions=[r"\boxed{116}"], answer=[1e16]) == [-1.0]
    assert math(completions=[r"\boxed{0.00001}"], answer=[1e-05]) == [1.0]
    unknowns = [r"\boxed{x=5, y=5}", r"\boxed{x_1=2, x_2=2}", r"\boxed{x=5}", r"\boxed{5, 5}"]
    assert math(completions=unknowns, answer=["5", "2", "5", "5"]) == [0.0, 0.0, 1.0, 1.0]
    started = time.monotonic()
    long_boxes = ["\\boxed{" + "a/" * 10_000 + "a+1}", "\\boxed{" + "(x+1)" * 3_900 + "}"]
    assert math(completions=long_boxes, answer=["5", "5"]) == [0.0, 0.0]
    assert time.monotonic() - started < 5  # a hang guard, not a benchmark: 8 s and 58 s before the screen moved
