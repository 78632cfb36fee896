"""DAPO soft overlong penalty (arXiv 2503.14476, eq. 13) tied to the trainer's *current* completion cap.

`trl.rewards.get_soft_overlong_punishment` bakes the cap in when it is built. In a ProRL run the cap changes between
phases (and a `SamplingScheduleCallback` may change it inside one), so a fixed cap would silently penalise the wrong
lengths. `OverlongPenalty` is a callable class whose cap and buffer the trainer overwrites every time it applies new
sampling settings (`ProRLTrainer.apply_sampling`), so it can never go stale.

DAPO (and verl) add the penalty to the score before the group advantage. Here it is one more reward column, which
TRL's default `multi_objective_aggregation="sum_then_normalize"` sums (weight 1) before the advantage: the same score,
whatever `scale_rewards` does with it afterwards. `"normalize_then_sum"` would standardise the column within each group
first (the penalty's size lost), so `checks.check_reward_shaping` refuses it.
"""

from __future__ import annotations

from typing import Any

import torch


def overlong_penalty(length: int, max_completion_length: int, overlong_buffer: int, factor: float = 1.0) -> float:
    """Penalty of one completion of `length` tokens (EOS included): 0 up to `L_max - B`, linear down to `-factor` at
    `L_max`, `-factor` beyond (generation is capped at `L_max`, so that branch is only reached at the cap).

    >>> [overlong_penalty(n, 16, 4) for n in (12, 13, 14, 16)]
    [0.0, -0.25, -0.5, -1.0]
    """
    if overlong_buffer <= 0:
        return 0.0
    expected = max_completion_length - overlong_buffer
    if length <= expected:
        return 0.0
    return max((expected - length) / overlong_buffer, -1.0) * factor


def unscored_rows_stay_unscored(rewards_per_func: torch.Tensor) -> torch.Tensor:
    """In place: the penalty column (the last) is NaN where every other reward function returned None.

    TRL skips a completion (advantage 0, out of its group's baseline) only when every column is NaN; the penalty is a
    number for every completion, so without this a completion no reward could score was trained on its length alone.
    """
    if rewards_per_func.size(1) > 1:
        rewards_per_func[torch.isnan(rewards_per_func[:, :-1]).all(dim=1), -1] = torch.nan
    return rewards_per_func


class OverlongPenalty:
    """Reward function (TRL signature) returning the DAPO overlong penalty of each completion.

    Appended by `ProRLTrainer` as the last reward function with weight 1, so it logs as
    `rewards/overlong_penalty/mean`. `max_completion_length`, `overlong_buffer` and `factor` are plain attributes,
    rewritten by the trainer at every phase or schedule change.

    Args:
        max_completion_length: The cap `L_max` in tokens (the trainer's current `max_completion_length`).
        overlong_buffer: Buffer length `B` in tokens; 0 turns the penalty off (all zeros).
        factor: Penalty at the cap.

    Example:
        >>> penalty = OverlongPenalty(max_completion_length=8, overlong_buffer=4)
        >>> penalty(completion_ids=[[1] * 3, [1] * 5, [1] * 8])
        [0.0, -0.25, -1.0]
    """

    __name__ = "overlong_penalty"

    def __init__(self, max_completion_length: int, overlong_buffer: int, factor: float = 1.0):
        self.max_completion_length = max_completion_length
        self.overlong_buffer = overlong_buffer
        self.factor = factor

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [
            overlong_penalty(len(ids), self.max_completion_length, self.overlong_buffer, self.factor)
            for ids in completion_ids
        ]

    def __repr__(self) -> str:
        return (
            f"OverlongPenalty(max_completion_length={self.max_completion_length}, "
            f"overlong_buffer={self.overlong_buffer}, factor={self.factor})"
        )
