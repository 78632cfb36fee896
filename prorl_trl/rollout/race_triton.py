"""Triton kernels of the sampler's last stage: the exponential race in one read, over the kept tokens after top-p or
over the logits without it.

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

Without top-p (top_p 1.0, the GSM8K recipe's reset-2 to reset-4; no top-k, no min-p) there is no cut to find, so
`_logits_race_kernel` races on the logits themselves: `argmax scores_j - log(E_j)` (`scores`: the logits in float32,
EOS at -inf while too early, divided by the temperature), from the same uniforms: the compiled torch ops' draw
(`sampler.choose_tokens`) in one launch that reads the logits once in their own dtype. It ranks the tokens by that
key times log2(e) less a constant of the row, `logit * log2(e) / T - log2(-log2(u))` (the same order up to float32
rounding; it measured the same 35 us as natural logarithms and a division). Compiled, the torch ops were a
noise-and-argmax kernel over pieces of the row and a second pick: 62-69 us of a 1.74-1.88 ms decode step at the
recipe's reset-4 shape (64 rows x 151,936 tokens) on an H200 (benchmarks/results/rollout_engine.md, section
2026-11-30 from 04:53 UTC).
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
        key = tl.where((p >= tau) & (p > 0.0), p / -tl.log(_uniforms(columns, row_key)), -1.0)
        best, best_token = _keep_better(key, columns, best, best_token)
    _store_best(best, best_token, BestKey + row * SPLITS + split, BestToken + row * SPLITS + split)


@triton.jit
def _uniforms(columns, row_key):
    """`sampler.noise_from_keys` in uint32: odd multiples of 2^-24, never 0 or 1."""
    hashed = _mix32(columns.to(tl.uint32) * WEYL32 + row_key)
    return ((hashed >> 9).to(tl.float32) * 2.0 + 1.0) * 5.9604644775390625e-08


@triton.jit
def _keep_better(key, columns, best, best_token):
    """Each lane's best key and its token; strict, so a lane's earlier (smaller) token keeps an equal key."""
    better = key > best
    return tl.where(better, key, best), tl.where(better, columns, best_token)


@triton.jit
def _store_best(best, best_token, BestKey, BestToken):
    """The block's best key and the smallest token holding it (`argmax`'s first maximum)."""
    top = tl.max(best, axis=0)
    tl.store(BestKey, top)
    tl.store(BestToken, tl.min(tl.where(best == top, best_token, 2147483647), axis=0))


@triton.jit
def _logits_race_kernel(
    Logits, Temperature, Eos, TooEarly, RowKeys, BestKey, BestToken,
    vocab, row_stride,
    NUM_EOS: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_key = tl.load(RowKeys + row).to(tl.uint32)
    # `scores - log(E)` times log2(e), less the row's constant log2(log 2): `logit * log2(e) / T - log2(-log2(u))`,
    # the same order of tokens, in base-2 logarithms (the hardware's) and one multiply instead of a division
    per_logit = 1.4426950408889634 / tl.load(Temperature)
    too_early = tl.load(TooEarly) != 0
    offsets = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_token = tl.zeros([BLOCK], dtype=tl.int32)
    base = Logits + row * row_stride
    for first in range(0, CHUNK, BLOCK):
        columns = split * CHUNK + first + offsets
        logits = tl.load(base + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
        for index in tl.static_range(NUM_EOS):  # EOS at -inf while fewer than min_new_tokens tokens are out
            logits = tl.where((columns == tl.load(Eos + index)) & too_early, float("-inf"), logits)
        key = logits * per_logit - tl.log2(-tl.log2(_uniforms(columns, row_key)))  # -inf for masked columns
        best, best_token = _keep_better(key, columns, best, best_token)
    _store_best(best, best_token, BestKey + row * SPLITS + split, BestToken + row * SPLITS + split)


def splits_for(rows: int, vocab: int) -> int:
    """Vocabulary splits per row for about `TARGET_PROGRAMS` programs (`top_p_triton.splits_for`'s layout)."""
    return top_p_triton.splits_for(rows, vocab, TARGET_PROGRAMS)


def _layout(scores: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(splits, columns a split, best keys `(rows, splits)` float32, their tokens int32) for `(rows, vocab)` scores."""
    rows, vocab = scores.shape
    splits = splits_for(rows, vocab)
    best_key = torch.empty(rows, splits, dtype=torch.float32, device=scores.device)
    return splits, chunk_for(vocab, splits), best_key, torch.empty_like(best_key, dtype=torch.int32)


def launch_race(probs: torch.Tensor, tau: torch.Tensor, row_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, split) the best key `(rows, splits)` float32 and its token `(rows, splits)` int32.

    `probs` float32 `(rows, vocab)` contiguous in the last dimension, `tau` `(rows, 1)` float32, `row_keys` `(rows,)`
    int64 holding 32-bit values (`sampler.row_keys`).
    """
    rows, vocab = probs.shape
    if probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("the race kernel needs float32 probabilities with a contiguous last dimension.")
    splits, chunk, best_key, best_token = _layout(probs)
    _race_kernel[(rows, splits)](
        probs, tau.contiguous(), row_keys.contiguous(), best_key, best_token,
        vocab, probs.stride(0),
        SPLITS=splits, CHUNK=chunk, BLOCK=BLOCK, PREFETCH=PREFETCH, num_warps=NUM_WARPS,
    )  # fmt: skip
    return best_key, best_token


def launch_logits_race(
    logits: torch.Tensor, temperature: torch.Tensor, eos: torch.Tensor, too_early: torch.Tensor, row_keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch_race` without a cut, on the logits: per (row, split) the best `scores - log(E)` `(rows, splits)` float32
    and its token `(rows, splits)` int32.

    `logits` any float dtype `(rows, vocab)`, contiguous in the last dimension; `temperature` `(1,)` float32; `eos`
    `(num_eos,)` int64 (empty: no mask); `too_early` `(1,)` bool; `row_keys` as `launch_race`'s.
    """
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("the race kernel needs logits with a contiguous last dimension.")
    splits, chunk, best_key, best_token = _layout(logits)
    _logits_race_kernel[(rows, splits)](
        logits, temperature, eos, too_early, row_keys.contiguous(), best_key, best_token,
        vocab, logits.stride(0),
        NUM_EOS=eos.numel(), SPLITS=splits, CHUNK=chunk, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return best_key, best_token
