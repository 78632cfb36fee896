"""Knights-and-knaves reward with Logic-RL's scoring (`verl/utils/reward_score/kk.py`), linear time on any input."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from ._base import CorrectnessReward, MissingColumnError, missing_column_error, require_completions
from ._text import completion_text

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_GOLD_LINE = re.compile(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", re.IGNORECASE)


def _format_ok(text: str) -> bool:
    """Each of the four tags exactly once, in the order think, /think, answer, /answer."""
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    positions = [text.find(tag) for tag in _TAGS]
    return positions == sorted(positions)


def _last_answer(text: str) -> str | None:
    """The last `<answer>(.*?)</answer>` match (as `re.finditer` would find it), stripped; found with `str.find`."""
    found, position = None, 0
    while True:
        start = text.find("<answer>", position)
        if start < 0:
            return found
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            return found
        found, position = text[start + len("<answer>") : end].strip(), end + len("</answer>")


def _role_word(role: Any) -> str | None:
    """"knight" / "knave" from a gold role: a bool of any kind (Python's, numpy's, 0/1), a role word, or the text
    "True"/"False" (a column saved as text); None for anything else. `str(numpy.bool_(True)).lower()` is "true",
    which no completion matches: every right answer scored -0.5."""
    text = str(role).strip().lower()
    if text in ("knight", "knave"):
        return text
    if text in ("true", "1"):
        return "knight"
    if text in ("false", "0"):
        return "knave"
    return None


def _gold_roles(names: Any, solution: Any) -> dict[str, str] | None:
    """`{name: "knight"|"knave"}` from `names` + `solution` (bools or role words), or, when `names` is None, from the
    `solution_text_format` text in `solution`."""
    if names is not None:
        roles = {}
        for name, role in zip(names, solution, strict=True):
            word = _role_word(role)
            if word is None:
                return None  # an unknown role: no completion can be checked against it
            roles[str(name)] = word
        return roles
    if isinstance(solution, str):
        roles = {}
        for line in solution.split("\n"):
            match = _GOLD_LINE.search(line) if line.strip() else None
            if match:
                roles[match.group(1)] = match.group(2).lower()
        return roles
    return None


def _parse_roles(answer: str, names: Sequence[str]) -> dict[str, str] | None:
    lowered = answer.lower()
    if lowered.count("knight") + lowered.count("knave") != len(names):
        return None
    roles = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
        if not match:
            return None
        roles[name] = match.group(1).lower()
    return roles


class KKLogic(CorrectnessReward):
    r"""Logic-RL's knights-and-knaves score: format (+1 / -1) plus answer (+2 all roles right, -1.5 parsed but wrong,
    -2 unparseable or bad format), so totals are 3 / -0.5 / -1 / -3.

    Format: `<think>`, `</think>`, `<answer>`, `</answer>` each exactly once, in that order. The answer is the last
    `<answer>...</answer>`; it must mention knight/knave exactly once per person and say `<Name> is a knight|knave`
    for each. The gold comes from the columns `names` + `solution` (bools, True = knight) or, failing those,
    `solution_text_format` ("(1) Ella is a knight\n(2) ..."). Logic-RL prompts end with a pre-filled `<think>`:
    pass `prefilled_think=True` so such completions (which start inside the think block) keep their format point.
    `is_correct` is True only for the full score.

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("kk_logic")
    >>> good = "<think>...</think><answer>(1) Ann is a knight\n(2) Bob is a knave</answer>"
    >>> wrong = "<think>...</think><answer>(1) Ann is a knave\n(2) Bob is a knave</answer>"
    >>> reward(completions=[good, wrong, "<answer>Ann is a knight</answer>"], names=[["Ann", "Bob"]] * 3,
    ...        solution=[[True, False]] * 3)
    [3.0, -0.5, -3.0]
    ```
    """

    registry_name = "kk_logic"
    correct, incorrect = 3.0, -3.0

    def __init__(
        self,
        prefilled_think: bool = False,
        names_key: str = "names",
        solution_key: str = "solution",
        solution_text_key: str = "solution_text_format",
        name: str | None = None,
    ) -> None:
        self.prefilled_think = bool(prefilled_think)
        self.names_key, self.solution_key, self.solution_text_key = names_key, solution_key, solution_text_key
        self._set_name(name)

    def missing_columns(self, columns: Iterable[str]) -> MissingColumnError | None:
        columns = list(columns)
        if {self.names_key, self.solution_key} <= set(columns) or self.solution_text_key in columns:
            return None
        column = f"{self.names_key}' + '{self.solution_key}' (or '{self.solution_text_key}"
        return missing_column_error(self.__name__, column, columns)

    def gold_columns(self) -> tuple[str, ...]:
        return (self.names_key, self.solution_key, self.solution_text_key)

    def _golds(self, kwargs: dict[str, Any]) -> list:
        if self.names_key in kwargs and self.solution_key in kwargs:
            return list(zip(kwargs[self.names_key], kwargs[self.solution_key], strict=True))
        if self.solution_text_key in kwargs:
            return [(None, text) for text in kwargs[self.solution_text_key]]
        raise self.missing_columns(kwargs)

    def score(self, text: str, gold: tuple[Any, Any]) -> float | None:
        """Format score + answer score of one completion against one `(names, solution)` gold."""
        names, solution = gold
        roles = _gold_roles(names, solution)
        if not roles:
            return None
        if self.prefilled_think:
            text = "<think>" + text
        format_ok = _format_ok(text)
        answer = _last_answer(text) if format_ok else None
        if answer is None:
            return -3.0
        predicted = _parse_roles(answer, list(roles))
        if predicted is None:
            return -1.0
        return 3.0 if predicted == roles else -0.5

    def _check(self, text: str, gold: Any) -> bool | None:
        value = self.score(text, gold)
        return None if value is None else value == 3.0

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        completions = require_completions(self.__name__, completions, completion_ids)
        golds = self._golds(kwargs)
        rewards: list[float | None] = []
        for completion, gold in zip(completions, golds, strict=True):
            try:
                rewards.append(self.score(completion_text(completion), gold))
            except Exception:
                rewards.append(self.incorrect)
        return rewards
