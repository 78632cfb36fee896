"""One-token grouped-query attention over a static KV cache, reading only the live part of the cache.

Layout: the cache of one layer is `(batch, kv_heads, cache_len, head_dim)`; row `b` holds left-padded prompt keys from
column `start[b]` and decode keys up to column `end` (inclusive, shared by all rows, a device scalar). Each query head
`h` attends on key/value head `h // groups`, as transformers' `repeat_kv` does, without copying the cache per head.

On CUDA with Triton, `gqa_decode_attention` runs a split-K ("flash decoding") kernel: programs over (row, kv head,
cache split) skip splits beyond `end` at run time, so the cost follows the live length while every shape stays fixed
(one CUDA graph per generation shape), and the last split to finish merges them. Elsewhere (CPU, other head sizes) it
runs `gqa_decode_attention_reference`: the same function in plain torch over the whole cache with a mask.
"""

from __future__ import annotations

import importlib.util
import math

import torch

BLOCK_N = 64  # keys per inner iteration of the split kernel
TARGET_PROGRAMS = 512  # programs per launch the split count aims at (about 4 per H100/H200 SM)
NUM_WARPS = 4
# Splits over equal shares of each row's live keys instead of fixed column ranges (`decode_attention_triton`). On: at
# 32 rows x a 4,352-column cache on an H200, 14.0 -> 9.3 us a layer with 200 keys live, 18.7 -> 15.2 with 2,000, equal
# at 4,096 (benchmarks/results/rollout_engine.md, section 2026-11-26 from 21:19 UTC, commit 1c1b24d). False only for
# the A/B (generation.py's `rollout_engine_fixed_splits`). Read at each launch, so part of the engine's capture key.
LIVE_SPLITS = True


def gqa_decode_attention_reference(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`(batch, heads, head_dim)` attention output of one query token per row, in float32 math, in `query`'s dtype."""
    batch, kv_heads, cache_len, head_dim = key_cache.shape
    grouped = query.reshape(batch, kv_heads, -1, head_dim).float()
    scores = torch.matmul(grouped, key_cache.float().transpose(-1, -2)) * scale  # (batch, kv_heads, groups, cache)
    columns = torch.arange(cache_len, device=key_cache.device)
    valid = (columns[None, :] >= start[:, None]) & (columns[None, :] <= end)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    output = torch.matmul(torch.softmax(scores, dim=-1), value_cache.float())
    return output.reshape(batch, -1, head_dim).to(query.dtype)


_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether Triton is installed (looked up once, at import). A plain function over a module constant: the sampler
    calls it inside the compiled decode step, where Dynamo warns on `functools.cache`-wrapped functions."""
    return _TRITON_AVAILABLE


def kernel_supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the Triton kernel handles these tensors (CUDA, power-of-two head size 16..256, float dtypes)."""
    head_dim = key_cache.shape[-1]
    return (
        key_cache.is_cuda
        and triton_available()
        and head_dim in (16, 32, 64, 128, 256)
        and key_cache.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and query.dtype == key_cache.dtype
    )


def split_size(batch: int, kv_heads: int, cache_len: int, target: int | None = None, block: int | None = None) -> int:
    """Keys per split: enough splits for about `target` (default `TARGET_PROGRAMS`) programs, a multiple of `block`
    (default `BLOCK_N`)."""
    target, block = target or TARGET_PROGRAMS, block or BLOCK_N
    splits = max(1, min(64, math.ceil(target / (batch * kv_heads))))
    return max(block, math.ceil(cache_len / splits / block) * block)


def gqa_decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`(batch, heads, head_dim)`: the Triton split kernel where it applies, else the reference (same function)."""
    if kernel_supports(query, key_cache):
        return torch.ops.prorl_rollout.gqa_decode_attention(query, key_cache, value_cache, start, end, scale)
    return gqa_decode_attention_reference(query, key_cache, value_cache, start, end, scale)


@torch.library.custom_op("prorl_rollout::gqa_decode_attention", mutates_args=())
def _gqa_decode_attention_op(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Opaque to torch.compile (a fallback call); its kernels are recorded into the CUDA graph like any other."""
    from .decode_attention_triton import launch_gqa_decode

    batch, kv_heads, cache_len, head_dim = key_cache.shape
    split = split_size(batch, kv_heads, cache_len)
    return launch_gqa_decode(query, key_cache, value_cache, start, end, scale, split, BLOCK_N, LIVE_SPLITS, NUM_WARPS)


@_gqa_decode_attention_op.register_fake
def _(query, key_cache, value_cache, start, end, scale):
    batch, _, _, head_dim = key_cache.shape
    return query.new_empty(batch, query.numel() // (batch * head_dim), head_dim)
