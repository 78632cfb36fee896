"""Length-aware rewards. Lengths are tokens: `len(completion_ids[i])`, which includes the EOS token when generated.

`repetition_penalty` and `soft_overlong` delegate to `trl.rewards` (same formulas, token-based). `cosine_scaled`
re-states TRL's clamped cosine because TRL's version is tied to `accuracy_reward` (slow, conversational only);
here correctness comes from any registry reward with `is_correct` (default `math_equivalence`). `kimi_length` is
Kimi k1.5's length reward per prompt group (open-r1's `len_reward` pools the whole batch and counts characters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from ._base import MissingColumnError, Reward, log_timeouts, require_completions
from .registry import get_reward


def _require_ids(reward_name: str, completion_ids: Any) -> None:
    if completion_ids is None:
        raise TypeError(
            f"reward '{reward_name}' measures length in tokens and needs completion_ids (GRPOTrainer passes them; "
            "when calling it directly pass completion_ids=[[token ids], ...])"
        )


def _token_lengths(reward_name: str, completion_ids: Any, count: int) -> list[int | None]:
    _require_ids(reward_name, completion_ids)
    lengths: list[int | None] = []
    for ids in list(completion_ids)[:count]:
        try:
            lengths.append(len(ids))
        except TypeError:
            lengths.append(None)
    return lengths


class _CheckedLengthReward(Reward):
    """A length reward whose value depends on the correctness verdict of a checker reward."""

    def _init_checker(self, checker: Any, answer_key: str) -> None:
        self.checker, self.answer_key = checker, answer_key
        if isinstance(checker, str):
            self._checker = get_reward(checker, answer_key=answer_key)
        else:
            if answer_key != "answer":
                raise ValueError(
                    "answer_key applies to a checker given by name; set it on the checker instance instead"
                )
            self._checker = checker
        if not callable(getattr(self._checker, "is_correct", None)):
            raise TypeError(
                f"checker {checker!r} has no is_correct(...) method; use a correctness reward such as "
                "'math_equivalence' or 'boxed_answer'"
            )

    def missing_columns(self, columns: Iterable[str]) -> MissingColumnError | None:
        error = self._checker.missing_columns(columns) if hasattr(self._checker, "missing_columns") else None
        return None if error is None else self._with_checker(error)

    def gold_columns(self) -> tuple[str, ...]:
        read = getattr(self._checker, "gold_columns", None)
        return tuple(read()) if callable(read) else (self.answer_key,)

    def _with_checker(self, error: MissingColumnError) -> MissingColumnError:
        return MissingColumnError(f"reward '{self.__name__}' judges correctness with {error}")

    def _verdicts_and_lengths(self, prompts, completions, completion_ids, kwargs):
        completions = require_completions(self.__name__, completions, completion_ids)
        lengths = _token_lengths(self.__name__, completion_ids, len(completions))
        log_metric = kwargs.pop("log_metric", None)
        try:
            if callable(getattr(self._checker, "judge", None)):  # a registry reward: its timeouts count here
                verdicts, timeouts = self._checker.judge(
                    prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
                )
                log_timeouts(self._checker, self.__name__, timeouts, log_metric)
            else:
                verdicts = self._checker.is_correct(
                    prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
                )
        except MissingColumnError as error:
            raise self._with_checker(error) from None
        return verdicts, lengths


class CosineScaled(_CheckedLengthReward):
    r"""`R = lo + (hi - lo)/2 * (1 + cos(pi * min(L / max_len, 1)))` with L in tokens: a correct answer earns
    `max_value_correct` when short and `min_value_correct` at `max_len`; a wrong one gets `min_value_wrong` when short
    and `max_value_wrong` at `max_len` (long wrong answers are penalised less, to keep exploring).

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("cosine_scaled", max_len=100)
    >>> completions = [r"\boxed{\frac{63}{400}}", r"\boxed{\frac{63}{400}}", r"\boxed{1}", r"\boxed{1}"]
    >>> ids = [[0] * 22, [0] * 80, [0] * 22, [0] * 80]
    >>> [round(r, 4) for r in reward(completions=completions, completion_ids=ids, answer=[r"\frac{63}{400}"] * 4)]
    [0.9426, 0.5477, -0.9426, -0.5477]
    ```
    """

    registry_name = "cosine_scaled"

    def __init__(
        self,
        max_len: int = 1000,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
        checker: Any = "math_equivalence",
        answer_key: str = "answer",
        name: str | None = None,
    ) -> None:
        if not max_len > 0:
            raise ValueError(f"max_len must be > 0 (tokens at which the cosine reaches its end value), got {max_len}")
        self.max_len = max_len
        self.min_value_wrong, self.max_value_wrong = float(min_value_wrong), float(max_value_wrong)
        self.min_value_correct, self.max_value_correct = float(min_value_correct), float(max_value_correct)
        self._init_checker(checker, answer_key)
        self._set_name(name)

    def value(self, correct: bool, length: int) -> float:
        """The reward of one completion of `length` tokens."""
        low, high = (
            (self.min_value_correct, self.max_value_correct)
            if correct
            else (self.max_value_wrong, self.min_value_wrong)
        )
        progress = min(length / self.max_len, 1.0)
        return low + 0.5 * (high - low) * (1.0 + math.cos(math.pi * progress))

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        verdicts, lengths = self._verdicts_and_lengths(prompts, completions, completion_ids, kwargs)
        return [
            None if verdict is None or length is None else self.value(verdict, length)
            for verdict, length in zip(verdicts, lengths)
        ]


def _prompt_key(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return tuple(
            (message.get("role"), str(message.get("content"))) if isinstance(message, dict) else repr(message)
            for message in prompt
        )
    return repr(prompt)


class KimiLength(_CheckedLengthReward):
    r"""Kimi k1.5 length reward per prompt group: `lam = 0.5 - (L - min) / (max - min)` over the completions that share
    a prompt in this call; correct -> `lam`, wrong -> `min(0, lam)`; a group whose lengths are all equal -> 0.

    GRPOTrainer may split a group across ranks; each rank then normalises over the part it holds. Without `prompts`
    the whole call is one group.

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("kimi_length", checker="boxed_answer")
    >>> completions = [r"\boxed{7}", r"\boxed{8}", r"\boxed{7}", r"\boxed{8}"]
    >>> ids = [[0] * 100, [0] * 150, [0] * 200, [0] * 300]
    >>> reward(prompts=["p"] * 4, completions=completions, completion_ids=ids, answer=["7"] * 4)
    [0.5, 0.0, 0.0, -0.5]
    ```
    """

    registry_name = "kimi_length"

    def __init__(self, checker: Any = "math_equivalence", answer_key: str = "answer", name: str | None = None) -> None:
        self._init_checker(checker, answer_key)
        self._set_name(name)

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        verdicts, lengths = self._verdicts_and_lengths(prompts, completions, completion_ids, kwargs)
        groups: dict[Any, list[int]] = {}
        for index in range(len(lengths)):
            key = _prompt_key(prompts[index]) if prompts is not None and index < len(prompts) else None
            groups.setdefault(key, []).append(index)
        rewards: list[float | None] = [None] * len(lengths)
        for members in groups.values():
            known = [lengths[index] for index in members if lengths[index] is not None]
            shortest, longest = (min(known), max(known)) if known else (0, 0)
            for index in members:
                if verdicts[index] is None or lengths[index] is None:
                    continue
                if longest == shortest:
                    rewards[index] = 0.0
                    continue
                lam = 0.5 - (lengths[index] - shortest) / (longest - shortest)
                rewards[index] = lam if verdicts[index] else min(0.0, lam)
        return rewards


class _TrlTokenReward(Reward):
    """A token-length reward computed by a `trl.rewards` callable, built from the current attributes at each call
    (so a callback may change them between steps) and applied item by item (one bad entry scores 0.0)."""

    def _trl_reward(self) -> Callable:
        raise NotImplementedError

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        require_completions(self.__name__, completions, completion_ids)  # same length checks as every reward
        _require_ids(self.__name__, completion_ids)
        trl_reward = self._trl_reward()
        try:  # the whole batch in one call (TRL's speed); item by item only if an entry is malformed
            rewards = [float(value) for value in trl_reward(completion_ids=completion_ids)]
            if len(rewards) == len(completion_ids) and all(math.isfinite(value) for value in rewards):
                return rewards
        except Exception:
            pass
        rewards = []
        for ids in completion_ids:
            try:
                value = float(trl_reward(completion_ids=[ids])[0])
            except Exception:
                value = 0.0
            rewards.append(value if math.isfinite(value) else 0.0)
        return rewards


class RepetitionPenalty(_TrlTokenReward):
    """`(1 - unique / total token n-grams) * max_penalty`; 0 when shorter than `ngram_size` (`trl.rewards`).

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("repetition_penalty", ngram_size=2)
    >>> reward(completions=["a", "b", "c"], completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5], [1]])
    [0.0, -0.75, 0.0]
    ```
    """

    registry_name = "repetition_penalty"

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0, name: str | None = None) -> None:
        if ngram_size < 1:
            raise ValueError(f"ngram_size must be >= 1 (tokens per n-gram), got {ngram_size}")
        if max_penalty > 0:
            raise ValueError(f"max_penalty must be <= 0 (it is the most negative reward), got {max_penalty}")
        self.ngram_size, self.max_penalty = int(ngram_size), float(max_penalty)
        self._set_name(name)

    def _trl_reward(self) -> Callable:
        from trl.rewards import get_repetition_penalty_reward

        return get_repetition_penalty_reward(self.ngram_size, self.max_penalty)


class SoftOverlong(_TrlTokenReward):
    """DAPO Eq. 13 on token length L: 0 up to `max_completion_len - soft_punish_cache`, then linear to -1 at
    `max_completion_len`, -1 beyond (`trl.rewards.get_soft_overlong_punishment`). Applies whatever the correctness.

    Set `max_completion_len` to the run's `max_completion_length` (the defaults are DAPO's 20480/4096); the
    attributes are plain and may be changed between steps (a phase callback does when the length cap changes).

    Example:
    ```python
    >>> from rewards import get_reward
    >>> reward = get_reward("soft_overlong", max_completion_len=100, soft_punish_cache=20)
    >>> reward(completions=["a", "b", "c"], completion_ids=[[0] * 50, [0] * 90, [0] * 110])
    [0.0, -0.5, -1.0]
    ```
    """

    registry_name = "soft_overlong"

    def __init__(
        self, max_completion_len: int = 20480, soft_punish_cache: int = 4096, name: str | None = None
    ) -> None:
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(
                "need 0 <= soft_punish_cache <= max_completion_len (tokens), got "
                f"soft_punish_cache={soft_punish_cache}, "
                f"max_completion_len={max_completion_len}"
            )
        self.max_completion_len, self.soft_punish_cache = int(max_completion_len), int(soft_punish_cache)
        self._set_name(name)

    def _trl_reward(self) -> Callable:
        from trl.rewards import get_soft_overlong_punishment

        return get_soft_overlong_punishment(self.max_completion_len, self.soft_punish_cache)
