"""Gate/up's LoRA A products in a decode step as one Triton kernel over their folded rows, `lora_A(x)` side by side.

Why: q/k/v's, o's and down's A products fold into their base GEMM as extra rows (`lora_decode.FOLD_LORA_A`), but
gate/up's GEMM is `fused_mlp`'s kernel, whose B products need the whole A product first. `lora_decode._lora_hidden`
wrote them as a broadcast-multiply-and-sum that inductor fused with the residual add and the norm before it: one
reduction per output element, so every row re-read every A weight and every (row, rank) output recomputed its row's
norm. At the GSM8K recipe's reset-4 shape (64 rows, r64 on all linear layers) that kernel took 7.5 us a layer on an
H200, 180 us of a 1.74-1.88 ms decode step (benchmarks/results/rollout_engine.md, section 2026-11-30 from 04:53
UTC). Where `folds` holds, the gate/up stack carries the A weights as extra rows, as the other groups do
(`lora_decode.fold_rows`: the high rows in the weights' 16-bit dtype, then the low rows `A - high`), and `a_product`
multiplies the normed rows by them in one kernel (`lora_a_product_triton`); the norm is inductor's own kernel, once a
row.

The function is `lora_decode._folded`'s A products: the float32 sum of the products with the high and the low rows,
which carries A to about 16 mantissa bits (`fold_rows`); every other folded group's A products are already computed
so. Only the summation order differs (`a_product_reference` is the torch form the tests hold the kernel to). On
(`A_PRODUCT_KERNEL`) where `fused_mlp`'s kernel takes the MLP (CUDA, 16-bit weights, float32 adapters on gate or up,
no frozen parts there); read when the stacks are planned and when a step is traced (part of the engine's capture key);
the A/B method is `benchmarks/generation.py`'s `rollout_engine_a_reductions`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .decode_attention import triton_available
from .fused_mlp import power_of_two

A_PRODUCT_KERNEL = True  # gate/up's A products fold into their stack and run as `a_product` where `folds`
# Tiles: rows a program (up to), ranks a program, input features an inner iteration, warps.
BLOCK_M, BLOCK_R, BLOCK_K, NUM_WARPS = 16, 32, 128, 4


def folds(on_cuda: bool, dtype: torch.dtype, factor_dtypes: Sequence[torch.dtype]) -> bool:
    """Whether a gate/up group whose adapters have `factor_dtypes` on weights of `dtype` folds its A products for the
    kernel: switched on, CUDA with Triton, 16-bit weights, float32 adapters (the caller also checks that
    `fused_mlp`'s kernel takes the MLP)."""
    return (
        A_PRODUCT_KERNEL
        and on_cuda
        and triton_available()
        and dtype in (torch.bfloat16, torch.float16)
        and len(factor_dtypes) > 0
        and all([factor_dtype == torch.float32 for factor_dtype in factor_dtypes])
    )


def a_product_reference(rows: torch.Tensor, a_rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """`(rows, ranks)` float32: `rows @ a_rows.T` accumulated in float32, the high rows' products plus, where `a_rows`
    holds twice `ranks` rows, the low rows' (one float32 add, as `lora_decode._folded` adds them)."""
    product = rows.float() @ a_rows.float().T  # 16-bit products are exact in float32
    return product[:, :ranks] + product[:, ranks:] if a_rows.shape[0] == 2 * ranks else product


def a_product(rows: torch.Tensor, a_rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """`a_product_reference`'s function as the Triton kernel on CUDA, the reference elsewhere."""
    if rows.is_cuda and triton_available():
        return torch.ops.prorl_rollout.lora_a_product(rows, a_rows, ranks)
    return a_product_reference(rows, a_rows, ranks)


@torch.library.custom_op("prorl_rollout::lora_a_product", mutates_args=())
def _a_product_op(rows: torch.Tensor, a_rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """Opaque to torch.compile; its launch is recorded into the CUDA graph like any other kernel."""
    from .lora_a_product_triton import launch_a_product

    return launch_a_product(rows, a_rows, ranks, power_of_two(rows.shape[0], 16, BLOCK_M), BLOCK_R, BLOCK_K, NUM_WARPS)


@_a_product_op.register_fake
def _(rows, a_rows, ranks):
    return rows.new_empty(rows.shape[0], ranks, dtype=torch.float32)
