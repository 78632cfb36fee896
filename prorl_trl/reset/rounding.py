"""How much of a LoRA delta a merge into the base weights' own dtype rounds away.

Why: a hard reset merges `scale * B @ A` into the base and starts B at zero, so whatever the merge rounds off is gone
for good. Into a bf16 base every element is rounded to 8 bits of mantissa: an element of the delta smaller than half a
bf16 step of its weight vanishes entirely. After hundreds of steps the delta is many steps wide and the merge keeps
~99 % of it; a run that resets every few steps, or trains at a tiny learning rate, can have most of its learning
rounded away at each reset while the loss curve says nothing. `MergeRounding` measures it (against the merge in
float32) so the trainer can log it and warn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Above this fraction of the delta's norm rounded away, the trainer warns (the delta is then mostly under the base
# dtype's resolution: the reset discards most of what the adapter learned since the last one).
LOST_FRACTION_WARNING = 0.5


@dataclass
class MergeRounding:
    """Sums over the merged weights: |delta|^2 (the exact `scale * B @ A`) and |stored - (before + delta)|^2, and the
    weights' dtype (None until a weight is added)."""

    delta_sq: float = 0.0
    lost_sq: float = 0.0
    dtype: torch.dtype | None = None

    @torch.no_grad()
    def add(self, delta: torch.Tensor, exact: torch.Tensor, stored: torch.Tensor) -> None:
        """One weight: the float32 `delta`, `exact` = the base before the merge + delta in float32 (its rounding,
        2^-24 of the weight, is 2^15 times finer than bf16's), and `stored`, the merged weight in its own dtype."""
        self.delta_sq += float(delta.square().sum(dtype=torch.float64))
        self.lost_sq += float((stored.float() - exact).square().sum(dtype=torch.float64))
        self.dtype = stored.dtype

    def all_reduce(self, device: torch.device) -> None:
        """Sum over the ranks of the default process group (FSDP2: each rank merged its own rows); collective."""
        sums = torch.tensor([self.delta_sq, self.lost_sq], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(sums)
        self.delta_sq, self.lost_sq = (float(value) for value in sums)

    @property
    def lost_fraction(self) -> float:
        """|what was rounded away| / |delta| (0 for an all-zero delta, e.g. a fresh adapter; can exceed 1 slightly)."""
        return math.sqrt(self.lost_sq / self.delta_sq) if self.delta_sq > 0 else 0.0

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        where = f" into {self.dtype_name}" if self.dtype is not None else ""
        return f"the merge{where} rounded away {100 * self.lost_fraction:.1f} % of the LoRA delta's norm"
