"""One GEMM per group of decode-step projections that read the same input (issue 14): stacked copies for a generation.

Why: at decode shapes (32 rows) a projection's GEMM is bound by launch and tail latency, not by its weight bytes: in
the Qwen2-0.5B step q, k and v took 4.2 us each (1.6 MB and 0.23 MB of weights, under 1 us at the bandwidth), gate and
up 5.7 us each (benchmarks/results/rollout_engine.md, commit 88e3468, 2026-11-26). One GEMM over the concatenated
weights does the work of three (q/k/v) or two (gate/up) in about the time of one.

How: the members' weights (and biases) are copied into one buffer before every generation (`stack_copies`,
`copy_members`), into the engine's generation arena, which is freed while training (`decoder.StackGroup`); groups whose
adapters' A products fold into the GEMM get copies of the A weights as extra rows after them. The Parameters are
never touched, so the optimizer, checkpoints, DeepSpeed's flat buffers and FSDP's shards see nothing (FSDP's DTensor
shards are not `copyable`: those groups run as separate GEMMs), and every update is in the next generation's copy
(about 0.47 GB copied per generation at Qwen2-0.5B: about a millisecond). Until commit 178044a (2026-11-27) the members'
Parameters were re-pointed into one persistent allocation instead: no copy, but their old storage was freed in the
middle of the weights' allocator segments, holes only small tensors fit, and at the GSM8K recipe's reset-3 training
then needed more device memory than `compiled_generation` (benchmarks/results/rollout_engine.md, commit 115e9bb).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

FUSE_BASE = True  # False: every base projection is its own GEMM (tests, A/B benchmarks); read when a step is traced


@dataclass(frozen=True)
class FusedLinear:
    """`torch.nn.Linear` layers stacked as copies (`stack_copies`): their weights (and biases) as consecutive row slices
    of `weight` (and `bias`), the first rows of `stacked`."""

    members: tuple[torch.nn.Linear, ...]
    weight: torch.Tensor  # (sum of out_features, in_features)
    bias: torch.Tensor | None  # (sum of out_features,) or None when no member has a bias
    sizes: tuple[int, ...]  # out_features per member, in order
    # the whole buffer: `weight`'s rows, then `extra_rows` more that belong to no parameter (the decode step keeps
    # copies of LoRA A weights there: `lora_decode`'s folded products)
    stacked: torch.Tensor
    # per member, a float32 buffer the decode step fills with its frozen LoRA parts' B weights side by side (or None;
    # `lora_decode.JOIN_FROZEN`); empty: none for any member
    joined_ups: tuple[torch.Tensor | None, ...] = ()

    @property
    def extra_rows(self) -> int:
        return self.stacked.shape[0] - self.weight.shape[0]

    @property
    def extra(self) -> torch.Tensor:
        """The rows after the members' (views; written by whoever asked for them, never by the optimizer)."""
        return self.stacked[self.weight.shape[0] :]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's `linear(x)`, from one GEMM (split along the last dimension, no copies)."""
        return list(torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *accumulate(sizes[:-1])]


def fusable(linears: Sequence[torch.nn.Module], single: bool = False) -> bool:
    """Plain `Linear` layers (two or more; one is enough with `single`) on one input width, one dtype and device, all
    with a bias or none."""
    if len(linears) < (1 if single else 2) or any(type(linear) is not torch.nn.Linear for linear in linears):
        return False
    first = linears[0].weight
    with_bias = {linear.bias is not None for linear in linears}
    return len(with_bias) == 1 and all(
        linear.weight.shape[1] == first.shape[1]
        and all(p.dtype == first.dtype and p.device == first.device for p in linear.parameters())
        for linear in linears
    )


def copyable(linears: Sequence[torch.nn.Module]) -> bool:
    """`fusable` (one layer is enough) with plain dense tensors to copy from (not DTensor shards or meta tensors)."""
    return fusable(linears, single=True) and all(
        type(p.data) is torch.Tensor and p.layout == torch.strided and p.device.type != "meta"
        for linear in linears
        for p in linear.parameters()
    )


def stack_copies(linears: Sequence[torch.nn.Module], stacked: torch.Tensor, bias: torch.Tensor | None) -> FusedLinear:
    """The group as a `FusedLinear` over buffers the caller owns: `stacked` (`(sum of out_features + extra rows,
    in_features)`, the members' weights first) and `bias` (`(sum of out_features,)`, None without biases). Nothing is
    copied yet (`copy_members`) and the members' own storage is left as it is."""
    members = tuple(linears)
    sizes = tuple(linear.weight.shape[0] for linear in members)
    rows = sum(sizes)
    if not copyable(members) or stacked.shape[0] < rows or stacked.shape[1:] != members[0].weight.shape[1:]:
        raise ValueError(f"cannot stack {len(members)} layer(s) of {sizes} rows into a {tuple(stacked.shape)} buffer")
    if (bias is None) != (members[0].bias is None) or (bias is not None and bias.shape != (rows,)):
        raise ValueError("the bias buffer must match the members' biases (None when they have none)")
    return FusedLinear(members, stacked[:rows], bias, sizes, stacked)


@torch.no_grad()
def copy_members(fused: FusedLinear) -> None:
    """Copy the members' current weights (and biases) into a `stack_copies` fusion (before every generation: the
    buffers are copies, and freed in between)."""
    for member, offset, size in zip(fused.members, _offsets(fused.sizes), fused.sizes, strict=True):
        fused.weight[offset : offset + size].copy_(member.weight)
        if fused.bias is not None:
            fused.bias[offset : offset + size].copy_(member.bias)
