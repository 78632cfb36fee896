"""Grading completions with the reward registry, and the notion of "correct" that pass@k counts.

A reward from `rewards.get_reward` has TRL's signature, so grading calls it exactly as GRPOTrainer does: by keyword,
one entry per completion, every dataset column repeated per completion. "Correct" is the reward's own judgement when
it exposes one (`is_correct(value)` or a `correct_value` attribute), otherwise reward > 0 (this covers the 1/0
`math_equivalence` and the +1/-1 `boxed_answer` conventions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .sampling import completion_for_reward

# Which reward grades which dataset when --reward is not given.
DEFAULT_REWARDS = {"gsm8k": "boxed_answer", "math500": "math_equivalence", "kk": "kk_logic", "jsonl": "math_equivalence"}

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


def is_correct(reward_func: Callable, value: float | None) -> bool:
    """Whether a reward value means "solved" (None / NaN: not solved)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    judge = getattr(reward_func, "is_correct", None)
    if callable(judge):
        return bool(judge(value))
    target = getattr(reward_func, "correct_value", None)
    if target is not None:
        return math.isclose(float(value), float(target), rel_tol=1e-9, abs_tol=1e-9) or float(value) > float(target)
    return float(value) > 0


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
    as chat messages when the prompt is conversational, like TRL does.
    """
    if not len(prompts) == len(completions) == len(rows):
        raise ValueError(f"grade() got {len(prompts)} prompts, {len(completions)} completions and {len(rows)} rows.")
    values: list[float] = []
    for start in range(0, len(completions), chunk_size):
        stop = min(len(completions), start + chunk_size)
        columns = sorted({key for row in rows[start:stop] for key in row} - _RESERVED)
        kwargs = {key: [row.get(key) for row in rows[start:stop]] for key in columns}
        batch_prompts = list(prompts[start:stop])
        batch = [completion_for_reward(p, c) for p, c in zip(batch_prompts, completions[start:stop])]
        ids = list(completion_ids[start:stop]) if completion_ids is not None else [[] for _ in batch]
        out = reward_func(prompts=batch_prompts, completions=batch, completion_ids=ids, **kwargs)
        if len(out) != len(batch):
            raise ValueError(f"Reward {reward_name(reward_func)!r} returned {len(out)} values for {len(batch)} completions.")
        values.extend(float("nan") if v is None else float(v) for v in out)
    return values, [is_correct(reward_func, v) for v in values]
