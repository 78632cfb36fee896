"""Triton kernels of `sampler.top_p_threshold` (imported only where Triton is installed).

The search is the one `sampler.top_p_threshold` describes (the smallest float32 bit pattern `t` with
`sum(p_i <= t) > 1 - top_p`, a bracket `[low, high]` shrunk `WAYS`-fold per pass), laid out so that the GPU reads each
probability once per pass: why: the compiled torch version evaluated its `WAYS - 1` candidate sums as separate
reductions, re-reading the `(rows, vocab)` probabilities once per candidate (0.54 ms of a 2.84 ms decode step at 32
rows x 151,936 tokens on an H100).

`_pass_kernel`, one launch per pass over programs (row, vocabulary split): a program first finishes the previous
pass for its row (sums the splits' candidate masses in a fixed order, so every program and every run gets the same
bracket; split 0 records it), then reads its split once and adds, for every candidate at once, the mass at or below
it. A last launch (`FINISH`) turns the final bracket into the threshold, capped by the row's largest probability
(which pass 0 records per split). Sums are float32 as in the torch version, in another order (per-lane sums, then a
tree), so where a token's mass is within float32 rounding of the target the two cuts can differ by that token (as
transformers' own float32 cumsum does against exact arithmetic); no atomics, so every run gives the same cut.

The first bracket starts at `(1 - top_p) / (2 vocab)` rather than 0 (no mass that large lies below it), which at the
recipes' top_p and a 152k vocabulary leaves the last pass nothing to search: a pass that finds the bracket one pattern
wide carries it on and skips its read. Each program issues its next block's load before the current block's sums
(`load_block`, shared with `race_triton`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

FLOAT32_ONE_BITS = 0x3F800000  # bit pattern of 1.0: every probability's pattern lies in [0, this]
WAYS = 16  # candidates per pass (15 inner ones + the bracket's low end)
CHUNK_ALIGN = 1024  # a split's length is a multiple of this (and of BLOCK)
TARGET_PROGRAMS = 512  # programs per pass launch (about 4 per H100/H200 SM)
# 512 probabilities x 16 ways of per-lane sums on 4 warps: 64 registers a thread. Measured on an H100 at 32 x 151,936
# (benchmarks/results/rollout_engine.md, history 2026-11-26; the script was retired at 07e90fc): 146 us a call
# against 164 us for 256 / 4 warps; 8 warps and more splits per row were slower. (The first version summed across lanes inside the loop: 35 us a pass.)
BLOCK, NUM_WARPS = 512, 4
# From this pass on, a block whose probabilities all lie outside the bracket `(low, high]` skips the WAYS-way sums
# (the mass at or below `low` is one sum for every candidate). The bracket is 2^(30 - 4 * pass) bit patterns wide
# (from pass 2, 1/32 of an octave), so most blocks soon lie outside it unless the row is flat. Measured on an H200
# at 32 x 151,936 (benchmarks/results/rollout_engine.md, section 2026-11-26 from 23:04 UTC, commit 22db721): 162 ->
# 139 us a call for Gaussian logits of scale 0.6, 162 -> 119 at scale 3 (peaked, as trained models' rows are),
# 161 -> 180 for exactly uniform rows (every block stays inside). False only for the A/B. Same cut either way; the
# float32 sums' order differs.
SKIP_OUTSIDE = True
SKIP_FROM_PASS = 2
# Each iteration issues the next block's load before this block's sums, so the L2 latency overlaps the arithmetic
# (a program otherwise waits on every load: ~4 programs an SM leave too few warps to hide it).
PREFETCH = True


@triton.jit
def first_block_ahead(base, start, vocab, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """A split's first block, loaded ahead when prefetching (else zeros, unused); then `load_block` per block."""
    columns = start + tl.arange(0, BLOCK)
    if PREFETCH:
        ahead = tl.load(base + columns, mask=columns < vocab, other=0.0)
    else:
        ahead = tl.zeros([BLOCK], dtype=tl.float32)
    return ahead


