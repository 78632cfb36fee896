"""Triton kernels of `decode_attention.gqa_decode_attention` (imported only where Triton is installed).

One launch (`_split_kernel`), one program per (row, kv head, split of `split` keys): the group's query heads form the
rows of a `(groups, head_dim) x (head_dim, BLOCK_N)` product, keys outside `[start[row], end]` are masked, and an online
softmax keeps the running max `m`, sum `l` and unnormalised output. A split entirely outside the live range runs no
iteration (its `l` is 0). The last program of a (row, kv head) to finish (an arrival counter, `atomic_add` with
acquire-release ordering after a barrier, so the other splits' stores are visible to it) merges: it rescales each split
by `exp(m_s - max m)` in split order and divides by the merged sum, then sets the counter back to 0 for the next launch
(or graph replay). Which program merges varies; the merge reads every split in the same order, so the result does not.
Why not a second kernel: it was 24 launches of ~3.5 us a decode step (3-4% of the step at 32 rows on an H100).
float32 inputs use IEEE float32 products (no TF32), so tests can compare with the float32 reference; 16-bit inputs
multiply in 16 bits with float32 accumulation, as SDPA kernels do.

`LIVE` (`decode_attention.LIVE_SPLITS`): split `s` covers the `s`-th equal share of the row's live keys (read from
`start`/`end` at run time) instead of columns `[s * SPLIT, (s + 1) * SPLIT)`. Why: the split count is fixed by the
cache length for the graph, so early in a generation only the first splits have live keys (at 32 rows, 8 splits of
544 columns: 64 of 512 programs work while fewer than 544 keys are live); shares keep every program busy at every
length. Same merge, so still deterministic (the sums' order differs from the fixed ranges').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters


@triton.jit
def _split_kernel(
    Q, K, V, Start, End, Acc, M, L, Arrivals, Out,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    scale,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
    LIVE: tl.constexpr,
):
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    row = row_head // KV_HEADS
    head = row_head % KV_HEADS
    start = tl.load(Start + row).to(tl.int32)
    end = tl.load(End).to(tl.int32)
    if LIVE:  # the row's live keys [start, end] in NUM_SPLITS equal chunks (BLOCK multiples): all splits work
        chunk = tl.cdiv(tl.cdiv(end + 1 - start, NUM_SPLITS), BLOCK) * BLOCK
        low = start + split * chunk
        high = tl.minimum(end + 1, low + chunk)
    else:  # fixed SPLIT-wide column ranges: splits past `end` skip their loop
        low = tl.maximum(start, split * SPLIT)
        high = tl.minimum(end + 1, (split + 1) * SPLIT)

    groups = tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK)
    q_rows = (row_head * GROUPS + groups)[:, None] * HEAD_DIM + dims[None, :]
    query = tl.load(Q + q_rows, mask=(groups < GROUPS)[:, None], other=0.0)

    running_max = tl.full([GROUPS_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUPS_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM], dtype=tl.float32)
    k_base = K + row * stride_kb + head * stride_kh
    v_base = V + row * stride_vb + head * stride_vh
    for first in range(low, high, BLOCK):
        columns = first + offsets
        live = columns < high
        keys = tl.load(k_base + columns[:, None] * stride_kn + dims[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(query, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(keys))
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, 1)
        values = tl.load(v_base + columns[:, None] * stride_vn + dims[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            acc = acc * correction[:, None] + tl.dot(weights, values, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(weights.to(values.dtype), values)
        running_max = new_max

    stat_offsets = (row_head * NUM_SPLITS + split) * GROUPS_PAD + groups
    tl.store(M + stat_offsets, running_max)
    tl.store(L + stat_offsets, running_sum)
    tl.store(Acc + stat_offsets[:, None] * HEAD_DIM + dims[None, :], acc)
    tl.debug_barrier()  # every thread's stores precede the release below
    arrived = tl.atomic_add(Arrivals + row_head, 1, sem="acq_rel")
    if arrived == NUM_SPLITS - 1:  # the last split of this (row, kv head): every other split's stats are written
        _merge_splits(Acc, M, L, Out, row_head, GROUPS, GROUPS_PAD, HEAD_DIM, NUM_SPLITS, SPLITS_PAD)
        tl.atomic_xchg(Arrivals + row_head, 0)  # ready for the next launch


@triton.jit
def _merge_splits(
    Acc, M, L, Out, row_head,
    GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Combine the splits of one (row, kv head); loads bypass L1 (`.cg`): other SMs wrote them during this launch."""
    groups = tl.arange(0, GROUPS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, SPLITS_PAD)
    stats = (row_head * NUM_SPLITS + splits)[:, None] * GROUPS_PAD + groups[None, :]
    maxima = tl.load(M + stats, mask=(splits < NUM_SPLITS)[:, None], other=float("-inf"), cache_modifier=".cg")
    overall = tl.max(maxima, 0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)  # padded query rows: no live split
    total = tl.zeros([GROUPS_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        offsets = (row_head * NUM_SPLITS + split) * GROUPS_PAD + groups
        weight = tl.exp(tl.load(M + offsets, cache_modifier=".cg") - overall)  # 0 for an empty split (m = -inf)
        total += weight * tl.load(L + offsets, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(Acc + offsets[:, None] * HEAD_DIM + dims[None, :], cache_modifier=".cg")
    output = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    out_rows = (row_head * GROUPS + groups)[:, None] * HEAD_DIM + dims[None, :]
    tl.store(Out + out_rows, output.to(Out.dtype.element_ty), mask=(groups < GROUPS)[:, None])


def launch_gqa_decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float, split: int, block: int = 64, live_splits: bool = False, num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """The split kernel (merging included); `query` is `(batch, heads, [1,] head_dim)`, caches `(batch, kv_heads, cache_len, head_dim)`;
    `split` keys per program (a multiple of `block`, the keys per inner iteration); `live_splits`: the same number of
    splits, each over an equal share of the row's live keys instead of a fixed column range; `num_stages`: the inner
    loop's software pipelining depth (None: Triton's default)."""
    batch, kv_heads, cache_len, head_dim = key_cache.shape
    heads = query.numel() // (batch * head_dim)
    groups = heads // kv_heads
    groups_pad = max(16, triton.next_power_of_2(groups))
    num_splits = triton.cdiv(cache_len, split)
    query = query.reshape(batch, heads, head_dim).contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("gqa_decode_attention needs caches whose last dimension is contiguous.")
    stats_shape = (batch * kv_heads, num_splits, groups_pad)
    acc = torch.empty(*stats_shape, head_dim, dtype=torch.float32, device=query.device)
    maxima = torch.empty(stats_shape, dtype=torch.float32, device=query.device)
    sums = torch.empty(stats_shape, dtype=torch.float32, device=query.device)
    ieee = query.dtype == torch.float32
    output = torch.empty(batch, heads, head_dim, dtype=query.dtype, device=query.device)
    _split_kernel[(batch * kv_heads, num_splits)](
        query, key_cache, value_cache, start, end, acc, maxima, sums,
        arrival_counters(query.device, batch * kv_heads), output,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        scale,
        KV_HEADS=kv_heads, GROUPS=groups, GROUPS_PAD=groups_pad, HEAD_DIM=head_dim,
        SPLIT=split, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK=block,
        IEEE=ieee, LIVE=live_splits, num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return output
