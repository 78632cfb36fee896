"""Decode-step projections: PEFT's unmerged LoRA `Linear` written as reductions that `torch.compile` fuses (issue 14).

Why: called as modules, PEFT's LoRA products are fp32 `lora_A` / `lora_B` GEMMs; at decode shapes (batch rows x rank)
each is a cuBLAS/cutlass kernel plus a split-K reduction, 4 kernels per adapted projection per step (0.49 ms of a
2.84 ms step at 32 rows with r32 on q,k: benchmarks/results/rollout_engine.md, commit 666882f). Written as
broadcast-multiply-and-sum, inductor emits one Triton reduction per product instead, and projections that read the same
input (q/k/v after the input norm, gate/up after the post-attention norm) share one A reduction over their concatenated
A weights. The `torch.cat` is part of the traced function (inductor fuses it into the reduction's loads): no stacked
copy is kept, so a CUDA graph reads the live parameters and in-place optimizer steps stay visible without a recapture.

The function is PEFT 0.21's `lora.Linear.forward` for one unmerged adapter, operation for operation: the base layer's
output, the input cast to the adapter's dtype, `B(A(x)) * scaling` in that dtype, added to the base output (so in the
promoted dtype), cast back to the base output's dtype. Only the summation order inside the two products differs from
cuBLAS (fp32 rounding; no TF32). `lora_factors` takes this path only where that is the layer's whole function; any
other layer (DoRA and other variants, several active adapters, merged or disabled adapters, bias, train-mode dropout,
autocast) is called as a module. What it reads is covered by the engine's `model_fingerprint` (a change recaptures;
dynamo's guards recompile). Uncompiled (CPU tests, a failed compile) the products materialise
`rows x rank x features` temporaries: small at decode sizes. Where gate/up carry adapters, the MLP's first half is
`fused_mlp`'s one kernel instead (gate/up GEMMs, their B products and SiLU(gate) * up in one pass), fed by
`lora_a_product`'s kernel over gate/up's folded A rows (`mlp_fold_factors`); where a folded
group carries an adapter of rank 64 or more, its B products, additions and rounding are `lora_epilogue`'s one kernel.

Frozen factors of earlier hard resets (`prorl_trl.reset.frozen`) sit in a forward hook of the base layer, which adds
each part's product to the raw base output in float32; PEFT then adds the live adapter and the output is rounded
once. `project` computes the same from the raw base output (a stacked GEMM's, or the base layer's own without its
hook) and the module's stage (`stage_of`: the frozen parts, then the live adapter), and `fold_factors` folds every
part's A weights into the GEMM with the live one's. Gate/up with frozen parts leave `fused_mlp`'s kernel (one adapter
per projection) for `project`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..reset.frozen import REFERENCE, frozen_delta_of
from . import fused_mlp, lora_a_product, lora_epilogue
from .fused_weights import FusedLinear

FUSE_LORA = True  # False: every projection is called as a module (tests, A/B benchmarks); read when a step is traced
# Fold the A products of a group's adapters into its base GEMM (`fold_rows`, `refresh_folded`): copies of the A weights
# ride as extra rows of the fused base weight, so one GEMM gives the base outputs and every `lora_A(x)`, and the A
# reduction kernel goes. False only for the A/B (generation.py's `rollout_engine_unfolded`); read when fusing/tracing.
FOLD_LORA_A = True
# Where a folded group's B products run in `lora_epilogue`'s kernel, each module's frozen parts of earlier resets run
# there as one factor: their `up` weights side by side, each times its scaling in float32 (`refresh_joined`, copied
# into the generation arena before every generation, as the stacked weights are), over their A products, which the
# fold already keeps side by side. The sum is the same to float32 rounding (one product over the parts' ranks instead
# of one per part, each scaling applied to `up` instead of to the product): what `consolidate_frozen_parts` does, for
# generation only, so the training forward keeps one part per reset and its bitwise resets. At the GSM8K recipe's
# reset-4 (four r32 parts on q and k) the q/k/v launch holds 5 factors instead of 11 (benchmarks/results/
# rollout_engine.md, section 2026-11-30 from 04:53 UTC). False only for the A/B (generation.py's
# `rollout_engine_parts_apart`); read when stacking and when a step is traced.
JOIN_FROZEN = True


class LoraFactors(NamedTuple):
    """The active adapter of a PEFT LoRA `Linear` (or a base layer's frozen factors): its live weights (never copies)
    and scale."""

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


def frozen_factors(module: torch.nn.Module) -> list[LoraFactors]:
    """The frozen parts of earlier hard resets on the module's base layer (`prorl_trl.reset.frozen`), in the order its
    forward hook adds them, before the live adapter; empty without any, or with a frozen LoRA bias, which only the hook
    reproduces (`_reproducible` then keeps the module out of this path)."""
    frozen = frozen_delta_of(base_linear(module))
    if frozen is None or frozen.bias is not None or frozen.acts_in == REFERENCE:
        return []  # a reference-only part (a reference reset that kept the adapter) is not the policy's
    return [LoraFactors(down, up, scaling) for down, up, scaling in frozen.parts]


def _reproducible(module: torch.nn.Module) -> bool:
    """Whether a raw base output plus `frozen_factors` is the base layer's output (no frozen bias)."""
    frozen = frozen_delta_of(base_linear(module))
    return frozen is None or frozen.bias is None or frozen.acts_in == REFERENCE


def stage_of(module: torch.nn.Module, live: LoraFactors | None) -> list[LoraFactors]:
    """Everything added to the module's raw base output before its one rounding: the frozen parts, then the live
    adapter `live` (`lora_factors`)."""
    return frozen_factors(module) + ([] if live is None else [live])


def base_linear(module: torch.nn.Module) -> torch.nn.Module:
    """The layer that computes a projection's base output: a PEFT LoRA `Linear`'s `base_layer`, else the module."""
    return module.base_layer if is_peft_lora_linear(module) else module


def _apply_stages(
    x: torch.Tensor,
    bases: Sequence[torch.Tensor],
    stages: Sequence[Sequence[LoraFactors]],
    hidden: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each module's output from its raw base output and its stage (`stage_of`: frozen parts, then the live adapter):
    the A products of all of them at once (`_lora_hidden`), then per factor the B product, one reduction with the
    scaling, added one after the other in the promoted dtype, and the one cast back, as PEFT (and the frozen parts'
    hook) compute them; a module with an empty stage keeps its base output. (Laid out weight-major instead,
    `(weight rows, batch rows)`, inductor's kernels were slower: 2.02 -> 2.09 ms a step at 32 x 4,096 and 4.51 ->
    5.77 at 64 x 6,144 with r64 all-linear on an H100, benchmarks/results/rollout_engine.md, commit 88e3468; so
    were these products as a tiled Triton GEMM that reads each adapter once: 9.1 -> 16.8 us a layer at 32 rows,
    74.9 -> 118 at the reset-4 shape on an H200, commit 1c1b24d, with IEEE float32 products; `lora_epilogue`'s
    kernel, TF32 x 3 after the folded A products, wins for r64 adapters.) `hidden`: the A products already computed
    (`_folded`)."""
    factors = [factor for stage in stages for factor in stage]
    if not factors:
        return list(bases)
    if hidden is None:
        hidden = _lora_hidden(x.reshape(-1, x.shape[-1]), factors)
    parts = iter(_per_module(hidden, factors))
    outputs = []
    for base, stage in zip(bases, stages, strict=True):
        output = base
        for factor in stage:
            delta = (next(parts)[:, None, :] * factor.up).sum(-1) * factor.scaling  # lora_B(.) * scaling
            output = output + delta.view(base.shape)  # added in the promoted dtype, as PEFT does
        outputs.append(output.to(base.dtype) if stage else base)
    return outputs


def _per_module(hidden: torch.Tensor, factors: Sequence[LoraFactors]) -> tuple[torch.Tensor, ...]:
    """`_lora_hidden`'s columns split back into each module's `lora_A(x)` (views)."""
    return hidden.split([factor.down.shape[0] for factor in factors], dim=-1)


def _lora_hidden(rows: torch.Tensor, factors: Sequence[LoraFactors]) -> torch.Tensor:
    """Every `lora_A(x)` side by side, `(rows, sum of ranks)` in the adapters' dtype: one reduction over the
    concatenated A weights (the `torch.cat` fused into its loads)."""
    down = torch.cat([factor.down for factor in factors])  # (sum of ranks, in_features)
    return (rows.to(factors[0].down.dtype)[:, None, :] * down).sum(-1)


def fold_factors(modules: Sequence[torch.nn.Module]) -> list[LoraFactors]:
    """The factors whose A products fold into the modules' base GEMM, module by module in `stage_of` order (frozen
    parts, then the live adapter; `_folded` reads them back so); empty where there is no fold: only where `project`
    would take the fused LoRA path for every adapted module (one factor dtype, the rest plain `Linear`s)."""
    if not FOLD_LORA_A or not modules:
        return []
    base_weight = base_linear(modules[0]).weight
    probe = torch.empty(0, dtype=base_weight.dtype, device=base_weight.device)
    factors = [lora_factors(module, probe) for module in modules]
    if any(factor is None and type(module) is not torch.nn.Linear for module, factor in zip(modules, factors)):
        return []
    if not all(_reproducible(module) for module in modules):
        return []
    adapted = [factor for module, live in zip(modules, factors) for factor in stage_of(module, live)]
    return adapted if len({(f.down.dtype, f.up.dtype) for f in adapted}) == 1 else []


def mlp_fold_factors(modules: Sequence[torch.nn.Module]) -> list[LoraFactors]:
    """Gate/up's `fold_factors` where `lora_a_product` computes their A products from the folded rows for `fused_mlp`'s
    kernel (`lora_a_product.folds`, that kernel switched on, one adapter per projection: no frozen parts); else
    empty (the A products stay inductor's reduction). An MLP the kernel then declines (another activation) runs
    `project`, whose folded GEMM reads the same rows, as q/k/v's does."""
    if not modules or not fused_mlp.FUSED_MLP:
        return []
    if any(frozen_delta_of(base_linear(module)) is not None for module in modules):
        return []
    adapted = fold_factors(modules)
    weight = base_linear(modules[0]).weight
    return adapted if lora_a_product.folds(weight.is_cuda, weight.dtype, [f.down.dtype for f in adapted]) else []


def fold_rows(adapted: Sequence[LoraFactors], base_dtype: torch.dtype) -> int:
    """Extra rows a base weight of `base_dtype` needs to fold `adapted`'s A products into its GEMM.

    Per adapter, its A weight in the base dtype (rank rows); where the adapters' dtype differs (float32 adapters on
    bf16 weights, PEFT's default), also the remainder `A - that` in the base dtype, so the two rows' sum carries A to
    about 16 bits of mantissa: the GEMM accumulates in float32 and returns float32 (`_folded`), and the folded
    `lora_A(x)` matches PEFT's float32 product to float32 rounding, not bf16's."""
    ranks = sum(factor.down.shape[0] for factor in adapted)
    return ranks * (2 if adapted and adapted[0].down.dtype != base_dtype else 1)


@torch.no_grad()
def refresh_folded(fused: FusedLinear, adapted: Sequence[LoraFactors]) -> None:
    """Copy `adapted`'s current A weights (`fold_factors`) into `fused`'s extra rows (the layout `fold_rows` sized):
    run before every generation, since the optimizer updates A in place and the rows are copies."""
    ranks = sum(factor.down.shape[0] for factor in adapted)
    extra, offset = fused.extra, 0
    for factor in adapted:
        rank = factor.down.shape[0]
        high = extra[offset : offset + rank]
        high.copy_(factor.down)
        if factor.down.dtype != extra.dtype:
            extra[ranks + offset : ranks + offset + rank].copy_(factor.down - high.to(factor.down.dtype))
        offset += rank


def _float32_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` accumulated and returned in float32 (cuBLAS's float32 output on CUDA: no rounding to bf16)."""
    if rows.dtype == torch.float32:
        return rows @ weight.t()
    if rows.is_cuda:
        return torch.mm(rows, weight.t(), out_dtype=torch.float32)
    return rows.float() @ weight.float().t()  # elsewhere: the same products (exact in float32), summed in float32


def _folded(x: torch.Tensor, fused: FusedLinear, stages: Sequence[Sequence[LoraFactors]]) -> list[torch.Tensor] | None:
    """PEFT's outputs of the group from one GEMM over `fused.stacked` (base rows, then the A rows `refresh_folded`
    keeps, in `stages`' order) and the B products (`lora_epilogue`'s kernel where it `applies`, else reductions);
    None where the extra rows do not fit these factors (the caller runs the A reductions instead)."""
    adapted = [factor for stage in stages for factor in stage]
    if not FOLD_LORA_A or not adapted or x.dtype != fused.weight.dtype:
        return None
    if fused.extra_rows != fold_rows(adapted, fused.weight.dtype):
        return None
    ranks = sum(factor.down.shape[0] for factor in adapted)
    split = fused.extra_rows > ranks
    rows = x.reshape(-1, x.shape[-1])
    product = _float32_product(rows, fused.stacked)
    width = fused.weight.shape[0]
    epilogue = _epilogue_factors(fused.sizes, stages)
    block_n = lora_epilogue.column_block(list(itertools.accumulate(fused.sizes)))  # no column tile spans two modules
    takes = block_n and adapted[0].down.dtype == torch.float32
    if takes and lora_epilogue.applies(product, fused.weight.dtype, epilogue):  # the rule reads the parts as they are
        if JOIN_FROZEN and fused.joined_ups:
            epilogue = _epilogue_factors(fused.sizes, stages, fused.joined_ups)
        out = lora_epilogue.lora_epilogue(product, fused.bias, epilogue, width, ranks, split, fused.weight.dtype,
                                          block_n)  # fmt: skip
        return [part.view(*x.shape[:-1], -1) for part in out.split(fused.sizes, dim=-1)]
    base = product[:, :width]
    if fused.bias is not None:
        base = base + fused.bias.float()  # F.linear's epilogue: the bias added in float32, one rounding after
    bases = [part.view(*x.shape[:-1], -1) for part in base.to(fused.weight.dtype).split(fused.sizes, dim=-1)]
    hidden = product[:, width : width + ranks]
    if split:
        hidden = hidden + product[:, width + ranks :]
    return _apply_stages(x, bases, stages, hidden.to(adapted[0].down.dtype))


def _epilogue_factors(
    sizes: Sequence[int], stages: Sequence[Sequence[LoraFactors]], joined_ups: Sequence[torch.Tensor | None] = ()
) -> list[lora_epilogue.EpilogueFactor]:
    """`stages` as `lora_epilogue`'s factors: each with its module's output columns and its first A-product column
    (the fold's order: module by module, stage order within one). `joined_ups`: per module, its frozen parts' `up`
    weights side by side and scaled (`refresh_joined`) or None; where one holds a module's leading factors, they are
    one factor of scaling 1."""
    factors, start, hidden = [], 0, 0
    for index, (size, stage) in enumerate(zip(sizes, stages, strict=True)):
        joined = joined_ups[index] if joined_ups else None
        count = _joined_count(stage, joined)
        if count:
            factors.append(lora_epilogue.EpilogueFactor(joined, 1.0, start, start + size, hidden))
            hidden += joined.shape[1]
        for factor in stage[count:]:
            factors.append(lora_epilogue.EpilogueFactor(factor.up, factor.scaling, start, start + size, hidden))
            hidden += factor.down.shape[0]
        start += size
    return factors


def _joined_count(stage: Sequence[LoraFactors], joined: torch.Tensor | None) -> int:
    """How many of `stage`'s leading factors `joined` holds (their ranks add up to its width; at least two); 0: none."""
    if joined is None:
        return 0
    width = 0
    for count, factor in enumerate(stage, start=1):
        width += factor.down.shape[0]
        if width == joined.shape[1] and joined.shape[0] == factor.up.shape[0]:
            return count if count >= 2 else 0
        if width > joined.shape[1]:
            return 0
    return 0


def frozen_joins(
    modules: Sequence[torch.nn.Module], adapted: Sequence[LoraFactors], sizes: Sequence[int], weight: torch.Tensor
) -> tuple[tuple[LoraFactors, ...], ...]:
    """Per module of a folded group (`adapted`: `fold_factors(modules)`), the frozen parts `_folded` runs as one
    factor (`JOIN_FROZEN`): two or more, where the group's B products will take `lora_epilogue`'s kernel (its rule
    and its conditions as `_folded` checks them, known before any product: switched on, a factor of rank
    `MIN_RANK` or more, CUDA with Triton, 16-bit weights, float32 factors, a column tile); empty tuples elsewhere."""
    ranks = [factor.down.shape[0] for factor in adapted]
    dtypes = [tensor.dtype for factor in adapted for tensor in (factor.down, factor.up)]
    planned = (
        JOIN_FROZEN and lora_epilogue.applies_to(ranks, weight.is_cuda, weight.dtype, dtypes)
        and lora_epilogue.column_block(list(itertools.accumulate(sizes))) is not None
    )
    joins = [tuple(frozen_factors(module)) if planned else () for module in modules]
    return tuple(parts if len(parts) >= 2 else () for parts in joins)


@torch.no_grad()
def refresh_joined(fused: FusedLinear, joins: Sequence[Sequence[LoraFactors]]) -> None:
    """Write each module's frozen parts (`frozen_joins`) into its `fused.joined_ups` buffer: their `up` weights side by
    side, each times its scaling in float32 (before every generation: the buffers live in the generation arena)."""
    for parts, joined in zip(joins, fused.joined_ups, strict=True):
        offset = 0
        for factor in parts:
            rank = factor.up.shape[1]
            torch.mul(factor.up, factor.scaling, out=joined[:, offset : offset + rank])
            offset += rank


def project(
    x: torch.Tensor, modules: Sequence[torch.nn.Module], fused: FusedLinear | None = None
) -> list[torch.Tensor]:
    """`[module(x) for module in modules]`, with the LoRA products of the PEFT layers among them (and the frozen parts
    of earlier resets on their base layers) fused: per module its raw base output plus its stage (`stage_of`), one
    rounding; modules whose adapter `lora_factors` refuses are called as modules. `fused`: the modules' base layers
    stored as one (`fused_weights`), used when every module is a plain `Linear` or takes this path; with extra rows
    sized by `fold_rows`, the A products come from the same GEMM (`_folded`)."""
    factors = [lora_factors(module, x) for module in modules]
    stages = [stage_of(module, live) for module, live in zip(modules, factors)]
    whole = [
        (live is not None or type(module) is torch.nn.Linear)
        and _reproducible(module)
        and len({factor.down.dtype for factor in stage}) <= 1
        for module, live, stage in zip(modules, factors, stages)
    ]
    if fused is not None and all(whole) and fused.members == tuple(base_linear(module) for module in modules):
        folded = _folded(x, fused, stages)
        if folded is not None:
            return folded
        return _stages_by_dtype(x, fused(x), stages)
    # alone: a LoRA layer this path reproduces from its base layer's raw output (the hook bypassed: the stage holds
    # the frozen parts), anything else called as a module (its hooks included)
    alone = [live is not None and reproducible for live, reproducible in zip(factors, whole)]
    bases = [
        torch.nn.functional.linear(x, module.base_layer.weight, module.base_layer.bias) if use else module(x)
        for module, use in zip(modules, alone)
    ]
    return _stages_by_dtype(x, bases, [stage if use else [] for stage, use in zip(stages, alone)])


def _stages_by_dtype(
    x: torch.Tensor, bases: Sequence[torch.Tensor], stages: Sequence[Sequence[LoraFactors]]
) -> list[torch.Tensor]:
    """`_apply_stages` per group of modules whose factors share one dtype (one A reduction per group)."""
    groups: dict[tuple, list[int]] = {}
    for index, stage in enumerate(stages):
        if stage:
            key = tuple(sorted({str(f.down.dtype) for f in stage})) + (str(bases[index].dtype),)
            groups.setdefault(key, []).append(index)
    outputs = list(bases)
    for members in groups.values():
        adapted = _apply_stages(x, [bases[i] for i in members], [stages[i] for i in members])
        for index, output in zip(members, adapted, strict=True):
            outputs[index] = output
    return outputs


def gated_mlp(
    mlp: torch.nn.Module, x: torch.Tensor, fused: FusedLinear | None = None, fused_down: FusedLinear | None = None
) -> torch.Tensor:
    """The Llama/Qwen MLP's forward, `down(act(gate(x)) * up(x))`, with gate and up projected together (`fused`: their
    base layers stored as one; where gate/up carry adapters, the whole first half `fused_mlp`'s one kernel); an MLP
    without that layout is called as a module. `fused_down`: down's base weight with folded A rows (`fold_rows`)."""
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return mlp(x)
    activated = _fused_gated_activation(mlp, x, fused)
    if activated is None:
        gate, up = project(x, (mlp.gate_proj, mlp.up_proj), fused)
        activated = mlp.act_fn(gate) * up
    return project(activated, (mlp.down_proj,), fused_down)[0]


def _fused_gated_activation(mlp: torch.nn.Module, x: torch.Tensor, fused: FusedLinear | None) -> torch.Tensor | None:
    """`act_fn(gate(x)) * up(x)` as `fused_mlp.gated_activation` where that is exactly this MLP's function (switched
    on, SiLU, gate/up base weights stored as one without biases, each projection a plain `Linear` or a LoRA layer
    `lora_factors` reproduces with float32 adapters, at least one of them adapted); None otherwise (the caller runs the
    projections). Without adapters the kernel lost to cuBLAS's GEMM + inductor's SiLU * up (14.8 -> 17.5 us a layer at
    32 rows on an H200); with them it won (87.0 -> 60.9 us at the reset-4 shape)."""
    modules = (mlp.gate_proj, mlp.up_proj)
    if not fused_mlp.FUSED_MLP or fused is None or fused.bias is not None or not fused_mlp.is_silu(mlp.act_fn):
        return None
    if any(frozen_delta_of(base_linear(module)) is not None for module in modules):
        return None  # the kernel adds one stage per projection; frozen factors are a second (`project` runs both)
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
    if fused.extra_rows == fold_rows(adapted, fused.weight.dtype):  # `mlp_fold_factors`' rows (none: 0 < fold_rows)
        hidden = lora_a_product.a_product(rows, fused.extra, sum(factor.down.shape[0] for factor in adapted))
    else:
        hidden = _lora_hidden(rows, adapted)
    per_module = iter(_per_module(hidden, adapted))
    deltas = [None if f is None else fused_mlp.LoraDelta(next(per_module), f.up, f.scaling) for f in factors]
    return fused_mlp.gated_activation(rows, fused.weight, *deltas).view(*x.shape[:-1], -1)
