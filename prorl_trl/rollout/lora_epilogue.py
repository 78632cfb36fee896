"""A folded projection group's LoRA B products, additions and rounding in one kernel per group and decode step.

Why: where the A products fold into a group's base GEMM (`lora_decode._folded`), the rest of PEFT's function is
inductor's reductions `(hidden[:, None, :] * up).sum(-1)`, one output element per thread group, so every row re-reads
every factor's `up` weight, and each frozen part of an earlier reset adds one more `up` to read. `lora_epilogue`
computes the same from the GEMM's float32 output in one Triton kernel per group (`lora_epilogue_triton`) that reads
each `up` once per row tile and multiplies on tensor cores (`fused_mlp.LORA_PRECISION`, as the fused MLP). At the
GSM8K recipe's reset-4 shape (64 rows, r64 on all linear layers behind four frozen r32 q,k parts) it replaced the
q/k/v, o and down reductions and a decode step took 1.87 instead of 1.97 GPU ms on an H200; where the
adapters are r32 it lost (`MIN_RANK`; benchmarks/results/rollout_engine.md, section 2026-11-30).

The function, operation for operation, is `lora_decode._folded`'s: the base outputs rounded to the weights' dtype
(after a float32 bias, F.linear's epilogue), the A products `high + low` in float32, then per module, in stage order
(frozen parts, then the live adapter), `(hidden @ up.T) * scaling` added in float32, and one rounding. Only the
products' summation order and their split-operand arithmetic (`fused_mlp.LORA_PRECISION`) differ
(`epilogue_reference` is the torch form the tests hold the kernel to). On (`LORA_EPILOGUE`) for groups with a factor
of rank `MIN_RANK` or more, 16-bit weights and float32 adapters, on CUDA; read when a step is traced (the switch is
part of the engine's capture key); the A/B method is `benchmarks/generation.py`'s `rollout_engine_lora_reductions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .decode_attention import triton_available
from .fused_mlp import power_of_two

LORA_EPILOGUE = True  # `lora_decode._folded` hands its B products to `lora_epilogue` where `applies`
# The kernel runs for a group with a factor of at least this rank. Every group on the kernel against every group on
# inductor's reductions, one call each, on an H200 (benchmarks/results/rollout_engine.md, section 2026-11-30): it won
# with the reset-4 adapter (r64 on all linear layers; behind the recipe's four frozen r32 q,k parts: +3.9 % tokens/s
# at 64 rows, +10.8 % at validation's 100 rows; without frozen parts a tie at 64 rows) and lost with r32 q,k adapters
# at every row count and number of frozen parts tried (32 rows: -1.9 %, and -6.6 % behind three frozen parts;
# 100 rows: -1.9 %, and -2.6 % behind three): there a group's factors are many small products run one after another,
# and inductor's reductions finish as fast. The rows were not the rule: the same r32 groups lost at 100 rows. With
# the products as three bf16 products they still lost (-3.1 % at the Initial shape, -4.8 % at reset-3's; section
# 2026-11-30 from 06:58 UTC, `generation.py`'s `rollout_engine_epilogue_all`).
MIN_RANK = 64
MAX_FACTORS = 16  # factors in one launch (the GSM8K recipe's reset-4 q/k/v: 11, with 4 frozen parts on q and k)


class EpilogueFactor(NamedTuple):
    """One factor of a group's stages: its `up (end - start, rank)` float32, scaling, the module's output columns
    `[start, end)` in the group's output and the factor's first column among the A products."""

    up: torch.Tensor
    scaling: float
    start: int
    end: int
    hidden_offset: int


def column_block(boundaries: Sequence[int]) -> int | None:
    """The widest column tile (32 or 16) that divides every module boundary, so no tile spans two modules; None
    where none does."""
    for block in (32, 16):
        if all(boundary % block == 0 for boundary in boundaries):
            return block
    return None


def takes_kernel(factors: Sequence[EpilogueFactor]) -> bool:
    """The measured rule: a group whose factors include one of rank `MIN_RANK` or more."""
    return takes_ranks([factor.up.shape[1] for factor in factors])  # a list: dynamo traces it, not a generator


def takes_ranks(ranks: Sequence[int]) -> bool:
    """`takes_kernel` from the factors' ranks alone (known before any product exists)."""
    return any([rank >= MIN_RANK for rank in ranks])


