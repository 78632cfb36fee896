r"""Correctness rewards: the seed's numeric `\boxed{}` rule and LaTeX/symbolic equivalence via math-verify."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from ._base import CorrectnessReward
from ._text import as_rational, extract_boxed, gold_number, gold_text, normalize_answer, to_float
from ._verify import shared_worker


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


# Inputs sympy would evaluate for minutes: towers of powers, huge exponents or factorials.
_PATHOLOGICAL = re.compile(
    r"\^\s*\{[^{}]*\^"  # a power inside an exponent: 9^{9^{9}}
    r"|\^\s*[\w.]+\s*\^"  # a chained power: 9^9^9
    r"|\^\s*\{?\s*[-+]?\d{5,}"  # an exponent of 5+ digits
    r"|\d{4,}\s*!|!\s*!"  # big or iterated factorials
)
_MAX_SYMBOLIC_ANSWER_CHARS = 1000
# Answers math-verify reads too loosely: numbers in a base (`52_8`: it drops the subscript) and squared/cubed units
# (`15\mbox{ cm}^2`: units=True drops the unit with its power). These are compared literally.
_BASE_NUMBER = re.compile(r"([0-9A-Za-z]+)_\{?(\d+)\}?")
_UNIT_POWER = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}\s*\^\s*\{?(\d+)\}?")


@lru_cache(maxsize=65536)
def _normalized_gold(answer: str) -> tuple[str, str, Any]:
    normalized = normalize_answer(answer)
    return normalized, "".join(normalized.split()), as_rational(normalized)


class MathEquivalence(CorrectnessReward):
    r"""The last boxed answer is mathematically equivalent to the gold (MATH-style: fractions, radicals, intervals,
    tuples, sets, `\text{}`, degrees, units, GSM8K numbers).

    Each answer goes through three steps, cheapest first: normalisation math-verify lacks (`\frac12`, `\dfrac`,
    `\sqrt2`, `1\,000`, `\$`, `\%`, `^\circ`) and exact string equality; an exact rational fast path for plain
    numbers and fractions that never touches sympy; and only then math-verify (`verify(gold, answer)`) in a
    killable child process, so every item is bounded by `timeout_seconds` on any thread (TRL runs async rewards off
    the main thread, where math-verify's signal timeouts cannot fire). With `prescreen`, towers of powers and huge
    factorials are rejected before sympy sees them. A gold math-verify cannot parse scores None, as in
    `trl.rewards.accuracy_reward`.

    Args:
        correct: reward of an equivalent answer.
        incorrect: reward of any other completion (also: no box, timeout).
        answer_key: dataset column holding the gold answer.
        timeout_seconds: time limit for the symbolic check of one completion.
        prescreen: reject pathological answers without running sympy.
        name: metric name override.

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("math_equivalence")
    >>> completions = [r"\boxed{\frac12}", r"\boxed{0.5}", r"\boxed{1\,000}", r"\boxed{2}", "no box"]
    >>> reward(completions=completions, answer=[r"\frac{1}{2}", r"\frac{1}{2}", "#### 1,000", "3", "3"])
    [1.0, 1.0, 1.0, 0.0, 0.0]
    ```
    """

    registry_name = "math_equivalence"

    def __init__(
        self,
        correct: float = 1.0,
        incorrect: float = 0.0,
        answer_key: str = "answer",
        timeout_seconds: float = 1.0,
        prescreen: bool = True,
        name: str | None = None,
    ) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0 (seconds per completion), got {timeout_seconds!r}")
        self.correct, self.incorrect, self.answer_key = float(correct), float(incorrect), answer_key
        self.timeout_seconds, self.prescreen = float(timeout_seconds), bool(prescreen)
        self._set_name(name)

    def _fast_check(self, text: str, gold: Any):
        """True/False/None when decided without sympy, else the normalised `(gold, answer)` pair for math-verify."""
        gold_answer = _cached(gold_text, gold)
        if gold_answer is None:
            return None
        answer = extract_boxed(text)
        if answer is None:
            return False
        gold_normalized, gold_compact, gold_rational = _normalized_gold(gold_answer)
        normalized = normalize_answer(answer)
        compact = "".join(normalized.split())
        if compact == gold_compact:
            return True
        if gold_rational is not None:
            rational = as_rational(normalized)
            if rational is not None:
                return rational == gold_rational
            if not any(character.isdigit() for character in normalized):
                return False
        if not any(character.isalnum() for character in normalized):
            return False
        gold_base = _BASE_NUMBER.fullmatch(gold_compact)
        if gold_base:
            answer_base = _BASE_NUMBER.fullmatch(compact)
            return bool(answer_base) and answer_base.groups() == gold_base.groups()
        if _UNIT_POWER.findall(gold_normalized) != _UNIT_POWER.findall(normalized) and _UNIT_POWER.search(normalized):
            return False
        if self.prescreen and (len(normalized) > _MAX_SYMBOLIC_ANSWER_CHARS or _PATHOLOGICAL.search(normalized)):
            return False
        return gold_normalized, normalized

    def _check(self, text: str, gold: Any) -> bool | None:
        return self._check_batch([text], [gold])[0]

    def _check_batch(self, texts: list[str], golds: list[Any]) -> list[bool | None]:
        verdicts: list = []
        for text, gold in zip(texts, golds):
            try:
                verdicts.append(self._fast_check(text, gold))
            except Exception:
                verdicts.append(False)
        pending = [index for index, verdict in enumerate(verdicts) if isinstance(verdict, tuple)]
        if pending:
            results = shared_worker().check([verdicts[index] for index in pending], self.timeout_seconds)
            for index, result in zip(pending, results):
                verdicts[index] = result
        return verdicts
