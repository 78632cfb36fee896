"""Triton kernel of `lora_epilogue.lora_epilogue` (imported only where Triton is installed).

One program per `(BLOCK_M rows, BLOCK_N columns)` tile of the group's `(rows, width)` output; a tile lies inside one
module's columns (the caller picks `BLOCK_N` to divide every module boundary). It loads the folded GEMM's float32
base outputs for its columns, adds the bias in float32 and rounds to the output dtype (what the base GEMM returns),
then for each factor of its module, in stage order, loads the factor's A product from the GEMM's extra columns (the
high part plus, where the A rows were split, the low part), multiplies it by the factor's `up` tile and adds
`product * scaling` in float32; one rounding at the store. Each `up` element is read once per row tile, where
inductor's reduction read it once per row.

The products: `fused_mlp_triton.lora_dot` at `fused_mlp.LORA_PRECISION` for 16-bit outputs (three bf16 tensor-core
products of each operand's high and low parts, or three TF32 products), whose error is far below the 16-bit rounding
the sum then goes through; IEEE float32 on CUDA cores otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_mlp_triton import lora_dot


@triton.jit
def _epilogue_kernel(
    Product, Bias, Out, Ups, scalings, M, stride_pm,
    WIDTH: tl.constexpr, RANKS: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, FACTORS: tl.constexpr,
    STARTS: tl.constexpr, ENDS: tl.constexpr, HIDDEN: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    col0 = tl.program_id(0) * BLOCK_N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    inside = (rows < M)[:, None] & (cols < WIDTH)[None, :]
    base = tl.load(Product + rows[:, None] * stride_pm + cols[None, :], mask=inside, other=0.0)
    if HAS_BIAS:
        base = base + tl.load(Bias + cols, mask=cols < WIDTH, other=0.0).to(tl.float32)[None, :]
    out = base.to(Out.dtype.element_ty).to(tl.float32)  # the base GEMM's output in the weights' dtype
    for index in tl.static_range(FACTORS):  # stage order; each factor adds to its own module's tiles only
        if (col0 >= STARTS[index]) & (col0 < ENDS[index]):
            ranks = tl.arange(0, BLOCK_R[index])
            hidden_mask = (rows < M)[:, None] & (ranks < RANK[index])[None, :]
            hidden_at = Product + rows[:, None] * stride_pm + (WIDTH + HIDDEN[index] + ranks)[None, :]
            hidden = tl.load(hidden_at, mask=hidden_mask, other=0.0)
            if SPLIT:  # the A rows' low parts: lora_A(x) = high + low, one float32 add as lora_decode._folded does
                hidden = hidden + tl.load(hidden_at + RANKS, mask=hidden_mask, other=0.0)
            local = col0 - STARTS[index] + tl.arange(0, BLOCK_N)
            up_mask = (local < ENDS[index] - STARTS[index])[:, None] & (ranks < RANK[index])[None, :]
            up = tl.load(Ups[index] + local[:, None] * RANK[index] + ranks[None, :], mask=up_mask, other=0.0)
            out = out + lora_dot(hidden, tl.trans(up), PRECISION) * scalings[index]
    tl.store(Out + rows[:, None] * WIDTH + cols[None, :], out.to(Out.dtype.element_ty), mask=inside)


def launch_epilogue(
    product: torch.Tensor, bias: torch.Tensor | None, ups: list[torch.Tensor], scalings: list[float],
    spans: list[tuple[int, int, int]], width: int, ranks: int, split: bool, dtype: torch.dtype,
    block_m: int, block_n: int, num_warps: int = 4, precision: str = "bf16x3",
) -> torch.Tensor:
    """`product (rows, width + ranks [x 2 where split])` float32 with unit stride along columns; `ups[i] (end - start,
    rank)` float32 contiguous with `spans[i] = (start, end, hidden offset)` (the module's output columns and the
    factor's first column among the A products), in stage order; `bias (width,)` or None. Returns `(rows, width)` in
    `dtype`. The factors are unrolled into the kernel (`lora_epilogue.MAX_FACTORS` bounds them for the engine)."""
    if product.stride(1) != 1:
        product = product.contiguous()
    rows = product.shape[0]
    out = torch.empty(rows, width, dtype=dtype, device=product.device)
    ups = tuple(up.contiguous() for up in ups)
    ranks_each = tuple(up.shape[1] for up in ups)
    grid = (triton.cdiv(width, block_n), triton.cdiv(rows, block_m))
    _epilogue_kernel[grid](
        product, bias if bias is not None else out, out, ups, tuple(float(s) for s in scalings), rows,
        product.stride(0), WIDTH=width, RANKS=ranks, SPLIT=split, HAS_BIAS=bias is not None, FACTORS=len(ups),
        STARTS=tuple(span[0] for span in spans), ENDS=tuple(span[1] for span in spans),
        HIDDEN=tuple(span[2] for span in spans), RANK=ranks_each,
        BLOCK_R=tuple(max(16, triton.next_power_of_2(rank)) for rank in ranks_each),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision if dtype != torch.float32 else "ieee",
        num_warps=num_warps,
    )  # fmt: skip
    return out
