r"""Correctness rewards: the seed's numeric `\boxed{}` rule and LaTeX/symbolic equivalence via math-verify."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ._base import CorrectnessReward
from ._numbers import Quantity, quantities_match, read_quantity, split_unit
from ._polynomial import read_polynomial
from ._screen import (
    MAX_SYMBOLIC_CHARS,
    is_math_gold,
    misread,
    pathological,
    text_gold_key,
    text_key,
    unsafe,
    without_calls,
)
from ._text import (
    compact,
    extract_boxed,
    gold_number,
    gold_text,
    normalize_answer,
    read_bracketed,
    to_float,
    top_level_parts,
)
from ._verify import TIMEOUT, shared_pool


def _cached(function, value: Any):
    try:
        return function(value)
    except TypeError:  # unhashable gold (a list, a dict): not a usable answer
        return None


class BoxedAnswer(CorrectnessReward):
    r"""The seed rule: the last `\boxed{}`/`\fbox{}` of the completion, reduced to the characters `0-9 . -`, equals the
    gold number (GSM8K `... #### 1,234` or a bare value) as a float.

    `correct` (+1.0) when equal, `incorrect` (-1.0) otherwise, including no box, an empty box and `1.2.3`.
    `correct=5.0, incorrect=-5.0` is the RLinf variant. A gold with no number scores None (TRL skips it).
    Fractions are not understood (`\frac{1}{2}` reads as 12): use `math_equivalence` for MATH-style answers.

    Args:
        correct: reward of a correct completion.
        incorrect: reward of any other completion.
        answer_key: dataset column holding the gold answer.
        name: metric name override (default: `boxed_answer` plus non-default parameters).

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("boxed_answer")
    >>> completions = [r"... so \boxed{1,234}", [{"role": "assistant", "content": r"\boxed{\$18.00}"}], "1234"]
    >>> reward(completions=completions, answer=["#### 1,234", "18", "1234"])
    [1.0, 1.0, -1.0]
    ```
    """

    registry_name = "boxed_answer"

    def __init__(
        self, correct: float = 1.0, incorrect: float = -1.0, answer_key: str = "answer", name: str | None = None
    ) -> None:
        self.correct, self.incorrect, self.answer_key = float(correct), float(incorrect), answer_key
        self._set_name(name)

    def _check(self, text: str, gold: Any) -> bool | None:
        gold_value = _cached(gold_number, gold)
        if gold_value is None:
            return None
        return to_float(extract_boxed(text)) == gold_value


# Numbers in a base (`52_8`): math-verify drops the subscript, so they are compared literally.
_BASE_NUMBER = re.compile(r"(\d[0-9A-Z]*)_\{?(\d+)\}?")
# one number with comma thousands separators (MATH's `58,500`): not the list 58, 500
_GROUPED_NUMBER = re.compile(r"[-+]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")


def _is_grouped_number(core: str) -> bool:
    """Whether `core` (an answer without its unit) is one number written with comma thousands separators."""
    return _GROUPED_NUMBER.fullmatch(core.replace(" ", "")) is not None


@dataclass(frozen=True)
class _Gold:
    """A gold answer read once: its normalised LaTeX (unit removed), compact form, and the fast-path readings."""

    latex: str
    compact: str
    quantity: Quantity | None = None
    polynomial: dict | None = None
    text_key: str | None = None
    unit: str | None = None
    scalar: bool = False  # one number or polynomial, not a list
    listing: tuple | None = None  # (brackets, parts) of a tuple, interval, set or bare list


@lru_cache(maxsize=65536)
def _read_gold(answer: str) -> _Gold | None:
    """None when the gold is not math (prose, a placeholder, unsafe text): no completion can be checked against it."""
    normalized = without_calls(normalize_answer(answer))
    key = text_gold_key(normalized)
    if key is not None:
        return _Gold(latex=normalized, compact=compact(normalized), text_key=key)
    if not is_math_gold(normalized) or unsafe(normalized):
        return None
    core, unit = split_unit(normalized)
    quantity = read_quantity(normalized)
    polynomial = read_polynomial(core)
    grouped = quantity is not None and _is_grouped_number(core)
    return _Gold(
        latex=core,
        compact=compact(normalized),
        quantity=quantity,
        polynomial=polynomial,
        unit=quantity.unit if quantity is not None else unit,
        scalar=(quantity is not None or polynomial is not None) and (grouped or len(top_level_parts(core)) == 1),
        listing=None if grouped else _read_listing(core),
    )


def _read_listing(text: str) -> tuple[str, list[str]] | None:
    """(brackets, parts): `()`/`[)`/`{}`... for a bracketed tuple, interval or set, "" for a bare list `1, -2`."""
    bracketed = read_bracketed(text)
    if bracketed is not None:
        return bracketed
    parts = top_level_parts(text)
    return ("", parts) if len(parts) > 1 else None


_INFINITY = re.compile(r"\s*([-+]?)\s*\\infty\s*")


def _element_verdict(gold: str, answer: str) -> bool | None:
    """Whether two elements of a list are equal, when both are numbers, polynomials or infinities; else None."""
    gold_infinity, answer_infinity = _INFINITY.fullmatch(gold), _INFINITY.fullmatch(answer)
    if gold_infinity or answer_infinity:
        if gold_infinity and answer_infinity:
            return gold_infinity.group(1) == answer_infinity.group(1) or {"", "+"} == {
                gold_infinity.group(1), answer_infinity.group(1)
            }
        return False if read_quantity(gold if answer_infinity else answer) is not None else None
    gold_quantity, answer_quantity = read_quantity(gold), read_quantity(answer)
    if gold_quantity is not None and answer_quantity is not None:
        return quantities_match(gold_quantity, answer_quantity)
    gold_polynomial, answer_polynomial = read_polynomial(gold), read_polynomial(answer)
    if gold_polynomial is None or answer_polynomial is None:
        return None
    return gold_polynomial == answer_polynomial


def _list_verdict(answer: str, gold: _Gold) -> bool | None:
    """A tuple/interval/set/list answer against a gold of the same brackets and length, element by element (sets and
    bare lists in any order, as math-verify compares them); None when some element needs the symbolic check."""
    listing = _read_listing(answer)
    if listing is None or gold.listing is None or listing[0] != gold.listing[0]:
        return None
    gold_parts, answer_parts = gold.listing[1], listing[1]
    if len(gold_parts) != len(answer_parts):
        return None
    if listing[0] in ("", "{}"):
        matrix = [[_element_verdict(g, a) for a in answer_parts] for g in gold_parts]
        if any(verdict is None for row in matrix for verdict in row):
            return None
        return all(any(row) for row in matrix) and all(any(column) for column in zip(*matrix))
    verdicts = [_element_verdict(g, a) for g, a in zip(gold_parts, answer_parts)]
    if False in verdicts:
        return False
    return None if None in verdicts else True


_ASSIGNED = re.compile(r"\s*([A-Za-z](?:_\{?\w+\}?)?)\s*=")  # `x =`, `x_1 =`: the part names its unknown


def _scalar_verdict(answer: str, gold: _Gold) -> bool | None:
    """Whether one plain number or polynomial equals a scalar gold; None when neither fast reading applies."""
    quantity = read_quantity(answer)
    if quantity is not None and gold.quantity is not None:
        return quantities_match(gold.quantity, quantity)
    polynomial = read_polynomial(split_unit(answer)[0]) if gold.polynomial is not None else None
    return None if polynomial is None else polynomial == gold.polynomial


class MathEquivalence(CorrectnessReward):
    r"""The last boxed answer is mathematically equivalent to the gold (MATH-style: fractions, radicals, intervals,
    tuples, sets, `\text{}` answers, degrees, percent, known units, GSM8K numbers). It never credits an answer for
    something it cannot read: a unit or word is dropped only when it is a known unit (`\text{ cm}`, `^\circ`,
    `dollars`), never a variable, `i` or a second clause (`3x`, `3i`, `5 or six` are not 3 or 5).

    Each answer goes through these steps, cheapest first:
    1. normalisation math-verify lacks (`\frac12`, `\dfrac`, `\sqrt2`, `1\,000`, `11,\! 111`, `\$`, `^\circ`) and
       exact comparison; a gold written as text (`\text{Monday}`, `\text{(C)}`) compares as normalised text;
    2. plain numbers, exactly, by math-verify's rules (6-decimal rounding when either side has a decimal point,
       `9\%` = 9 for integers, `10\%` = 0.1), with known units that must agree (`5 cm` is not `5 m`);
    3. polynomials with rational coefficients and square roots of integers (`(a+5)(b+2)`, `\sqrt{12}` =
       `2\sqrt{3}`, 129-term sums), by exact expansion; tuples, intervals and sets of those, element by element;
    4. math-verify (`verify(gold, answer)`, LaTeX extraction only) in a killable worker process, after a screen that
       rejects unsafe text (dunders, attribute access; calls outside a math whitelist become the products LaTeX
       means, `ab(a+b)`), forms math-verify misreads
       (`5 \quad 6` = 11, `7 = 5` = 5) and, with `prescreen`, towers of powers and huge factorials.

    Verdicts: a gold that is not math (`forty two`, `proof omitted`, `N/A`) gives None (TRL skips the sample, as
    `trl.rewards.accuracy_reward` does). A symbolic check gets at most `timeout_seconds` per completion on any thread,
    worker start-up included; one that runs out gives None (skipped, never silently "incorrect") unless
    `timeout_is_incorrect=True`, and every call logs `rewards/<name>/timeouts` through TRL's `log_metric`.

    Args:
        correct: reward of an equivalent answer.
        incorrect: reward of any other completion (also: no box).
        answer_key: dataset column holding the gold answer.
        timeout_seconds: time limit for the symbolic check of one completion.
        timeout_is_incorrect: score a timed-out comparison as `incorrect` instead of None.
        prescreen: reject pathological answers without running sympy.
        name: metric name override.

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("math_equivalence")
    >>> completions = [r"\boxed{\frac12}", r"\boxed{0.5}", r"\boxed{1\,000}", r"\boxed{3x}", r"\boxed{2}", "no box"]
    >>> reward(completions=completions, answer=[r"\frac{1}{2}", r"\frac{1}{2}", "#### 1,000", "3", "forty two", "3"])
    [1.0, 1.0, 1.0, 0.0, None, 0.0]
    ```
    """

    registry_name = "math_equivalence"
    can_time_out = True

    def __init__(
        self,
        correct: float = 1.0,
        incorrect: float = 0.0,
        answer_key: str = "answer",
        timeout_seconds: float = 1.0,
        timeout_is_incorrect: bool = False,
        prescreen: bool = True,
        name: str | None = None,
    ) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0 (seconds per completion), got {timeout_seconds!r}")
        self.correct, self.incorrect, self.answer_key = float(correct), float(incorrect), answer_key
        self.timeout_seconds, self.timeout_is_incorrect = float(timeout_seconds), bool(timeout_is_incorrect)
        self.prescreen = bool(prescreen)
        self._set_name(name)

    def _fast_check(self, text: str, gold: Any):
        """True/False/None when decided without sympy, else the `(gold, answer)` LaTeX pair for math-verify."""
        gold_answer = _cached(gold_text, gold)
        if gold_answer is None:
            return None
        gold_read = _read_gold(gold_answer)
        if gold_read is None:
            return None
        answer = extract_boxed(text)
        if answer is None:
            return False
        normalized = without_calls(normalize_answer(answer))
        if compact(normalized) == gold_read.compact:
            return True
        if gold_read.text_key is not None:
            return text_key(normalized) == gold_read.text_key
        if self.prescreen and len(normalized) > MAX_SYMBOLIC_CHARS:  # before the readers, some quadratic in length
            return False
        quantity = read_quantity(normalized)
        if quantity is not None and gold_read.quantity is not None:
            verdict = quantities_match(gold_read.quantity, quantity)
            if verdict is not None:
                return verdict
        if not any(character.isalnum() for character in normalized):
            return False
        if unsafe(normalized) or misread(normalized, gold_read.latex):
            return False
        if gold_read.scalar:  # a list against one value: math-verify reads {5, 7} != 5 and {5, 5} = 5
            parts = top_level_parts(normalized)
            if len({match[1] for part in parts if (match := _ASSIGNED.match(part))}) > 1:
                return False  # `x=5, y=5`: a solution of several unknowns, not one value
            if len(parts) > 1 and not _is_grouped_number(split_unit(normalized)[0]):
                verdicts = [_scalar_verdict(part, gold_read) for part in parts]
                if None not in verdicts:
                    return all(verdicts)
        if gold_read.listing is not None:
            verdict = _list_verdict(normalized, gold_read)
            if verdict is not None:
                return verdict
        core, unit = split_unit(normalized)
        if unit is not None and gold_read.unit is not None and unit != gold_read.unit:
            return False
        gold_base = _BASE_NUMBER.fullmatch(gold_read.compact)
        if gold_base:
            answer_base = _BASE_NUMBER.fullmatch(compact(core))
            return bool(answer_base) and answer_base.groups() == gold_base.groups()
        if gold_read.polynomial is not None:
            polynomial = read_polynomial(core)
            if polynomial is not None:
                return polynomial == gold_read.polynomial
        if self.prescreen and pathological(core):
            return False
        return gold_read.latex, core

    def _check(self, text: str, gold: Any) -> bool | None:
        return self._check_batch([text], [gold])[0][0]

    def _check_batch(self, texts: list[str], golds: list[Any]) -> tuple[list[bool | None], int]:
        verdicts: list = []
        for text, gold in zip(texts, golds):
            try:
                verdicts.append(self._fast_check(text, gold))
            except Exception:
                verdicts.append(False)
        timeouts = 0
        pending = [index for index, verdict in enumerate(verdicts) if isinstance(verdict, tuple)]
        if pending:
            pool = shared_pool()
            for index in pending:
                result = pool.check(*verdicts[index], self.timeout_seconds)
                if result is TIMEOUT:
                    timeouts += 1
                    result = False if self.timeout_is_incorrect else None
                verdicts[index] = result
        return verdicts, timeouts
