"""Decode-step projections: PEFT's unmerged LoRA `Linear` written as reductions that `torch.compile` fuses (issue 14).

Why: called as modules, PEFT's LoRA products are fp32 `lora_A` / `lora_B` GEMMs; at decode shapes (batch rows x rank)
each is a cuBLAS/cutlass kernel plus a split-K reduction, 4 kernels per adapted projection per step (0.49 ms of a
2.84 ms step at 32 rows with r32 on q,k: benchmarks/results/rollout_engine.md). Written as broadcast-multiply-and-sum,
inductor emits one Triton reduction per product instead, and projections that read the same input (q/k/v after the
input norm, gate/up after the post-attention norm) share one A reduction over their concatenated A weights. The
`torch.cat` is part of the traced function (inductor fuses it into the reduction's loads): no stacked copy is kept,
so a CUDA graph reads the live parameters and in-place optimizer steps stay visible without a recapture.

The function is PEFT 0.21's `lora.Linear.forward` for one unmerged adapter, operation for operation: the base layer's
output, the input cast to the adapter's dtype, `B(A(x)) * scaling` in that dtype, added to the base output (so in the
promoted dtype), cast back to the base output's dtype. Only the summation order inside the two products differs from
cuBLAS (fp32 rounding; no TF32). `lora_factors` takes this path only where that is the layer's whole function; any
other layer (DoRA and other variants, several active adapters, merged or disabled adapters, bias, train-mode dropout,
autocast) is called as a module. What it reads is covered by the engine's `model_fingerprint` (a change recaptures;
dynamo's guards recompile). Uncompiled (CPU tests, a failed compile) the products materialise
`rows x rank x features` temporaries: small at decode sizes. Where gate/up carry adapters, the MLP's first half is
`fused_mlp`'s one kernel instead (gate/up GEMMs, their B products and SiLU(gate) * up in one pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import fused_mlp
from .fused_weights import FusedLinear

FUSE_LORA = True  # False: every projection is called as a module (tests, A/B benchmarks); read when a step is traced


class LoraFactors(NamedTuple):
    """The active adapter of a PEFT LoRA `Linear`: its live weights (never copies) and scale."""

    down: torch.Tensor  # lora_A.weight (rank, in_features)
    up: torch.Tensor  # lora_B.weight (out_features, rank)
    scaling: float


def is_peft_lora_linear(module: torch.nn.Module) -> bool:
    """Exactly PEFT's `lora.Linear` (its subclasses and the quantized LoRA layers have forwards of their own)."""
    cls = type(module)
    return cls.__module__ == "peft.tuners.lora.layer" and cls.__qualname__ == "Linear"


def _is_identity_dropout(dropout: torch.nn.Module) -> bool:
    if type(dropout) is torch.nn.Identity:
        return True
    return type(dropout) is torch.nn.Dropout and (dropout.p == 0 or not dropout.training)


def lora_factors(module: torch.nn.Module, x: torch.Tensor) -> LoraFactors | None:
    """The factors when `module(x)` is exactly `base_layer(x) + B(A(x)) * scaling` (PEFT 0.21 `lora.Linear.forward`,
    one unmerged adapter); None when it may be anything else (the caller calls the module)."""
    if not FUSE_LORA or not is_peft_lora_linear(module) or module.disable_adapters or module.merged:
        return None
    adapters = [name for name in module.active_adapters if name in module.lora_A]  # PEFT skips the others
    if len(adapters) != 1:
        return None
    name = adapters[0]
    down, up = module.lora_A[name], module.lora_B[name]
    if name in getattr(module, "lora_variant", {}) or module.use_dora.get(name) or module.lora_bias.get(name):
        return None
    if any(type(factor) is not torch.nn.Linear or factor.bias is not None for factor in (down, up)):
        return None
    if type(module.base_layer) is not torch.nn.Linear or module.fan_in_fan_out:
        return None
    if not _is_identity_dropout(module.lora_dropout[name]):
        return None
    if x.dtype != down.weight.dtype and not getattr(module, "cast_input_dtype_enabled", True):
        return None  # PEFT would run A on the uncast input
    if torch.is_autocast_enabled(x.device.type):
        return None  # autocast runs PEFT's products in its own dtype
    return LoraFactors(down.weight, up.weight, module.scaling[name])


def base_linear(module: torch.nn.Module) -> torch.nn.Module:
    """The layer that computes a projection's base output: a PEFT LoRA `Linear`'s `base_layer`, else the module."""
    return module.base_layer if is_peft_lora_linear(module) else module


