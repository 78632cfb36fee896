"""LoRA products of a decode step as small GEMMs that read each adapter once (issue 14, many rows).

Why: `lora_decode` writes PEFT's products as broadcast-multiply-and-sum, which inductor turns into one reduction per
output element group, and every row's program reads the whole adapter again (from L2). At 32 rows with r32 on q,k
that is cheap; at the seed's reset-4 shape (64 rows, r64 on all seven linear layers) those re-reads take ~1.6 of a
3.66 ms step on an H100 (the gate/up B products alone 592 us: 64 reads of 1.2 MB each, per layer;
benchmarks/results/rollout_engine.md). `lora_product` computes the same product tiled over rows, in IEEE float32
(`lora_gemm_triton`), with PEFT's scaling, base addition and cast fused into its store.

Off until measured: `MIN_ROWS` None keeps the reductions everywhere; a number sends products of at least that many
rows to the kernel (`benchmarks/generation.py`'s `rollout_engine_lora_gemm` sets it, for the A/B). Read when a step
is traced, and part of the engine's capture key.
"""

from __future__ import annotations

import math

import torch

from .decode_attention import triton_available

MIN_ROWS: int | None = None  # products of at least this many rows go to the kernel; None: never
# Tiling, also `skinny_gemm`'s (not yet tuned on a GPU: benchmarks/decode_kernels.py sweeps these; read at each
# launch, so at capture): outputs per tile, programs per launch that splitting K aims at (2 per H100/H200 SM), and the
# fewest 64-wide K slices a split sums (the last split to arrive reads every split's partial tile, so many thin splits
# make its merge the long pole).
BLOCK_N = 32
TARGET_PROGRAMS = 264
MIN_SLICES_PER_SPLIT = 2


def applies(rows: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `lora_decode` sends these products to `lora_product`: switched on for this many rows, float32 factors
    (PEFT's default for 16-bit bases; the kernel multiplies in IEEE float32), a float input. (Off CUDA or without
    Triton `lora_product` is its torch reference: CPU tests run the path that way.)"""
    return (
        MIN_ROWS is not None
        and rows.shape[0] >= MIN_ROWS
        and rows.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and all(weight.dtype == torch.float32 and weight.device == rows.device for weight in weights)
    )


def power_of_two(value: int, low: int, high: int) -> int:
    """The smallest power of two >= `value`, clamped to `[low, high]` (a Triton block size)."""
    return max(low, min(high, 1 << max(0, math.ceil(math.log2(max(1, value))))))


def tile_layout(rows: int, outputs: int, depth: int) -> tuple[int, int, int, int]:
    """`(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT)`: row tiles up to 64, `BLOCK_N` outputs a tile, K in slices up to 64 wide,
    and K split (SPLIT columns a program, a multiple of BLOCK_K, at least `MIN_SLICES_PER_SPLIT` slices where K has
    them) until there are about `TARGET_PROGRAMS` programs."""
    block_m = power_of_two(rows, 16, 64)
    block_k = power_of_two(depth, 16, 64)
    tiles = math.ceil(rows / block_m) * math.ceil(outputs / BLOCK_N)
    slices = math.ceil(depth / block_k)
    splits = min(max(1, slices // MIN_SLICES_PER_SPLIT), max(1, math.ceil(TARGET_PROGRAMS / tiles)))
    return block_m, BLOCK_N, block_k, math.ceil(slices / splits) * block_k


def lora_product_reference(
    x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor | None = None, scaling: float = 1.0
) -> torch.Tensor:
    """What the kernel computes, in torch ops: `base + (x @ weight.T) * scaling` in float32, in `base`'s dtype."""
    product = x.to(torch.float32) @ weight.T * scaling
    return product if base is None else (base + product).to(base.dtype)


def lora_product(
    x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor | None = None, scaling: float = 1.0
) -> torch.Tensor:
    """`lora_product_reference`'s function: the kernel on CUDA with Triton, the reference elsewhere."""
    if x.is_cuda and triton_available():
        return torch.ops.prorl_rollout.lora_product(x, weight, base, scaling)
    return lora_product_reference(x, weight, base, scaling)


@torch.library.custom_op("prorl_rollout::lora_product", mutates_args=())
def _lora_product_op(x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Opaque to torch.compile; its launch is recorded into the CUDA graph like any other kernel."""
    from .lora_gemm_triton import launch_lora_product

    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return launch_lora_product(x, weight, base, scaling, tile_layout(x.shape[0], weight.shape[0], x.shape[1]))


@_lora_product_op.register_fake
def _(x, weight, base, scaling):
    dtype = torch.float32 if base is None else base.dtype
    return x.new_empty(x.shape[0], weight.shape[0], dtype=dtype)
