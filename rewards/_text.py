"""Pure text helpers shared by the rewards (and by other modules: evaluation, dynamic sampling).

Everything here is linear-time on any input (no backtracking regexes over model output) and never raises on a
completion, so a reward built on these helpers cannot hang or crash a training step.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any

_BOX_TAGS = ("\\boxed", "\\fbox")
_NOT_NUMERIC = re.compile(r"[^0-9.\-]")


def completion_text(completion: Any) -> str:
    """The text of one completion: a plain string, or the assistant message(s) of a conversational completion.

    TRL passes `completions[i]` as a string for standard datasets and as a list of messages
    (`[{"role": "assistant", "content": ...}]`) for conversational ones. Multi-message completions (tool use)
    join their assistant contents, so the final answer is the last thing in the text. Content given as a list of
    parts (`[{"type": "text", "text": ...}]`) is joined. Anything else becomes `""`, never an exception.

    Example:
    ```python
    >>> completion_text([{"role": "assistant", "content": "\\\\boxed{4}"}])
    '\\\\boxed{4}'
    >>> completion_text(None)
    ''
    ```
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, (list, tuple)):
        return ""
    texts = []
    for message in completion:
        if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        if isinstance(content, str):
            texts.append(content)
    return "\n".join(texts)


def extract_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` / `\fbox{...}` in `text` (braces balanced), or None.

    Also accepts the brace-less form `\boxed 5` (up to the next `$` or end of line). The last box wins, as in the
    MATH/lm-eval graders; a last box whose braces never close (a truncated completion) gives None.

    Example:
    ```python
    >>> extract_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}.")
    '\\frac{1}{2}'
    >>> extract_boxed(r"\boxed{unclosed") is None
    True
    ```
    """
    if not isinstance(text, str):
        return None
    start, tag = max((text.rfind(tag), tag) for tag in _BOX_TAGS)
    if start < 0:
        return None
    position = start + len(tag)
    while position < len(text) and text[position] in " \t":
        position += 1
    if position >= len(text):
        return None
    if text[position] != "{":
        if position == start + len(tag):  # `\boxedx`: not a box command
            return None
        end = min((i for i in (text.find("$", position), text.find("\n", position)) if i >= 0), default=len(text))
        return text[position:end].strip()
    depth, cursor = 0, position
    while True:  # jump between braces with str.find: C speed even on 100 kB of nesting
        next_open = text.find("{", cursor)
        next_close = text.find("}", cursor)
        if next_close < 0:
            return None
        if 0 <= next_open < next_close:
            depth += 1
            cursor = next_open + 1
        else:
            depth -= 1
            cursor = next_close + 1
            if depth == 0:
                return text[position + 1 : next_close]


@lru_cache(maxsize=65536)
def gold_text(gold: Any) -> str | None:
    r"""The final answer inside a gold column value, as text: GSM8K `... #### 1,234` -> `1234`; a MATH solution with a
    box -> the box content; anything else -> the value stripped of surrounding `$`. None for an empty/unusable gold.
    """
    if isinstance(gold, bool) or gold is None:
        return None
    if isinstance(gold, (int, float)):
        return repr(gold) if math.isfinite(gold) else None
    if not isinstance(gold, str):
        return None
    if "####" in gold:
        text = gold.rsplit("####", 1)[1].strip().replace(",", "")
    elif "\\boxed" in gold or "\\fbox" in gold:
        text = extract_boxed(gold) or ""
    else:
        text = gold.strip().strip("$").strip()
    return text or None


def to_float(text: str | None) -> float | None:
    r"""The seed rule's number: keep only `0-9 . -` and convert; None when that is not one finite float.

    Example:
    ```python
    >>> to_float(r"\$1,234.00"), to_float("x = -3"), to_float("1.2.3")
    (1234.0, -3.0, None)
    ```
    """
    if not text:
        return None
    kept = _NOT_NUMERIC.sub("", text)
    if not kept or len(kept) > 400:  # 400 digits already overflows a double
        return None
    try:
        value = float(kept)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@lru_cache(maxsize=65536)
def gold_number(gold: Any) -> float | None:
    """The gold of a numeric task as a float (GSM8K `#### 1,234` or a bare value), None if there is none."""
    return to_float(gold_text(gold))


# ---------------------------------------------------------------------------------------------------------------
# Light LaTeX normalisation for answer comparison: the pieces math-verify lacks, plus a rational fast path.

_NORMALIZE_RULES = [
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),  # \frac12
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),  # \frac1{2}
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)"), r"\\frac\1{\2}"),  # \frac{1}2
    (re.compile(r"\\sqrt\s*(\d)"), r"\\sqrt{\1}"),  # \sqrt2
    (re.compile(r"(\d)(?:\\[,;: ]|~|\\thinspace|\{,\})(?=\d{3}(?!\d))"), r"\1"),  # 1\,000 / 1{,}000 -> 1000
    (re.compile(r"\\(?:left|right|displaystyle|!)|\\[,;:]"), ""),
    (re.compile(r"\^\s*\{?\\circ\}?|°|\\%|%|\\\$|\$"), ""),
]
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_FRACTION = re.compile(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}|([-+]?\d+)\s*/\s*([-+]?\d+)")
_UNIT_SUFFIX = re.compile(r"\s*(?:\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}|[A-Za-z]+(?:\s+[A-Za-z]+)*)$")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\s*=\s*")
_TEXT_NUMBER = re.compile(r"^\\(?:text|mbox|mathrm)\{([^{}]*)\}$")


def normalize_answer(answer: str) -> str:
    r"""Canonical LaTeX for comparison: `\dfrac`->`\frac`, `\frac12`->`\frac{1}{2}`, `\sqrt2`->`\sqrt{2}`,
    `1\,000`->`1000`, and no `\left`/`\right`, spacing commands, degrees, `\%` or dollar signs.

    Example:
    ```python
    >>> normalize_answer(r"\$1\,000"), normalize_answer(r"\dfrac12"), normalize_answer(r"30^{\circ}")
    ('1000', '\\frac{1}{2}', '30')
    ```
    """
    text = answer.strip()
    for pattern, replacement in _NORMALIZE_RULES:
        text = pattern.sub(replacement, text)
    return text.strip().rstrip(".").strip()


def as_rational(answer: str) -> Fraction | None:
    r"""A normalised answer as an exact rational when it is a plain number: `-1,234.50`, `\frac{3}{4}`, `3/4`,
    `x = 5`, `72 \text{ apples}`, `\text{12}`. None for anything else (left to the symbolic checker).
    """
    if len(answer) > 80:
        return None
    text = _ASSIGNMENT.sub("", answer, count=1)
    text_number = _TEXT_NUMBER.match(text)
    if text_number:
        text = text_number.group(1).strip()
    stripped = _UNIT_SUFFIX.sub("", text).strip() if text[:1].isdigit() or text[:1] in "-+." else text
    if _NUMBER.fullmatch(stripped):
        return Fraction(stripped.replace(",", "").rstrip(".") or "0")
    fraction = _FRACTION.fullmatch(stripped)
    if fraction:
        sign, numerator, denominator, plain_numerator, plain_denominator = fraction.groups()
        numerator = int(numerator if numerator is not None else plain_numerator)
        denominator = int(denominator if denominator is not None else plain_denominator)
        if denominator == 0:
            return None
        return Fraction(-numerator if sign == "-" else numerator, denominator)
    return None