def applies(product: torch.Tensor, dtype: torch.dtype, factors: Sequence[EpilogueFactor]) -> bool:
    """Whether the kernel computes this group: switched on, a factor of rank `MIN_RANK` or more, CUDA with Triton,
    16-bit outputs, float32 factors, at most `MAX_FACTORS` (the caller also needs a `column_block`)."""
    return applies_to([f.up.shape[1] for f in factors], product.is_cuda, dtype, [f.up.dtype for f in factors])


def applies_to(ranks: Sequence[int], on_cuda: bool, dtype: torch.dtype, factor_dtypes: Sequence[torch.dtype]) -> bool:
    """`applies` from what is known before any product exists: the factors' ranks and dtypes, the device, the
    output dtype."""
    return (
        LORA_EPILOGUE
        and takes_ranks(ranks)
        and on_cuda
        and triton_available()
        and dtype in (torch.bfloat16, torch.float16)
        and 0 < len(ranks) <= MAX_FACTORS
        and all([factor_dtype == torch.float32 for factor_dtype in factor_dtypes])
    )


def epilogue_reference(
    product: torch.Tensor, bias: torch.Tensor | None, factors: Sequence[EpilogueFactor], width: int, ranks: int,
    split: bool, dtype: torch.dtype,
) -> torch.Tensor:
    """`(rows, width)` in `dtype`: `lora_decode._folded`'s outputs, concatenated, in torch ops (the kernel's
    reference)."""
    base = product[:, :width]
    if bias is not None:
        base = base + bias.float()
    out = base.to(dtype)
    hidden = product[:, width : width + ranks]
    if split:
        hidden = hidden + product[:, width + ranks :]
    columns: dict[tuple[int, int], torch.Tensor] = {}
    for factor in factors:  # stage order within each module; the modules' columns never overlap
        span = (factor.start, factor.end)
        part = hidden[:, factor.hidden_offset : factor.hidden_offset + factor.up.shape[1]]
        delta = (part[:, None, :] * factor.up).sum(-1) * factor.scaling  # lora_B(.) * scaling
        columns[span] = columns.get(span, out[:, factor.start : factor.end]) + delta  # the promoted add
    out = out.clone()
    for (start, end), column in columns.items():
        out[:, start:end] = column.to(dtype)  # one rounding
    return out


def lora_epilogue(
    product: torch.Tensor, bias: torch.Tensor | None, factors: Sequence[EpilogueFactor], width: int, ranks: int,
    split: bool, dtype: torch.dtype, block_n: int,
) -> torch.Tensor:
    """`epilogue_reference`'s function as the Triton kernel (where `applies`), in column tiles of `block_n`
    (`column_block` of the group's module boundaries)."""
    return torch.ops.prorl_rollout.lora_epilogue(
        product, bias if bias is not None else product.new_empty(0), product.new_empty(0, dtype=dtype),
        [f.up for f in factors], [float(f.scaling) for f in factors], [f.start for f in factors],
        [f.end for f in factors], [f.hidden_offset for f in factors], width, ranks, split, block_n,
    )  # fmt: skip


@torch.library.custom_op("prorl_rollout::lora_epilogue", mutates_args=())
def _lora_epilogue_op(
    product: torch.Tensor, bias: torch.Tensor, like: torch.Tensor, ups: list[torch.Tensor], scalings: list[float],
    starts: list[int], ends: list[int], hidden_offsets: list[int], width: int, ranks: int, split: bool, block_n: int,
) -> torch.Tensor:
    """Opaque to torch.compile; its launch is recorded into the CUDA graph like any other kernel. An empty `bias`:
    none; `like`: an empty tensor of the output dtype."""
    from . import fused_mlp
    from .lora_epilogue_triton import launch_epilogue

    return launch_epilogue(
        product, bias if bias.numel() else None, list(ups), list(scalings), list(zip(starts, ends, hidden_offsets)),
        width, ranks, split, like.dtype, power_of_two(product.shape[0], 16, 64), block_n,
        precision=fused_mlp.lora_precision(like.dtype),
    )  # fmt: skip


@_lora_epilogue_op.register_fake
def _(product, bias, like, ups, scalings, starts, ends, hidden_offsets, width, ranks, split, block_n):
    return product.new_empty(product.shape[0], width, dtype=like.dtype)
