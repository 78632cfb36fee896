"""Triton kernel of the sampler's last stage after top-p: the exponential race over the kept tokens in one read.

`sampler.race_tokens` picks, per row, `argmax_i p_i / E_i` over the tokens with `p_i >= tau` (`E_i = -log(u_i)`,
`u_i` the counter-based uniforms of `sampler.uniform_noise`), which draws token i with probability `p_i / sum(kept)`:
the distribution top-p then softmax then `multinomial` draws from. Why a kernel: compiled from torch ops the same
stage was a masked copy of the scores, the noise fused into a chunked argmax and its final pick (43 us of a 1.43 ms
decode step at 32 rows x 151,936 tokens on an H200, the noise's 64-bit hash the largest part); here one launch reads
the probabilities once, hashes 32-bit, and writes one (best key, its token) pair per (row, vocabulary split).

Programs run over (row, split) as in `top_p_triton`; within a program each lane keeps its best key and token with a
strict comparison, so on equal keys the smaller token id wins (as `argmax`'s first maximum), and the block's maximum
is reduced to the smallest token holding it. `sampler.race_tokens` then picks the first split holding the row's
maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import top_p_triton
from .top_p_triton import chunk_for, first_block_ahead, load_block

BLOCK, NUM_WARPS = 1024, 4  # BLOCK divides top_p_triton.CHUNK_ALIGN: a split is whole blocks
# Issue the next block's load before this block's hashing (as `top_p_triton.PREFETCH`). Off: with 5 blocks a program
# it measured 0.5-1.3 us slower a call at 32 x 151,936 on an H100 (benchmarks/results/rollout_engine.md, section
# 2026-11-27 from 01:10 UTC, commit d6ff7ca).
PREFETCH = False
TARGET_PROGRAMS = 1024  # programs per launch: one pass, no per-pass bracket to share, so more than top-p's 512
# `sampler.uniform_noise`'s 32-bit hash constants, as constexprs (a Triton kernel reads no other globals)
WEYL32 = tl.constexpr(0x9E3779B9)
MIX32_MUL1 = tl.constexpr(0x21F0AAAD)
MIX32_MUL2 = tl.constexpr(0x735A2D97)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX32_MUL1
    x = x ^ (x >> 15)
    x = x * MIX32_MUL2
    return x ^ (x >> 15)


@triton.jit
def _race_kernel(
    Probs, Tau, RowKeys, BestKey, BestToken,
    vocab, row_stride,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    tau = tl.load(Tau + row)
    row_key = tl.load(RowKeys + row).to(tl.uint32)
    offsets = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, dtype=tl.float32)
    best_token = tl.zeros([BLOCK], dtype=tl.int32)
    base = Probs + row * row_stride
    ahead = first_block_ahead(base, split * CHUNK, vocab, BLOCK, PREFETCH)
    for first in range(0, CHUNK, BLOCK):
        columns = split * CHUNK + first + offsets
        p, ahead = load_block(base, columns, ahead, first, vocab, CHUNK, BLOCK, PREFETCH)
        hashed = _mix32(columns.to(tl.uint32) * WEYL32 + row_key)  # `sampler.noise_from_keys`, in uint32
        uniform = ((hashed >> 9).to(tl.float32) * 2.0 + 1.0) * 5.9604644775390625e-08  # odd multiples of 2^-24
        key = tl.where((p >= tau) & (p > 0.0), p / -tl.log(uniform), -1.0)
        better = key > best  # strict: a lane's earlier (smaller) token keeps an equal key
        best = tl.where(better, key, best)
        best_token = tl.where(better, columns, best_token)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_token, 2147483647), axis=0)
    tl.store(BestKey + row * SPLITS + split, top)
    tl.store(BestToken + row * SPLITS + split, token)


def splits_for(rows: int, vocab: int) -> int:
    """Vocabulary splits per row for about `TARGET_PROGRAMS` programs (`top_p_triton.splits_for`'s layout)."""
    return top_p_triton.splits_for(rows, vocab, TARGET_PROGRAMS)


def launch_race(probs: torch.Tensor, tau: torch.Tensor, row_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, split) the best key `(rows, splits)` float32 and its token `(rows, splits)` int32.

    `probs` float32 `(rows, vocab)` contiguous in the last dimension, `tau` `(rows, 1)` float32, `row_keys` `(rows,)`
    int64 holding 32-bit values (`sampler.row_keys`).
    """
    rows, vocab = probs.shape
    if probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("the race kernel needs float32 probabilities with a contiguous last dimension.")
    splits = splits_for(rows, vocab)
    chunk = chunk_for(vocab, splits)
    best_key = torch.empty(rows, splits, dtype=torch.float32, device=probs.device)
    best_token = torch.empty(rows, splits, dtype=torch.int32, device=probs.device)
    _race_kernel[(rows, splits)](
        probs, tau.contiguous(), row_keys.contiguous(), best_key, best_token,
        vocab, probs.stride(0),
        SPLITS=splits, CHUNK=chunk, BLOCK=BLOCK, PREFETCH=PREFETCH, num_warps=NUM_WARPS,
    )  # fmt: skip
    return best_key, best_token