def _adapted(x: torch.Tensor, factors: Sequence[LoraFactors], bases: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """PEFT's output for each module from its base output: the A products of all of them at once (`_lora_hidden`),
    then per module the B product, one reduction with the scaling, the base output's addition and the cast fused.
    (Laid out weight-major instead, `(weight rows, batch rows)`, inductor's kernels were slower: 2.02 -> 2.09 ms a
    step at 32 x 4,096 and 4.47 -> 5.73 at 64 x 6,144 with r64 all-linear on an H100,
    benchmarks/results/rollout_engine.md; so were these products as a tiled Triton GEMM that reads each adapter once:
    9.1 -> 16.8 us a layer at 32 rows, 74.9 -> 118 at the reset-4 shape on an H200, fifth session.)"""
    hidden = _lora_hidden(x.reshape(-1, x.shape[-1]), factors)
    outputs = []
    for factor, base, part in zip(factors, bases, _per_module(hidden, factors), strict=True):
        delta = (part[:, None, :] * factor.up).sum(-1) * factor.scaling  # lora_B(.) * scaling
        outputs.append((base + delta.view(base.shape)).to(base.dtype))  # added in the promoted dtype, as PEFT does
    return outputs


def _per_module(hidden: torch.Tensor, factors: Sequence[LoraFactors]) -> tuple[torch.Tensor, ...]:
    """`_lora_hidden`'s columns split back into each module's `lora_A(x)` (views)."""
    return hidden.split([factor.down.shape[0] for factor in factors], dim=-1)


def _lora_hidden(rows: torch.Tensor, factors: Sequence[LoraFactors]) -> torch.Tensor:
    """Every `lora_A(x)` side by side, `(rows, sum of ranks)` in the adapters' dtype: one reduction over the
    concatenated A weights (the `torch.cat` fused into its loads)."""
    down = torch.cat([factor.down for factor in factors])  # (sum of ranks, in_features)
    return (rows.to(factors[0].down.dtype)[:, None, :] * down).sum(-1)


def project(
    x: torch.Tensor, modules: Sequence[torch.nn.Module], fused: FusedLinear | None = None
) -> list[torch.Tensor]:
    """`[module(x) for module in modules]`, with the LoRA products of the PEFT layers among them fused (same dtype:
    one group; projections whose adapter `lora_factors` refuses are called as modules). `fused`: the modules' base
    layers stored as one (`fused_weights`), used when every module is a plain `Linear` or takes the fused LoRA path."""
    factors = [lora_factors(module, x) for module in modules]
    whole = [factor is not None or type(module) is torch.nn.Linear for module, factor in zip(modules, factors)]
    if fused is not None and all(whole) and fused.members == tuple(base_linear(module) for module in modules):
        bases = fused(x)
    else:
        bases = [None if factor is None else module.base_layer(x) for module, factor in zip(modules, factors)]
    outputs: list[torch.Tensor | None] = []
    for module, factor, base in zip(modules, factors, bases, strict=True):
        if factor is not None:
            outputs.append(None)  # PEFT's function, from the LoRA groups below
        else:
            outputs.append(module(x) if base is None else base)  # a plain Linear's may come from `fused`
    groups: dict[tuple, list[int]] = {}  # fused together: same adapter dtype and same base output dtype
    for index, (module, factor) in enumerate(zip(modules, factors)):
        if factor is not None:
            groups.setdefault((factor.down.dtype, module.base_layer.weight.dtype), []).append(index)
    for members in groups.values():
        adapted = _adapted(x, [factors[i] for i in members], [bases[i] for i in members])
        for index, output in zip(members, adapted, strict=True):
            outputs[index] = output
    return outputs


def gated_mlp(mlp: torch.nn.Module, x: torch.Tensor, fused: FusedLinear | None = None) -> torch.Tensor:
    """The Llama/Qwen MLP's forward, `down(act(gate(x)) * up(x))`, with gate and up projected together (`fused`: their
    base layers stored as one; where gate/up carry adapters, the whole first half `fused_mlp`'s one kernel); an MLP
    without that layout is called as a module."""
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return mlp(x)
    activated = _fused_gated_activation(mlp, x, fused)
    if activated is None:
        gate, up = project(x, (mlp.gate_proj, mlp.up_proj), fused)
        activated = mlp.act_fn(gate) * up
    return project(activated, (mlp.down_proj,))[0]


def _fused_gated_activation(mlp: torch.nn.Module, x: torch.Tensor, fused: FusedLinear | None) -> torch.Tensor | None:
    """`act_fn(gate(x)) * up(x)` as `fused_mlp.gated_activation` where that is exactly this MLP's function (switched
    on, SiLU, gate/up base weights stored as one without biases, each projection a plain `Linear` or a LoRA layer
    `lora_factors` reproduces with float32 adapters, at least one of them adapted); None otherwise (the caller runs the
    projections). Without adapters the kernel lost to cuBLAS's GEMM + inductor's SiLU * up (14.8 -> 17.5 us a layer at
    32 rows on an H200); with them it won (87.0 -> 60.9 us at the reset-4 shape)."""
    modules = (mlp.gate_proj, mlp.up_proj)
    if not fused_mlp.FUSED_MLP or fused is None or fused.bias is not None or not fused_mlp.is_silu(mlp.act_fn):
        return None
    if fused.members != tuple(base_linear(module) for module in modules) or x.dtype != fused.weight.dtype:
        return None
    factors = [lora_factors(module, x) for module in modules]
    for module, factor in zip(modules, factors, strict=True):
        if factor is None and type(module) is not torch.nn.Linear:
            return None  # a LoRA layer this path cannot reproduce: it is called as a module
        if factor is not None and not (factor.down.dtype == factor.up.dtype == torch.float32):
            return None
    adapted = [factor for factor in factors if factor is not None]
    if not adapted:
        return None
    rows = x.reshape(-1, x.shape[-1])
    per_module = iter(_per_module(_lora_hidden(rows, adapted), adapted))
    deltas = [None if f is None else fused_mlp.LoraDelta(next(per_module), f.up, f.scaling) for f in factors]
    return fused_mlp.gated_activation(rows, fused.weight, *deltas).view(*x.shape[:-1], -1)
