"""What every registry reward shares: TRL's call signature, a unique stable `__name__`, the gold-column lookup and
the rule that one bad completion never crashes a training step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from ._text import completion_text

# Keyword arguments GRPOTrainer passes that are not dataset columns (trl 1.16 `_calculate_rewards`).
TRL_NON_COLUMN_KWARGS = frozenset(
    {"trainer_state", "log_extra", "log_metric", "environments", "prompts", "completions", "completion_ids"}
)


class MissingColumnError(ValueError):
    """A reward needs a dataset column that the batch does not have."""


def missing_column_error(reward_name: str, column: str, columns: Iterable[str], hint: str = "") -> MissingColumnError:
    """The error for a missing gold column; `columns` are the batch's keyword arguments or the dataset's columns."""
    present = sorted(key for key in columns if key not in TRL_NON_COLUMN_KWARGS)
    return MissingColumnError(
        f"reward '{reward_name}' needs the dataset column '{column}', but the data only has {present}. "
        f"Add the column to the dataset (GRPOConfig keeps it with remove_unused_columns=False){hint}."
    )


def _format_param(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(getattr(value, "__name__", value))


class Reward:
    """Base of the registry rewards: a picklable callable class with TRL's reward signature.

    Subclasses set `registry_name`, store their parameters as attributes named like their `__init__` arguments, call
    `self._set_name(name)` at the end of `__init__`, and implement `_score(text, ids)` (or `__call__` when a reward
    needs the whole batch); `fallback` is what a completion scores when scoring it raised. The instance `__name__`
    (TRL's metric name `rewards/<__name__>/mean`) is the registry name plus one `_<param><value>` suffix per
    non-default parameter, so two configurations never collide; `name=` overrides it.
    """

    registry_name: ClassVar[str] = "reward"
    fallback: ClassVar[float | None] = 0.0

    def _set_name(self, name: str | None) -> None:
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"name must be a non-empty string, got {name!r}")
            self.__name__ = name
            return
        suffix = ""
        for parameter in inspect.signature(type(self).__init__).parameters.values():
            if parameter.name in ("self", "name") or parameter.default is inspect.Parameter.empty:
                continue
            value = getattr(self, parameter.name)
            if value != parameter.default:
                suffix += f"_{parameter.name}{_format_param(value)}"
        self.__name__ = self.registry_name + suffix

    def __repr__(self) -> str:
        return f"<reward {self.__name__}>"

    def missing_columns(self, columns: Iterable[str]) -> MissingColumnError | None:
        """The error this reward would raise at its first call on data with these `columns`, or None if they suffice."""
        return None

    def gold_columns(self) -> tuple[str, ...]:
        """The dataset columns this reward reads its gold from, so a data builder keeps them (none by default)."""
        return ()

    def _score(self, text: str, ids: Sequence[int] | None) -> float | None:
        raise NotImplementedError

    def __call__(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        completions = require_completions(self.__name__, completions, completion_ids)
        rewards = []
        for index, completion in enumerate(completions):
            try:
                ids = completion_ids[index] if completion_ids is not None else None
                reward = self._score(completion_text(completion), ids)
                if reward is not None and not math.isfinite(reward):
                    reward = self.fallback
            except Exception:  # a malformed completion scores the fallback; it never stops training
                reward = self.fallback
            rewards.append(reward)
        return rewards


def require_completions(reward_name: str, completions: Any, completion_ids: Any) -> list:
    if completions is None:
        if completion_ids is None:
            raise TypeError(f"reward '{reward_name}' was called without completions or completion_ids")
        return [None] * len(completion_ids)
    if completion_ids is not None and len(completion_ids) != len(completions):
        raise ValueError(
            f"reward '{reward_name}': {len(completions)} completions but {len(completion_ids)} completion_ids"
        )
    return completions


class CorrectnessReward(Reward):
    """A binary reward: `correct` when the completion's answer matches the gold (column `answer_key`), else
    `incorrect`.

    Other code asks for binary correctness with `is_correct(...)` (same arguments as the reward call): True/False per
    completion, None where the gold is unusable. Dynamic sampling, `cosine_scaled` and `kimi_length` use it.
    """

    correct: float = 1.0
    incorrect: float = 0.0
    answer_key: str = "answer"
    can_time_out: ClassVar[bool] = False

    def missing_columns(self, columns: Iterable[str]) -> MissingColumnError | None:
        columns = list(columns)
        if self.answer_key in columns:
            return None
        hint = f" or pass answer_key=<your column> (get_reward('{self.registry_name}', answer_key=...))"
        return missing_column_error(self.__name__, self.answer_key, columns, hint)

    def gold_columns(self) -> tuple[str, ...]:
        return (self.answer_key,)

    def _golds(self, kwargs: dict[str, Any]) -> list:
        """The gold of each completion, from the dataset columns; one clear error when a column is missing."""
        error = self.missing_columns(kwargs)
        if error is not None:
            raise error
        return list(kwargs[self.answer_key])

    def _check(self, text: str, gold: Any) -> bool | None:
        raise NotImplementedError

    def _check_batch(self, texts: list[str], golds: list[Any]) -> tuple[list[bool | None], int]:
        """(verdict per completion, how many comparisons timed out). Only a reward that can time out counts them."""
        results: list[bool | None] = []
        for text, gold in zip(texts, golds):
            try:
                results.append(self._check(text, gold))
            except Exception:
                results.append(False)
        return results, 0

    def judge(
        self, prompts: list | None = None, completions: list | None = None, completion_ids: list | None = None, **kwargs
    ) -> tuple[list[bool | None], int]:
        """`is_correct`'s verdicts and the number of comparisons that timed out, without logging anything (a length
        reward that asks this reward logs the timeouts under its own name)."""
        completions = require_completions(self.__name__, completions, completion_ids)
        golds = self._golds(kwargs)
        if len(golds) != len(completions):
            raise ValueError(f"reward '{self.__name__}': {len(completions)} completions but {len(golds)} gold answers")
        return self._check_batch([completion_text(c) for c in completions], golds)

    def is_correct(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs,
    ) -> list[bool | None]:
        verdicts, timeouts = self.judge(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
        )
        log_timeouts(self, self.__name__, timeouts, kwargs.get("log_metric"))
        return verdicts

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        verdicts = self.is_correct(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        return [None if verdict is None else (self.correct if verdict else self.incorrect) for verdict in verdicts]


def log_timeouts(checker: Any, reward_name: str, timeouts: int, log_metric: Any) -> None:
    """Report `rewards/<reward_name>/timeouts` (comparisons cut off in this call) through TRL's `log_metric` hook, for
    every call of a reward whose checker can time out, so the logged mean is per call and 0 when nothing timed out.
    GRPOTrainer averages it over the calls of a logging step and over processes."""
    if callable(log_metric) and getattr(checker, "can_time_out", False):
        log_metric(f"rewards/{reward_name}/timeouts", float(timeouts))


def check_columns(reward_funcs: Any, column_names: Iterable[str]) -> None:
    """Raise, before any generation, the `MissingColumnError` the first reward lacking a column would raise at step
    one. `reward_funcs` is one reward or a list (as given to GRPOTrainer); rewards without `missing_columns` (plain
    functions, reward models) are skipped. Call it with `train_dataset.column_names`.
    """
    columns = list(column_names)
    for reward in reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]:
        error = reward.missing_columns(columns) if callable(getattr(reward, "missing_columns", None)) else None
        if error is not None:
            raise error
