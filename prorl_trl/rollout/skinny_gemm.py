"""Base projections of a decode step (a few rows against a 16-bit weight) as one Triton kernel each (issue 14).

Why: at 32 rows cuBLAS runs the step's GEMMs well below the GPU's bandwidth, and splits the long-K `down_proj` into a
GEMM plus a reduction kernel. The third session's profile (one H100, 32 x 4,096, per decode step): gate/up 8.9 us a
layer for 17.4 MB (1.9 TB/s), `down_proj` 6.3 + 1.8 us for 8.7 MB (1.1 TB/s), q/k/v 4.7 us for 2.1 MB, `o_proj` 3.9 us
for 1.6 MB (benchmarks/results/rollout_engine_runs/s3_call2_gen32x4096.json). `linear` runs `lora_gemm_triton`'s
tiled kernel instead: K split across programs where the output is narrow, the split partials merged in-kernel by the
last one to arrive (one launch, deterministic), the bias added in float32 and the sum rounded once, as `F.linear`.

Off until measured (`SKINNY_BASE`): read when a step is traced, part of the engine's capture key; the A/B method is
`benchmarks/generation.py`'s `rollout_engine_skinny`, per-shape timings in `benchmarks/decode_kernels.py`.
"""

from __future__ import annotations

import torch

from .decode_attention import triton_available
from .lora_gemm import tile_layout

SKINNY_BASE = False  # True: decode-step base projections of 16-bit weights run as `linear`'s kernel
MAX_ROWS = 64  # more rows than this: cuBLAS (the kernel's row tile is at most 64 rows)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Switched on, a 16-bit weight with an input of its dtype, few rows (the decode step's shape)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (
        SKINNY_BASE
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and 0 < rows <= MAX_ROWS
        and weight.dim() == 2
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: the kernel where `applies` and Triton runs (CUDA), else `F.linear` itself."""
    if not (applies(x, weight) and x.is_cuda and triton_available()):
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.prorl_rollout.skinny_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("prorl_rollout::skinny_linear", mutates_args=())
def _skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Opaque to torch.compile; its launch is recorded into the CUDA graph like any other kernel."""
    from .lora_gemm_triton import launch_lora_product

    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    layout = tile_layout(x.shape[0], weight.shape[0], x.shape[1])
    return launch_lora_product(x, weight, None, 1.0, layout, bias=bias, out_dtype=weight.dtype)


@_skinny_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=weight.dtype)