@triton.jit
def load_block(base, columns, ahead, first, vocab, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """`(this block, the block loaded ahead)`: when prefetching, this block was loaded an iteration earlier and the
    next block's load is issued here, before this block's arithmetic (masked at the split's and the row's end)."""
    if PREFETCH:
        current = ahead
        following = columns + BLOCK
        ahead = tl.load(base + following, mask=(following < vocab) & (first + BLOCK < CHUNK), other=0.0)
    else:
        current = tl.load(base + columns, mask=columns < vocab, other=0.0)
    return current, ahead


def passes_needed(ways: int = WAYS) -> int:
    """Passes until the bracket is one bit pattern wide (8 for 16 ways)."""
    return math.ceil(math.log(FLOAT32_ONE_BITS) / math.log(ways))


@triton.jit
def _pass_kernel(
    Probs, TopP, Bounds, Partial, PartialMax, Tau,
    vocab, row_stride,
    PASS, ROWS: tl.constexpr, FINISH: tl.constexpr, SKIP_OUTSIDE: tl.constexpr, PREFETCH: tl.constexpr,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, WAYS: tl.constexpr, BLOCK: tl.constexpr, ONE_BITS: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    ways = tl.arange(0, WAYS).to(tl.int64)
    target = 1.0 - tl.load(TopP)
    if PASS == 0:
        # No set of `vocab` probabilities at or below target / (2 vocab) holds more than target / 2: the predicate is
        # false there, so the search may start from it (2^27.3 patterns below 1.0 at top_p 0.7 and 151,936 tokens:
        # 7 passes of 16 ways find the cut, and the 8th skips its read)
        floor = tl.maximum(target, 0.0) / (2.0 * vocab)
        low = floor.to(tl.int32, bitcast=True).to(tl.int64)
        high = tl.full([], ONE_BITS, dtype=tl.int64)
    else:
        bounds = Bounds + ((PASS - 1) * ROWS + row) * 2
        previous_low = tl.load(bounds)
        previous_high = tl.load(bounds + 1)
        if previous_high - previous_low <= 1:  # found: the previous pass skipped its sums, carry its bracket
            low = previous_low
            high = previous_high
        else:
            previous = previous_low + ((previous_high - previous_low) * ways) // WAYS
            splits = tl.arange(0, SPLITS)
            partial = Partial + ((PASS - 1) * ROWS + row) * SPLITS * WAYS
            mass = tl.sum(tl.load(partial + splits[:, None] * WAYS + tl.arange(0, WAYS)[None, :]), axis=0)
            above = (mass > target) & (ways > 0)  # way 0 is `low`, where the predicate is false by construction
            high = tl.min(tl.where(above, previous, previous_high), axis=0)
            low = tl.max(tl.where(above, previous_low, previous), axis=0)
    if split == 0:  # the bracket this pass searches (the next pass and FINISH refine it from Partial)
        tl.store(Bounds + (PASS * ROWS + row) * 2, low)
        tl.store(Bounds + (PASS * ROWS + row) * 2 + 1, high)
    if FINISH:
        maxima = tl.load(PartialMax + row * SPLITS + tl.arange(0, SPLITS))
        tau = high.to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(Tau + row, tl.minimum(tau, tl.max(maxima, axis=0)))
    elif high - low > 1:
        candidates = (low + ((high - low) * ways) // WAYS).to(tl.int32)
        low_bits = low.to(tl.int32)
        high_bits = high.to(tl.int32)
        offsets = tl.arange(0, BLOCK)
        sums = tl.zeros([WAYS, BLOCK], dtype=tl.float32)  # per-lane sums: no cross-lane reduction inside the loop
        below = tl.zeros([BLOCK], dtype=tl.float32)  # mass at or below `low`: counts for every candidate
        largest = tl.zeros([BLOCK], dtype=tl.float32)
        base = Probs + row * row_stride
        ahead = first_block_ahead(base, split * CHUNK, vocab, BLOCK, PREFETCH)
        for first in range(0, CHUNK, BLOCK):
            columns = split * CHUNK + first + offsets
            p, ahead = load_block(base, columns, ahead, first, vocab, CHUNK, BLOCK, PREFETCH)
            bits = p.to(tl.int32, bitcast=True)
            below += tl.where(bits <= low_bits, p, 0.0)
            inside = (bits > low_bits) & (bits <= high_bits)  # above `high`: counts for no candidate
            if SKIP_OUTSIDE:
                if tl.max(inside.to(tl.int32), axis=0) > 0:  # most blocks hold no probability inside the bracket
                    sums += tl.where(bits[None, :] <= candidates[:, None], tl.where(inside, p, 0.0)[None, :], 0.0)
            else:
                sums += tl.where(bits[None, :] <= candidates[:, None], tl.where(inside, p, 0.0)[None, :], 0.0)
            largest = tl.maximum(largest, p)  # kept by pass 0 only; cheaper than a branch per iteration
        totals = tl.sum(sums, axis=1) + tl.sum(below, axis=0)
        tl.store(Partial + ((PASS * ROWS + row) * SPLITS + split) * WAYS + tl.arange(0, WAYS), totals)
        tl.store(PartialMax + row * SPLITS + split, tl.max(largest, axis=0), mask=PASS == 0)


def splits_for(rows: int, vocab: int, target_programs: int = TARGET_PROGRAMS) -> int:
    """Vocabulary splits per row: about `target_programs` programs, a power of two, each at least one chunk (also the
    layout of `race_triton` and `softmax_triton`, with their own program targets)."""
    splits = triton.next_power_of_2(max(1, math.ceil(target_programs / rows)))
    return max(1, min(splits, triton.next_power_of_2(triton.cdiv(vocab, CHUNK_ALIGN))))


def chunk_for(vocab: int, splits: int) -> int:
    """Columns per split: an equal share of the vocabulary rounded up to `CHUNK_ALIGN`."""
    return triton.cdiv(triton.cdiv(vocab, splits), CHUNK_ALIGN) * CHUNK_ALIGN


def launch_top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """`(rows, 1)` thresholds for float32 `(rows, vocab)` probabilities and a `(1,)` float32 device `top_p`."""
    rows, vocab = probs.shape
    if probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("top_p_threshold's kernel needs float32 probabilities with a contiguous last dimension.")
    splits = splits or splits_for(rows, vocab)
    chunk = chunk_for(vocab, splits)
    passes = passes_needed()
    device = probs.device
    bounds = torch.empty(passes + 1, rows, 2, dtype=torch.int64, device=device)
    partial = torch.empty(passes, rows, splits, WAYS, dtype=torch.float32, device=device)
    partial_max = torch.empty(rows, splits, dtype=torch.float32, device=device)
    tau = torch.empty(rows, dtype=torch.float32, device=device)
    for index in range(passes + 1):
        finish = index == passes
        _pass_kernel[(rows, 1 if finish else splits)](
            probs, top_p, bounds, partial, partial_max, tau,
            vocab, probs.stride(0),
            index, ROWS=rows, FINISH=finish, SKIP_OUTSIDE=SKIP_OUTSIDE and index >= SKIP_FROM_PASS, PREFETCH=PREFETCH,
            SPLITS=splits, CHUNK=chunk, WAYS=WAYS, BLOCK=BLOCK, ONE_BITS=FLOAT32_ONE_BITS,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return tau[:, None]
