"""Grading completions with the reward registry, and the notion of "correct" that pass@k counts.

A reward from `rewards.get_reward` has TRL's signature, so grading calls it exactly as GRPOTrainer does: by keyword,
one entry per completion, every dataset column repeated per completion. "Correct" is the reward's own judgement when
it exposes one (the registry's correctness rewards have `is_correct(...)` with the reward's own arguments, returning
True/False/None per completion), otherwise reward > 0 (the 1/0 and +1/-1 conventions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .sampling import completion_for_reward

# Which reward grades which dataset when --reward is not given.
DEFAULT_REWARDS = {
    "gsm8k": "boxed_answer", "math500": "math_equivalence", "kk": "kk_logic", "jsonl": "math_equivalence",
    "synthetic_arithmetic": "boxed_answer", "synthetic_kk": "kk_logic",
}  # fmt: skip

# Columns TRL never forwards to reward functions (it passes them as `prompts`/`completions`/`completion_ids`).
_RESERVED = {"prompt", "completion", "completion_ids"}


def resolve_reward(reward: str | Callable, **params: Any) -> Callable:
    """A reward callable: a registry name (`rewards.get_reward`) or any TRL-style callable, returned as is."""
    if callable(reward):
        return reward
    import rewards

    names = list(rewards.available())
    if reward not in names:
        raise ValueError(f"Unknown reward {reward!r}; available rewards: {', '.join(sorted(names))}.")
    return rewards.get_reward(reward, **params)


def reward_name(reward_func: Callable) -> str:
    return getattr(reward_func, "__name__", type(reward_func).__name__)


def _judge(reward_func: Callable, call: dict[str, Any]) -> tuple[list[float | None], list[bool | None]]:
    """Reward values and verdicts of one batch, asking the reward for correctness when it can answer.

    A binary registry reward (`is_correct` plus `correct`/`incorrect` values) is asked once and its values derived
    from the verdicts, as its own `__call__` does, so math_verify runs once per completion, not twice.
    """
    asks = getattr(reward_func, "is_correct", None)
    binary = isinstance(getattr(reward_func, "correct", None), (int, float)) and isinstance(
        getattr(reward_func, "incorrect", None), (int, float)
    )
    if callable(asks) and binary:
        verdicts = list(asks(**call))
        values = [None if v is None else float(reward_func.correct if v else reward_func.incorrect) for v in verdicts]
        return values, verdicts
    values = [None if v is None else float(v) for v in reward_func(**call)]
    if callable(asks):
        return values, list(asks(**call))
    return values, [None if v is None or math.isnan(v) else v > 0 for v in values]


def grade(
    reward_func: Callable,
    prompts: Sequence[Any],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    completion_ids: Sequence[list[int]] | None = None,
    chunk_size: int = 512,
) -> tuple[list[float], list[bool]]:
    """Rewards (NaN where the reward returned None) and correctness, one per completion.

    `prompts[i]` and `rows[i]` (the dataset row: gold columns) belong to `completions[i]`. Completions are passed
    as chat messages when the prompt is conversational, like TRL does. Stored samples keep text only, so
    `completion_ids` is None unless given (correctness rewards do not read it).
    """
    if not len(prompts) == len(completions) == len(rows):
        raise ValueError(f"grade() got {len(prompts)} prompts, {len(completions)} completions and {len(rows)} rows.")
    values: list[float] = []
    correct: list[bool] = []
    for start in range(0, len(completions), chunk_size):
        stop = min(len(completions), start + chunk_size)
        columns = sorted({key for row in rows[start:stop] for key in row} - _RESERVED)
        kwargs = {key: [row.get(key) for row in rows[start:stop]] for key in columns}
        batch_prompts = list(prompts[start:stop])
        batch = [completion_for_reward(p, c) for p, c in zip(batch_prompts, completions[start:stop])]
        ids = list(completion_ids[start:stop]) if completion_ids is not None else None
        call = {"prompts": batch_prompts, "completions": batch, "completion_ids": ids, **kwargs}
        batch_values, verdicts = _judge(reward_func, call)
        if len(batch_values) != len(batch) or len(verdicts) != len(batch):
            raise ValueError(
                f"Reward {reward_name(reward_func)!r} returned {len(batch_values)} values / {len(verdicts)} verdicts "
                f"for {len(batch)} completions."
            )
        values.extend(float("nan") if v is None else v for v in batch_values)
        correct.extend(bool(v) for v in verdicts)
    return values, correct
