"""One allocation per group of decode-step projections that read the same input, so the group is one GEMM (issue 14).

Why: at decode shapes (32 rows) a projection's GEMM is bound by launch and tail latency, not by its weight bytes: in
the Qwen2-0.5B step q, k and v took 4.2 us each (1.6 MB and 0.23 MB of weights, under 1 us at the bandwidth), gate and
up 5.7 us each (benchmarks/results/rollout_engine.md, call 4's profile). One GEMM over the concatenated weights does
the work of three (q/k/v) or two (gate/up) in about the time of one.

How, without a second copy of the weights (memory) and without losing in-place updates (the CUDA graph reads the
live storage): the members' Parameters are re-pointed (`param.data = view`) at row slices of one new allocation that
holds their values, so the module, the optimizer and the checkpoint code keep the same Parameter objects and every
in-place update lands in the fused storage. That is done only where nobody else owns the storage: each weight and
bias must be a plain tensor alone in its own allocation (DeepSpeed ZeRO-1/2 keep bf16 parameters as views of their
flat buffers, FSDP as DTensor shards: left alone, the group runs as separate GEMMs). `FusedLinear.holds` tells when
something re-pointed a member since (`module.to`, `load_state_dict(assign=True)`): the engine then fuses again before
its next capture. transformers' `save_pretrained` clones parameters that share an allocation without overlapping,
and `torch.save` keeps views as views; tests/test_fused_weights.py checks both round trips.

A group whose adapters' A products fold into its GEMM (`lora_decode.FOLD_LORA_A`) is not re-pointed but copied
(`stack_copies`, `copy_members`): its base weights, then copies of the A weights as extra rows, into buffers the
engine holds only while it generates (`arena.GenerationArena`). Extra rows kept after the base weights in their own
allocation (the eighth session's layout) stayed allocated beside training: +6.5 / +60 MiB of peak at the GSM8K
recipe's reset-3 / reset-4 (benchmarks/results/rollout_engine.md, ninth session).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

FUSE_BASE = True  # False: every base projection is its own GEMM (tests, A/B benchmarks); read when a step is traced


@dataclass(frozen=True)
class FusedLinear:
    """`torch.nn.Linear` layers whose weights (and biases) are consecutive row slices of `weight` (and `bias`): their
    own storage (`fuse_linears`), or copies of them (`stack_copies`)."""

    members: tuple[torch.nn.Linear, ...]
    weight: torch.Tensor  # (sum of out_features, in_features)
    bias: torch.Tensor | None  # (sum of out_features,) or None when no member has a bias
    sizes: tuple[int, ...]  # out_features per member, in order
    # `weight`'s rows followed by `extra_rows` more of the same buffer, which belong to no parameter (the decode step
    # keeps copies of LoRA A weights there: `lora_decode`'s folded products); None: no extra rows (`stack_copies` only)
    stacked: torch.Tensor | None = None

    @property
    def extra_rows(self) -> int:
        return 0 if self.stacked is None else self.stacked.shape[0] - self.weight.shape[0]

    @property
    def extra(self) -> torch.Tensor | None:
        """The rows after the members' (views; written by whoever asked for them, never by the optimizer)."""
        return None if self.stacked is None else self.stacked[self.weight.shape[0] :]

    def holds(self) -> bool:
        """Every member's weight and bias are still the slices of this allocation (nothing re-pointed them)."""
        return all(
            _is_slice(member.weight, self.weight, offset) and (self.bias is None or _is_slice(member.bias, self.bias, offset))
            for member, offset in zip(self.members, _offsets(self.sizes), strict=True)
        )

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's `linear(x)`, from one GEMM (split along the last dimension, no copies)."""
        return list(torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *accumulate(sizes[:-1])]


def _is_slice(part: torch.Tensor | None, whole: torch.Tensor, row: int) -> bool:
    """`part` is rows `row:` of `whole` (same allocation, same layout)."""
    if part is None:
        return False
    row_length = whole.stride(0) if whole.dim() == 2 else 1
    return (
        part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        and part.storage_offset() == whole.storage_offset() + row * row_length
        and part.stride() == whole.stride()
        and part.dtype == whole.dtype
    )


def _owns_its_allocation(tensor: torch.Tensor) -> bool:
    """A plain dense tensor that is the whole of its allocation (no one else's view, not a DTensor or subclass)."""
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter) and type(tensor.data) is torch.Tensor
    return (
        plain
        and tensor.layout == torch.strided
        and tensor.device.type != "meta"
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


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


@torch.no_grad()
def fuse_linears(linears: Sequence[torch.nn.Module], previous: FusedLinear | None = None) -> FusedLinear | None:
    """The group as one `FusedLinear`, re-pointing its Parameters into one allocation if they are not already there;
    None where that is not safe (see the module docstring) or the layers do not fit (`fusable`). `previous`: this
    group's earlier fusion, whose allocation members may still point into (when only some were re-pointed)."""
    if not FUSE_BASE or not fusable(linears):
        return None
    members = tuple(linears)
    sizes = tuple(linear.weight.shape[0] for linear in members)
    has_bias = members[0].bias is not None
    weight, bias, rows = members[0].weight, members[0].bias, sum(sizes)
    if _within_allocation(weight, rows) and (not has_bias or _within_allocation(bias, rows)):
        already = FusedLinear(members, _rows(weight, rows), _rows(bias, rows) if has_bias else None, sizes)
        if already.holds():
            return already  # fused earlier (by this engine or another): reuse it, no copy
    tensors = [p for linear in members for p in (linear.weight, linear.bias) if p is not None]
    ours = set() if previous is None else {t.untyped_storage().data_ptr() for t in (previous.weight, previous.bias)
                                           if t is not None}  # fmt: skip
    if not all(_owns_its_allocation(t) or t.untyped_storage().data_ptr() in ours for t in tensors):
        return None
    stacked = torch.cat([linear.weight for linear in members])
    bias = torch.cat([linear.bias for linear in members]) if has_bias else None
    for linear, offset, size in zip(members, _offsets(sizes), sizes, strict=True):
        linear.weight.data = stacked[offset : offset + size]
        if has_bias:
            linear.bias.data = bias[offset : offset + size]
    return FusedLinear(members, stacked, bias, sizes)


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
    return FusedLinear(members, stacked[:rows], bias, sizes, stacked if stacked.shape[0] > rows else None)


@torch.no_grad()
def copy_members(fused: FusedLinear) -> None:
    """Copy the members' current weights (and biases) into a `stack_copies` fusion (before every generation: the
    buffers are copies, and freed in between)."""
    for member, offset, size in zip(fused.members, _offsets(fused.sizes), fused.sizes, strict=True):
        fused.weight[offset : offset + size].copy_(member.weight)
        if fused.bias is not None:
            fused.bias[offset : offset + size].copy_(member.bias)


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows starting at `tensor`, as one tensor (a view of its allocation)."""
    return tensor.detach().as_strided((rows, *tensor.shape[1:]), tensor.stride())


def _within_allocation(tensor: torch.Tensor, rows: int) -> bool:
    """`rows` rows starting at `tensor` fit in its allocation (so viewing them cannot read past it)."""
    row_bytes = (tensor.stride(0) if tensor.dim() == 2 else 1) * tensor.element_size()
    start = tensor.storage_offset() * tensor.element_size()
    return tensor.is_contiguous() and start + rows * row_bytes <= tensor.untyped_storage().nbytes()
