"""The gated MLP's first half of a decode step as one kernel: gate and up GEMMs, their LoRA B products, SiLU(gate) * up.

Why: in the engine's step this is a cuBLAS GEMM over the fused gate/up weights (`fused_weights`), one LoRA B product
per adapted projection (at the seed's reset-4 shape the gate/up B reductions alone took 592 us a step on an H100,
every row re-reading the adapter) and a pointwise SiLU * up kernel: 2-4 launches a layer, each waiting for the last.
`gated_activation` computes the same in one pass over the weights (`fused_mlp_triton`): a program holds a tile of
gate columns and the matching up columns, adds the LoRA deltas from the already computed A products, and writes
`SiLU(gate) * up` for `down_proj`.

The function, operation for operation: gate and up as the base GEMM returns them (its accumulation in float32,
rounded to the weights' dtype), each LoRA delta `(h @ B.T) * scaling` in float32 added in float32 and rounded back
(PEFT's `lora.Linear.forward`), then `SiLU(gate) * up` in float32 rounded once, as inductor fuses the MLP's
`act_fn(gate) * up`. Only summation orders differ from the unfused step.

Measured on an H200 (benchmarks/results/rollout_engine.md, commit 1c1b24d): at the reset-4 shape (64 rows, r64 on all
linear layers) the MLP took 60.9 instead of 87.0 us a layer, and the whole decode loop 13,217 -> 15,192 tokens/s; on
(`FUSED_MLP`) where gate or up carries an adapter (`lora_decode` decides; without one cuBLAS's GEMM was faster). Read
when a step is traced, part of the engine's capture key; the A/B method is `benchmarks/generation.py`'s
`rollout_engine_unfused_mlp`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .decode_attention import triton_available

FUSED_MLP = True  # `lora_decode.gated_mlp` runs its first half as `gated_activation` where that is its function
# The LoRA deltas' float32 products on tensor cores where the model is 16-bit (float32 models keep IEEE float32):
# - "bf16x3": three bf16 products of the operands' high and low bf16 parts (high x high + high x low + low x high,
#   ~16 mantissa bits, far below the 16-bit rounding the sum then goes through);
# - "tf32x3": three TF32 products (~21 mantissa bits); at 64 rows with r64 adapters on gate and up the IEEE products
#   had been 22 of the kernel's 29 us a layer on an H200 (7.4 us without adapters; benchmarks/results/
#   rollout_engine.md, section 2026-11-29), TF32 x 3 13 us;
# - "ieee": float32 on CUDA cores.
# Why bf16: float32 operands go through TF32 conversions and layout changes that made small tiles' products slow
# (the A products at 64 rows: 8.6-9.6 us a layer as TF32 x 3, 4.1-4.7 as two bf16 products; section 2026-11-30 from
# 06:58 UTC). `lora_epilogue`'s kernel follows the same switch. Read at each launch, part of the engine's capture
# key; the A/B methods are `benchmarks/generation.py`'s `rollout_engine_tf32x3_lora` and `rollout_engine_ieee_mlp_lora`.
LORA_PRECISION = "bf16x3"
LORA_PRECISIONS = ("bf16x3", "tf32x3", "ieee")


def lora_precision(dtype: torch.dtype) -> str:
    """The LoRA deltas' product precision for a model of `dtype` (`LORA_PRECISION`; IEEE for float32 models)."""
    if LORA_PRECISION not in LORA_PRECISIONS:
        raise ValueError(f"fused_mlp.LORA_PRECISION {LORA_PRECISION!r} is none of {LORA_PRECISIONS}")
    return "ieee" if dtype == torch.float32 else LORA_PRECISION


class LoraDelta(NamedTuple):
    """A LoRA layer's B side for one step: the A product `hidden (rows, rank)` float32, `up (out, rank)`, scaling."""

    hidden: torch.Tensor
    up: torch.Tensor
    scaling: float


def is_silu(module: torch.nn.Module) -> bool:
    """`torch.nn.SiLU` or transformers' `SiLUActivation` (both exactly `F.silu`)."""
    return type(module) is torch.nn.SiLU or (
        type(module).__name__ == "SiLUActivation" and type(module).__module__ == "transformers.activations"
    )


def gated_activation_reference(
    x: torch.Tensor, weight: torch.Tensor, gate: LoraDelta | None = None, up: LoraDelta | None = None
) -> torch.Tensor:
    """`(rows, intermediate)`: `SiLU(gate(x)) * up(x)` from the fused `weight (2 x intermediate, in)` (gate rows first),
    in torch ops (the CPU path and the kernel's reference)."""
    intermediate = weight.shape[0] // 2
    both = torch.nn.functional.linear(x, weight)  # the base GEMM's output, in the weights' dtype
    outputs = []
    for base, delta in ((both[:, :intermediate], gate), (both[:, intermediate:], up)):
        if delta is not None:
            base = (base + (delta.hidden @ delta.up.T) * delta.scaling).to(base.dtype)  # PEFT: promoted add, cast
        outputs.append(base.float())
    return (torch.nn.functional.silu(outputs[0]) * outputs[1]).to(x.dtype)


def gated_activation(
    x: torch.Tensor, weight: torch.Tensor, gate: LoraDelta | None = None, up: LoraDelta | None = None
) -> torch.Tensor:
    """`gated_activation_reference`'s function: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and triton_available():
        empty = x.new_empty(0, dtype=torch.float32)
        return torch.ops.prorl_rollout.gated_activation(
            x, weight,
            gate.hidden if gate else empty, gate.up if gate else empty, gate.scaling if gate else 0.0,
            up.hidden if up else empty, up.up if up else empty, up.scaling if up else 0.0,
        )  # fmt: skip
    return gated_activation_reference(x, weight, gate, up)


def power_of_two(n: int, low: int, high: int) -> int:
    """The smallest power of two >= n, clamped to [low, high] (Triton block sizes)."""
    return min(max(low, 1 << max(n - 1, 0).bit_length()), high)


def tile_layout(rows: int, intermediate: int) -> tuple[int, int]:
    """`(BLOCK_M, BLOCK_N)`: row tiles up to 64; 32 gate (and 32 up) columns a program (152 programs for Qwen2-0.5B's
    4,864, about one per H100/H200 SM)."""
    return power_of_two(rows, 16, 64), 32


@torch.library.custom_op("prorl_rollout::gated_activation", mutates_args=())
def _gated_activation_op(
    x: torch.Tensor, weight: torch.Tensor,
    gate_hidden: torch.Tensor, gate_up: torch.Tensor, gate_scaling: float,
    up_hidden: torch.Tensor, up_up: torch.Tensor, up_scaling: float,
) -> torch.Tensor:  # fmt: skip
    """Opaque to torch.compile; its launch is recorded into the CUDA graph like any other kernel. An empty `*_hidden`
    means that projection has no adapter."""
    from .fused_mlp_triton import launch_gated_activation

    gate = LoraDelta(gate_hidden, gate_up, gate_scaling) if gate_hidden.numel() else None
    up = LoraDelta(up_hidden, up_up, up_scaling) if up_hidden.numel() else None
    return launch_gated_activation(x, weight, gate, up, tile_layout(x.shape[0], weight.shape[0] // 2),
                                   lora_precision=lora_precision(x.dtype))  # fmt: skip


@_gated_activation_op.register_fake
def _(x, weight, gate_hidden, gate_up, gate_scaling, up_hidden, up_up, up_scaling):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)
