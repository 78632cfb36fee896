"""Triton kernels of the sampler's softmax before top-p: the model's logits (any float dtype) to float32 probabilities.

`sampler.sampling_probabilities` is `softmax(scores_before_top_p(logits))` for sampling without top-k: the logits in
float32, EOS at -inf while fewer than `min_new_tokens` tokens are out, divided by the temperature, then softmax. Why
kernels: compiled from torch ops this was a split max, a per-row sum (32 programs at 32 rows) and the write of the
probabilities, 38 us of a 1.73 ms decode step at 32 rows x 151,936 tokens on an H100, and the decode step's first half
had to hand over float32 logits (another 8 us copy). Here: one launch over (row, vocabulary split) reads the logits
once for the split's running max and sum of exponentials (per lane, rescaled as the max grows), a second combines its
row's partials and writes the split's probabilities, `exp(score - max) / sum` as `torch.softmax` computes them (the
sum in another order: float32 rounding apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import top_p_triton

BLOCK, NUM_WARPS = 1024, 4  # BLOCK divides top_p_triton.CHUNK_ALIGN: a split is whole blocks
TARGET_PROGRAMS = 1024


@triton.jit
def _scores(Logits, Temperature, Eos, TooEarly, columns, vocab, NUM_EOS: tl.constexpr):
    """`scores_before_top_p` for one block of a row (masked columns at -inf)."""
    scores = tl.load(Logits + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)
    if NUM_EOS > 0:
        too_early = tl.load(TooEarly) != 0
        for index in tl.static_range(NUM_EOS):
            scores = tl.where((columns == tl.load(Eos + index)) & too_early, float("-inf"), scores)
    return scores / tl.load(Temperature)


@triton.jit
def _stats_kernel(
    Logits, Temperature, Eos, TooEarly, PartialMax, PartialSum,
    vocab, row_stride,
    NUM_EOS: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    offsets = tl.arange(0, BLOCK)
    running_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(0, CHUNK, BLOCK):
        columns = split * CHUNK + first + offsets
        scores = _scores(Logits + row * row_stride, Temperature, Eos, TooEarly, columns, vocab, NUM_EOS)
        new_max = tl.maximum(running_max, scores)
        finite = new_max > float("-inf")  # a lane with only -inf so far keeps (max -inf, sum 0)
        rescale = tl.where(finite, tl.exp(running_max - new_max), 0.0)
        running_sum = running_sum * rescale + tl.where(finite, tl.exp(scores - new_max), 0.0)
        running_max = new_max
    split_max = tl.max(running_max, axis=0)
    weights = tl.where(running_max > float("-inf"), tl.exp(running_max - split_max), 0.0)
    tl.store(PartialMax + row * SPLITS + split, split_max)
    tl.store(PartialSum + row * SPLITS + split, tl.sum(running_sum * weights, axis=0))


@triton.jit
def _probs_kernel(
    Logits, Temperature, Eos, TooEarly, PartialMax, PartialSum, Probs,
    vocab, row_stride, probs_row_stride,
    NUM_EOS: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    maxima = tl.load(PartialMax + row * SPLITS + splits)
    row_max = tl.max(maxima, axis=0)
    weights = tl.where(maxima > float("-inf"), tl.exp(maxima - row_max), 0.0)
    row_sum = tl.sum(tl.load(PartialSum + row * SPLITS + splits) * weights, axis=0)
    offsets = tl.arange(0, BLOCK)
    for first in range(0, CHUNK, BLOCK):
        columns = split * CHUNK + first + offsets
        scores = _scores(Logits + row * row_stride, Temperature, Eos, TooEarly, columns, vocab, NUM_EOS)
        tl.store(Probs + row * probs_row_stride + columns, tl.exp(scores - row_max) / row_sum, mask=columns < vocab)


def splits_for(rows: int, vocab: int) -> int:
    """Vocabulary splits per row for about `TARGET_PROGRAMS` programs (`top_p_triton.splits_for`'s layout)."""
    return top_p_triton.splits_for(rows, vocab, TARGET_PROGRAMS)


def launch_softmax(
    logits: torch.Tensor, temperature: torch.Tensor, eos: torch.Tensor, too_early: torch.Tensor
) -> torch.Tensor:
    """Float32 `(rows, vocab)` probabilities of `logits / temperature` with the `eos` columns at -inf where `too_early`.

    `logits` any float dtype, contiguous in the last dimension; `temperature` `(1,)` float32; `eos` `(num_eos,)` int64
    (empty: no mask); `too_early` `(1,)` bool.
    """
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("the softmax kernels need logits with a contiguous last dimension.")
    splits = splits_for(rows, vocab)
    chunk = top_p_triton.chunk_for(vocab, splits)
    device = logits.device
    partial_max = torch.empty(rows, splits, dtype=torch.float32, device=device)
    partial_sum = torch.empty(rows, splits, dtype=torch.float32, device=device)
    probs = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    common = {"NUM_EOS": eos.numel(), "SPLITS": splits, "CHUNK": chunk, "BLOCK": BLOCK, "num_warps": NUM_WARPS}
    _stats_kernel[(rows, splits)](
        logits, temperature, eos, too_early, partial_max, partial_sum, vocab, logits.stride(0), **common
    )
    _probs_kernel[(rows, splits)](
        logits, temperature, eos, too_early, partial_max, partial_sum, probs, vocab, logits.stride(0), probs.stride(0),
        **common,
    )  # fmt: skip
    return probs
