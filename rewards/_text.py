"""Pure text helpers shared by the rewards (and by other modules: evaluation, dynamic sampling).

Everything here is linear-time on any input (no backtracking regexes over model output) and never raises on a
completion, so a reward built on these helpers cannot hang or crash a training step.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from functools import lru_cache
from typing import Any

_BOX_TAGS = ("\\boxed", "\\fbox")
_NOT_NUMERIC = re.compile(r"[^0-9.\-]")
# minus signs other than "-" (U+2212 minus, figure and en dashes, small and full-width hyphen-minus): dropped by the
# seed rule's filter, `\boxed{−5}` would read as 5
_MINUS_SIGNS = str.maketrans({character: "-" for character in "\u2212\u2012\u2013\ufe63\uff0d"})


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
    return _box_at(text, start, tag)[0]


_LIST_GAP = re.compile(r"(?:\s|,|\.|;|\$|\\[()\[\]]|\\q?quad|\\text\s*\{\s*(?:and|or)?\s*\}|\band\b|\bor\b)*")


def _listed_boxes(text: str) -> list[str]:
    """The boxes that end `text` as one list (`\\boxed{1} and \\boxed{-2}`); only the last box when other words
    separate them (`\\boxed{1} no no \\boxed{2}`), as math-verify reads several boxes."""
    spans = list(_box_spans(text))
    listed = spans[-1:]
    for previous, following in zip(reversed(spans[:-1]), reversed(spans[1:])):
        if not _LIST_GAP.fullmatch(text[previous[1] : following[0]]):
            break
        listed.insert(0, previous)
    return [content for _, _, content in listed]


def _box_spans(text: str):
    """(start, end, content) of every complete box, left to right; a box nested in another belongs to it."""
    position = 0
    while True:
        start, tag = min(
            ((found, tag) for tag in _BOX_TAGS if (found := text.find(tag, position)) >= 0), default=(-1, "")
        )
        if start < 0:
            return
        content, position = _box_at(text, start, tag)
        if content is not None:
            yield start, position, content


def _box_at(text: str, start: int, tag: str) -> tuple[str | None, int]:
    """(content of the box command at `start`, or None when it is not a complete box; where scanning resumes)."""
    position = start + len(tag)
    while position < len(text) and text[position] in " \t":
        position += 1
    if position >= len(text):
        return None, len(text)
    if text[position] != "{":
        if position == start + len(tag):  # `\boxedx`: not a box command
            return None, position
        end = min((i for i in (text.find("$", position), text.find("\n", position)) if i >= 0), default=len(text))
        return text[position:end].strip(), end
    # Brace matching with str.find at C speed. Each search resumes where the previous one of its kind stopped, so the
    # scan is linear in the length of the text even for 200k-deep nesting (re-searching for "{" after every "}" made
    # it quadratic).
    depth, next_open, next_close = 0, text.find("{", position), text.find("}", position)
    while True:
        if next_close < 0:
            return None, len(text)
        if 0 <= next_open < next_close:
            depth += 1
            next_open = text.find("{", next_open + 1)
        else:
            depth -= 1
            if depth == 0:
                return text[position + 1 : next_close], next_close + 1
            next_close = text.find("}", next_close + 1)


@lru_cache(maxsize=65536)
def gold_text(gold: Any) -> str | None:
    r"""The final answer inside a gold column value, as text: GSM8K `... #### 1,234` -> `1234`; a MATH solution with a
    box -> the box content (several boxes -> their contents joined by `, `: a list of answers); anything else -> the
    value stripped of surrounding `$`. None for an empty/unusable gold.
    """
    if isinstance(gold, bool) or gold is None:
        return None
    if isinstance(gold, numbers.Integral):  # numpy's too (`Dataset.with_format("numpy")`): np.int64 is no int
        gold = int(gold)
    elif isinstance(gold, numbers.Real):
        gold = float(gold)  # np.float64's repr is `np.float64(5.0)`
    if isinstance(gold, (int, float)):  # positional digits: repr's `1e+16` would read as 116 under the seed rule
        return format(Decimal(repr(gold)), "f") if math.isfinite(gold) else None
    if not isinstance(gold, str):
        return None
    if "####" in gold:
        text = gold.rsplit("####", 1)[1].strip().replace(",", "")
    elif "\\boxed" in gold or "\\fbox" in gold:
        text = ", ".join(_listed_boxes(gold))
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
    kept = _NOT_NUMERIC.sub("", text.translate(_MINUS_SIGNS))
    if not kept or len(kept) > 400:  # 400 digits already overflows a double
        return None
    try:
        value = float(kept)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# A gold that is one plain number (signs, `$`, `%` and separating commas allowed): the seed rule's `0-9 . -`
# filter is meant for those, and on `\sqrt{2}`, `\frac{1}{2}` or `2\sqrt{3}` it made up 2, 12 and 23.
_PLAIN_GOLD = re.compile(r"\s*(?:\\?\$)?\s*[-+]?\s*(?:\d[\d,]*(?:\.\d*)?|\.\d+)\s*(?:\\?%)?\s*")


@lru_cache(maxsize=65536)
def gold_number(gold: Any) -> float | None:
    """The gold of a numeric task as a float (GSM8K `#### 1,234` or a bare value), None if there is none: a gold
    that is not one plain number (MATH's `\\sqrt{2}`, `\\frac{1}{2}`) has no number for the seed rule to match."""
    text = gold_text(gold)
    return to_float(text) if text is not None and _PLAIN_GOLD.fullmatch(text) else None


# ---------------------------------------------------------------------------------------------------------------
# Light LaTeX normalisation for answer comparison: the spellings math-verify lacks. Nothing here changes a value:
# percent signs, units and words stay (`_numbers.read_quantity` decides what they mean).

_NORMALIZE_RULES = [
    (re.compile(r"\\[dtc]frac"), r"\\frac"),
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),  # \frac12 (LaTeX reads one token per argument)
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),  # \frac1{2}
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\d)"), r"\\frac\1{\2}"),  # \frac{1}2
    (re.compile(r"\\sqrt\s*(\d)"), r"\\sqrt{\1}"),  # \sqrt2
    (re.compile(r"\\sqrt\s+([a-zA-Z])"), r"\\sqrt{\1}"),  # \sqrt x (one token: \sqrt xy is \sqrt{x}y)
    (re.compile(r"\\frac\s+([a-zA-Z0-9])\s*([a-zA-Z0-9])"), r"\\frac{\1}{\2}"),  # \frac x2, \frac ab
    (re.compile(r"\\frac\s+([a-zA-Z])\s*\{"), r"\\frac{\1}{"),  # \frac x{2}
    # thousands separators: 1\,000, 1{,}000, 1~000, 11,\! 111 and 11, \!111 (MATH's spellings) -> 1000, 11111
    (re.compile(r"(\d)(?:\\[,;: ]|~|\\thinspace|\{,\}|,\s*\\!\s*)(?=\d{3}(?!\d))"), r"\1"),
    # any other spacing command between two digits stays a space: `5\;6` is not 56 (nor 11, as math-verify reads it)
    (re.compile(r"(?<=\d)\s*(?:\\[,;: !]|~|\\q?quad(?![A-Za-z]))+\s*(?=\d)"), " "),
    (re.compile(r"\\(?:left|right|displaystyle|!)|\\[,;:]"), ""),
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\\$|\$"), ""),  # degrees and dollar signs
]
_SPACE_NOT_BETWEEN_DIGITS = re.compile(r"(?<!\d)\s+|\s+(?!\d)")


