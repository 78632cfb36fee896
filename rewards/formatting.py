"""Format rewards with open-r1 semantics (`src/open_r1/rewards.py`), in linear time on any input.

`think_answer_format` is open-r1's `format_reward` (TRL's `think_format_reward` checks only the think block);
`prefilled_think=True` scores completions whose prompt already ends with `<think>\\n` (DeepSeek-R1-Distill
templates), which open-r1's version scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ._base import Reward

_ANSWER_CLOSE_AT_LINE_END = re.compile(r"\n</answer>(?:\n|\Z)")
_THINK_TO_ANSWER = "\n</think>\n<answer>\n"
_REASONING_STEP = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def _prefill(text: str, prefilled_think: bool) -> str:
    return "<think>\n" + text if prefilled_think else text


class ThinkAnswerFormat(Reward):
    r"""1.0 if the completion is `<think>\n...\n</think>\n<answer>\n...\n</answer>` (open-r1's regex with DOTALL and
    MULTILINE: text after `</answer>` on a later line is allowed), else 0.0.

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("think_answer_format")
    >>> reward(completions=["<think>\nhm\n</think>\n<answer>\n4\n</answer>", "<think>hm</think><answer>4</answer>"])
    [1.0, 0.0]
    ```
    """

    registry_name = "think_answer_format"

    def __init__(self, prefilled_think: bool = False, name: str | None = None) -> None:
        self.prefilled_think = bool(prefilled_think)
        self._set_name(name)

    def _score(self, text: str, ids: Sequence[int] | None) -> float:
        # Same language as re.match(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", text, DOTALL|MULTILINE),
        # without its backtracking: the earliest think/answer boundary leaves the most room for `</answer>`.
        text = _prefill(text, self.prefilled_think)
        if not text.startswith("<think>\n"):
            return 0.0
        boundary = text.find(_THINK_TO_ANSWER, len("<think>\n"))
        if boundary < 0:
            return 0.0
        return 1.0 if _ANSWER_CLOSE_AT_LINE_END.search(text, boundary + len(_THINK_TO_ANSWER)) else 0.0


class TagCount(Reward):
    r"""0.25 for each of `<think>\n`, `\n</think>\n`, `\n<answer>\n`, `\n</answer>` present exactly once.

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("tag_count")
    >>> reward(completions=["<think>\na\n</think>\n<answer>\nb\n</answer>", "<think>\na\n</think>\nb", "b"])
    [1.0, 0.5, 0.0]
    ```
    """

    registry_name = "tag_count"
    _TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")

    def __init__(self, prefilled_think: bool = False, name: str | None = None) -> None:
        self.prefilled_think = bool(prefilled_think)
        self._set_name(name)

    def _score(self, text: str, ids: Sequence[int] | None) -> float:
        text = _prefill(text, self.prefilled_think)
        return 0.25 * sum(text.count(tag) == 1 for tag in self._TAGS)


class ReasoningSteps(Reward):
    r"""`min(1, steps / 3)` where steps count `Step k:`, `First,`/`Second,`/`Next,`/`Finally,`, bullets after a newline
    and a leading `1.` (open-r1's pattern has no MULTILINE flag: only the first line's number counts).

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("reasoning_steps")
    >>> reward(completions=["Step 1: a Step 2: b Step 3: c", "First, a. Finally, b.", "1. a\n2. b\n3. c", "a"])
    [1.0, 0.6666666666666666, 0.3333333333333333, 0.0]
    ```
    """

    registry_name = "reasoning_steps"

    def __init__(self, min_steps: int = 3, name: str | None = None) -> None:
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1 (steps for the full reward), got {min_steps}")
        self.min_steps = int(min_steps)
        self._set_name(name)

    def _score(self, text: str, ids: Sequence[int] | None) -> float:
        return min(1.0, len(_REASONING_STEP.findall(text)) / self.min_steps)
