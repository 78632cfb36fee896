"""Triton kernel of `lora_gemm.lora_product` and `skinny_gemm.linear` (imported only where Triton is installed).

`out = epilogue(x @ weight.T)` for a few rows `x (M, K)` against a float32 LoRA factor `weight (N, K)`, tiled like a
GEMM: a program computes a `(BLOCK_M, BLOCK_N)` tile of the output from a `BLOCK_K`-wide slice of `K` at a time, so
each weight element is read once per launch (per row tile) instead of once per row, as inductor's reductions do. Where
`K` is long and `N` short (the A product of `down_proj`), programs also split `K`; each writes its partial tile and the
last split of a tile to arrive (an arrival counter, acquire-release after a barrier, as `decode_attention_triton`)
sums the partials in split order, so the result does not depend on which program finishes last. The products are
IEEE float32 (no TF32), as PEFT's float32 adapters compute them; only the summation order differs.

The epilogue is PEFT's: `acc * scaling`, then `base + that` in float32 and a cast to `base`'s dtype (the A product:
scaling 1, no base, float32 out). `skinny_gemm` runs the same kernel for 16-bit base projections (tensor cores,
float32 accumulation, `+ bias` in float32, rounded once to the weights' dtype: what cuBLAS's `F.linear` returns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention_triton import arrival_counters


@triton.jit
def _finish(acc, Base, Bias, Out, rows, cols, M, N, stride_bm, stride_bn, scaling,
            HAS_BASE: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    out = acc * scaling
    if HAS_BIAS:
        out += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BASE:
        base = tl.load(Base + rows[:, None] * stride_bm + cols[None, :] * stride_bn, mask=inside, other=0.0)
        out = base.to(tl.float32) + out
    tl.store(Out + rows[:, None] * N + cols[None, :], out.to(Out.dtype.element_ty), mask=inside)


@triton.jit
def _product_kernel(
    X, W, Base, Bias, Partial, Arrivals, Out,
    M, N, stride_xm, stride_wn, stride_bm, stride_bn, scaling,
    K: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BASE: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
):
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, SPLIT, BLOCK_K):
        ks = split * SPLIT + step + offsets
        live = ks < K
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None] & live[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=(cols < N)[:, None] & live[None, :], other=0.0)
        if IEEE:  # float32 weights: IEEE float32 products (the input cast to float32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # 16-bit input and weights: tensor cores, float32 accumulation
            acc += tl.dot(x, tl.trans(w))
    if NUM_SPLITS == 1:
        _finish(acc, Base, Bias, Out, rows, cols, M, N, stride_bm, stride_bn, scaling, HAS_BASE, HAS_BIAS)
    else:
        tile = tile_m * tl.num_programs(1) + tile_n
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(Partial + (tile * NUM_SPLITS + split) * BLOCK_M * BLOCK_N + local, acc)
        tl.debug_barrier()  # every thread's stores precede the release below
        arrived = tl.atomic_add(Arrivals + tile, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:  # the last split of this tile: the others' partials are written
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for other in range(NUM_SPLITS):  # in split order, whoever arrives last
                partial = Partial + (tile * NUM_SPLITS + other) * BLOCK_M * BLOCK_N + local
                total += tl.load(partial, cache_modifier=".cg")  # past L1: other SMs wrote it during this launch
            _finish(total, Base, Bias, Out, rows, cols, M, N, stride_bm, stride_bn, scaling, HAS_BASE, HAS_BIAS)
            tl.atomic_xchg(Arrivals + tile, 0)  # ready for the next launch (or graph replay)


def launch_lora_product(
    x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor | None, scaling: float, layout: tuple[int, int, int, int],
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`x (M, K)` (unit stride along K) times `weight (N, K)` (unit stride along K), then `* scaling`, `+ bias`, PEFT's
    `base (M, N) +` and the cast; `layout` is `(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)` from `lora_gemm.tile_layout`.
    float32 weights multiply in IEEE float32; 16-bit weights (with an input of their dtype) on tensor cores. Output:
    `out_dtype`, else `base`'s dtype, else float32."""
    rows, depth = x.shape
    outputs = weight.shape[0]
    block_m, block_n, block_k, split = layout
    grid = (triton.cdiv(rows, block_m), triton.cdiv(outputs, block_n), triton.cdiv(depth, split))
    tiles = grid[0] * grid[1]
    dtype = out_dtype or (torch.float32 if base is None else base.dtype)
    out = torch.empty(rows, outputs, dtype=dtype, device=x.device)
    partial_size = tiles * grid[2] * block_m * block_n if grid[2] > 1 else 1
    partial = torch.empty(partial_size, dtype=torch.float32, device=x.device)
    _product_kernel[grid](
        x, weight, out if base is None else base, out if bias is None else bias, partial,
        arrival_counters(x.device, tiles), out,
        rows, outputs, x.stride(0), weight.stride(0),
        0 if base is None else base.stride(0), 0 if base is None else base.stride(1), scaling,
        K=depth, SPLIT=split, NUM_SPLITS=grid[2], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BASE=base is not None, HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out