def normalize_answer(answer: str) -> str:
    r"""Canonical LaTeX for comparison: `\dfrac`->`\frac`, `\frac12`->`\frac{1}{2}`, `\sqrt2`->`\sqrt{2}`,
    thousands separators removed (`1\,000`, `11,\! 111`), and no `\left`/`\right`, spacing commands, degree or dollar
    signs. Percent signs, units and words are kept.

    Example:
    ```python
    >>> normalize_answer(r"\$1\,000"), normalize_answer(r"\dfrac12"), normalize_answer(r"30^{\circ}")
    ('1000', '\\frac{1}{2}', '30')
    >>> normalize_answer(r"11,\! 111,\! 100"), normalize_answer(r"5\;6")
    ('11111100', '5 6')
    ```
    """
    text = answer.strip()
    for pattern, replacement in _NORMALIZE_RULES:
        text = pattern.sub(replacement, text)
    return text.strip().rstrip(".").strip()


def compact(text: str) -> str:
    """`text` without whitespace, except between two digits (`5 6` is two numbers, not 56)."""
    return _SPACE_NOT_BETWEEN_DIGITS.sub("", text)


_LIST_WORDS = re.compile(r"\\text\s*\{\s*,?\s*(?:and|or)\s*,?\s*\}|(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])")
_OPENING, _CLOSING = "([{", ")]}"


def top_level_parts(text: str) -> list[str]:
    r"""`text` split at commas, semicolons, `and`, `or` outside any bracket: `5 \text{ or } 7` -> [`5`, `7`];
    `(1, 2)` stays whole. Brackets that do not balance leave the text whole too."""
    text = _LIST_WORDS.sub(",", text)
    parts, depth, start = [], 0, 0
    for position, character in enumerate(text):
        if character in _OPENING:
            depth += 1
        elif character in _CLOSING:
            depth -= 1
            if depth < 0:
                return [text]
        elif character in ",;" and depth == 0:
            parts.append(text[start:position].strip())
            start = position + 1
    if depth != 0:
        return [text]
    parts.append(text[start:].strip())
    return [part for part in parts if part]


_BRACKETS = {"(": ")]", "[": ")]", "\\{": "\\}"}  # opening -> the closings it may have: (1,2] is an interval


def read_bracketed(text: str) -> tuple[str, list[str]] | None:
    r"""A tuple, interval or set written as one bracket pair around comma-separated parts: `(6, 31, -1)` ->
    (`()`, [`6`, `31`, `-1`]); `(3, 4]` -> (`(]`, ...); `\{1, 2\}` -> (`{}`, ...). None for anything else
    (`(1,2) \cup (3,4)`, `x \in [1, 2]`, a single part)."""
    text = text.strip()
    opening = "\\{" if text.startswith("\\{") else text[:1]
    if opening not in _BRACKETS:
        return None
    closing = "\\}" if text.endswith("\\}") else text[-1:]
    if closing not in _BRACKETS[opening]:
        return None
    inner = text[len(opening) : len(text) - len(closing)]
    parts = top_level_parts(inner)
    if len(parts) < 2 or len(top_level_parts(f"{opening}{inner}{closing}")) != 1:
        return None
    if opening == "\\{" and ("\\{" in inner or "\\}" in inner):
        return None
    return opening.strip("\\") + closing.strip("\\"), parts
