"""Triton kernel of `lora_a_product.a_product` (imported only where Triton is installed).

One program per `(BLOCK_M rows, BLOCK_R ranks)` tile of the `(rows, ranks)` float32 output. It walks the input
features in `BLOCK_K` steps, multiplying its 16-bit rows by the A weights' 16-bit high rows and, where the A weights
were split (`SPLIT`), by their low rows `ranks` further on, on tensor cores into one float32 accumulator: the products
of 16-bit values are exact in float32, so only the summation order differs from the folded GEMM's `high + low`. Each
A element is read once per row tile, where inductor's reduction read it once per row; 16-bit operands keep the
tensor cores' native path (float32 operands as three TF32 products took 8.6-9.6 us a layer at 64 rows on an H200,
16-bit high and low rows 4.1-4.7: benchmarks/results/rollout_engine.md, section 2026-11-30 from 06:58 UTC).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _a_product_kernel(
    X, Rows, Out, M, stride_xm,
    K: tl.constexpr, RANKS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for first in range(0, K, BLOCK_K):
        features = first + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xm + features[None, :],
                    mask=(rows < M)[:, None] & (features < K)[None, :], other=0.0)  # fmt: skip
        a_mask = (ranks < RANKS)[:, None] & (features < K)[None, :]
        high = tl.load(Rows + ranks[:, None] * K + features[None, :], mask=a_mask, other=0.0)
        acc += tl.dot(x, tl.trans(high))
        if SPLIT:
            low = tl.load(Rows + (RANKS + ranks)[:, None] * K + features[None, :], mask=a_mask, other=0.0)
            acc += tl.dot(x, tl.trans(low))
    tl.store(Out + rows[:, None] * RANKS + ranks[None, :], acc, mask=(rows < M)[:, None] & (ranks < RANKS)[None, :])


def launch_a_product(
    x: torch.Tensor, a_rows: torch.Tensor, ranks: int, block_m: int, block_r: int, block_k: int, num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """`x (rows, in_features)` and `a_rows (ranks or 2 x ranks, in_features)` of one 16-bit dtype (the high rows,
    then the low rows where there are twice `ranks`); returns `(rows, ranks)` float32."""
    if x.stride(1) != 1:
        x = x.contiguous()
    a_rows = a_rows.contiguous()
    if a_rows.shape[0] not in (ranks, 2 * ranks) or a_rows.dtype != x.dtype or a_rows.shape[1] != x.shape[1]:
        raise ValueError(
            f"A rows {tuple(a_rows.shape)} {a_rows.dtype} do not fit {ranks} ranks of {tuple(x.shape)} {x.dtype}"
        )
    out = torch.empty(x.shape[0], ranks, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(ranks, block_r))
    _a_product_kernel[grid](
        x, a_rows, out, x.shape[0], x.stride(0), K=x.shape[1], RANKS=ranks, SPLIT=a_rows.shape[0] == 2 * ranks,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return out
