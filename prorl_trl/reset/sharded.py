"""Hard-reset mechanics under FSDP2 and DeepSpeed ZeRO-2/3: the same semantics as `lora.py` / `reference.py`, with
every read and write going through `engine.py`'s primitives (../shared/notes/sharded-resets.md §b).

* `merge_lora_sharded`: W += scale * B @ A in fp32, rounded once into W's own storage. FSDP2: per rank on its local
  rows (only the r x in matrix A is all-gathered). ZeRO-3: per layer inside `GatheredParameters(modifier_rank=0)`.
  ZeRO-2: on every rank, then rank 0's result is broadcast, so replicas stay bitwise equal.
* `fresh_adapter_sharded`: A drawn from one seeded CPU generator (the same numbers `lora.reinit_adapter` draws on one
  GPU), B = 0, identical on every rank by construction; written into the engine's storage.
* A LoRA *shape* change cannot add Parameters to a sharded model (FSDP2's `fully_shard` cannot be extended; a
  DeepSpeed engine owns its flat buffers), so these engines use a **superset adapter**: the adapter is allocated once
  at the largest rank on the union of all phases' targets (`superset_lora_config`), and a phase's shape is the
  active part (`fresh_adapter_sharded(rank=r, target_names=...)`): rows of A / columns of B beyond r and whole idle
  adapters are zero. Their gradients are exactly zero (dL/dB[:, k] is proportional to (A x)_k and dL/dA[k] to
  B[:, k]), so Adam and weight decay keep them at zero: the run is the one a rank-r adapter on those modules gives.
* `sync_reference_sharded`: full fine-tuning's reference := policy, sharded like the policy (TRL's `prepare_fsdp` /
  `prepare_deepspeed`), copied shard by shard (FSDP2), per module through gathers (ZeRO-3) or locally (ZeRO-2).

Every function here is collective under FSDP2/ZeRO-3: call it on all ranks, in the same order.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from .engine import (
    FSDP2,
    ZERO2,
    ZERO3,
    broadcast_tensors_,
    full_shape,
    full_value,
    gathered,
    local_value,
    reshard,
    write_full_,
)
from .lora import fresh_lora_a
from .rounding import MergeRounding
from .support import ADAPTER_NAME, ResetNotSupportedError, check_lora_supported, lora_layers, peft_model_of, unwrap_model


def _layer_tensors(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(base weight, A, B, base bias if the adapter has a bias, B's bias) of one LoRA layer."""
    base = layer.get_base_layer()
    lora_b = layer.lora_B[ADAPTER_NAME]
    with_bias = bool(layer.lora_bias.get(ADAPTER_NAME)) and lora_b.bias is not None
    return (
        base.weight,
        layer.lora_A[ADAPTER_NAME].weight,
        lora_b.weight,
        base.bias if with_bias else None,
        lora_b.bias if with_bias else None,
    )


@torch.no_grad()
def _merge_whole_(weight, lora_a, lora_b, bias, lora_b_bias, scaling: float, fan_in_fan_out: bool,
                  rounding: MergeRounding) -> None:  # fmt: skip
    """W += scaling * B @ A (and the bias), computed in fp32 and rounded once, in W's storage; what the rounding
    took is added to `rounding`."""
    delta = lora_b.float() @ lora_a.float()
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    exact = weight.float() + delta
    weight.copy_(exact.to(weight.dtype))
    rounding.add(delta, exact, weight)
    if bias is not None:
        bias.copy_((bias.float() + lora_b_bias.float() * scaling).to(bias.dtype))


def _check_unmerged(name: str, layer: nn.Module) -> None:
    if ADAPTER_NAME in layer.merged_adapters:
        raise RuntimeError(
            f"LoRA layer {name} is in PEFT's merged state (merge_adapter without unmerge); a sharded hard reset merges "
            "the delta itself and needs the adapter unmerged."
        )


@torch.no_grad()
def merge_lora_sharded(model: nn.Module, engine: str, active_layers: frozenset[str] | None = None) -> MergeRounding:
    """Merge the "default" LoRA delta into the sharded base weights, in place (collective).

    `active_layers`: names (in the base model, as `targeted_module_names` gives them) of the layers whose adapter is live in this phase; idle
    layers of a superset adapter hold A = B = 0 and are skipped on every rank alike. None: all layers.
    The function is unchanged only once B is zeroed by `fresh_adapter_sharded`; call the two back to back.
    Returns how much of the delta the base dtype rounded away, the same on every rank (FSDP2: summed over the ranks'
    rows).
    """
    check_lora_supported(model)
    if engine == FSDP2:
        reshard(model)
    replicated: list[torch.Tensor] = []
    rounding = MergeRounding()
    for name, layer in lora_layers(peft_model_of(model).get_base_model()):
        if active_layers is not None and name not in active_layers:
            continue
        _check_unmerged(name, layer)
        weight, lora_a, lora_b, bias, lora_b_bias = _layer_tensors(layer)
        scaling = layer.scaling[ADAPTER_NAME]
        if engine == ZERO3:
            tensors = [t for t in (weight, lora_a, lora_b, bias, lora_b_bias) if t is not None]
            with gathered(tensors, modifier_rank=0):
                _merge_whole_(weight, lora_a, lora_b, bias, lora_b_bias, scaling, layer.fan_in_fan_out, rounding)
        elif engine == FSDP2:
            if layer.fan_in_fan_out:
                raise ResetNotSupportedError(f"LoRA layer {name} has fan_in_fan_out=True, which FSDP2 merges do not handle.")
            a_whole = full_value(lora_a)  # r x in: the only gather of the merge
            w_rows, b_rows = local_value(weight), local_value(lora_b)
            if w_rows.shape[0] != b_rows.shape[0]:
                raise RuntimeError(
                    f"LoRA layer {name}: the base weight's local shard has {w_rows.shape[0]} rows but lora_B's has "
                    f"{b_rows.shape[0]}; both must be sharded on dim 0 over the same mesh (FSDP2 `fully_shard`)."
                )
            _merge_whole_(
                w_rows,
                a_whole,
                b_rows,
                local_value(bias) if bias is not None else None,
                local_value(lora_b_bias) if lora_b_bias is not None else None,
                scaling,
                False,
                rounding,
            )
        else:
            _merge_whole_(weight, lora_a, lora_b, bias, lora_b_bias, scaling, layer.fan_in_fan_out, rounding)
            replicated += [t for t in (weight, bias) if t is not None]
    if engine == ZERO2:  # the same inputs on every rank; the broadcast makes the results bitwise equal regardless
        broadcast_tensors_(replicated)
    if engine == FSDP2 and torch.distributed.is_initialized():  # every rank merged its own rows
        rounding.all_reduce(next(model.parameters()).device)
    return rounding


@torch.no_grad()
def fresh_adapter_sharded(
    model: nn.Module,
    engine: str,
    seed: int,
    rank: int | None = None,
    lora_alpha: float | None = None,
    target_names: frozenset[str] | None = None,
) -> dict[str, Any]:
    """A fresh "default" adapter, identical on every rank, written into the existing (sharded) Parameters.

    `rank` (default: the allocated rank) and `target_names` (module names in the base model, as
    `lora.targeted_module_names` gives them; default: every LoRA layer) select the active part of a
    superset adapter; everything else is zeroed. A is drawn on the CPU from `torch.Generator().manual_seed(seed)`,
    layer by layer in module order, as `lora.reinit_adapter(seed=...)` draws for a plain adapter of that shape.
    Sets each layer's scaling to alpha / rank (alpha / sqrt(rank) with rsLoRA). Returns the active shape
    (`{"r", "lora_alpha", "target_names"}`) for the caller to keep.
    """
    check_lora_supported(model)
    if engine == FSDP2:
        reshard(model)
    peft_model = peft_model_of(model)
    config = peft_model.peft_config[ADAPTER_NAME]
    layers = lora_layers(peft_model.get_base_model())
    allocated = config.r
    rank = allocated if rank is None else rank
    if not 1 <= rank <= allocated:
        raise ResetNotSupportedError(
            f"A fresh adapter of rank {rank} does not fit the allocated rank {allocated}: under a sharded engine the "
            "adapter is allocated once at the largest rank of all phases (see `superset_lora_config`)."
        )
    names = frozenset(name for name, _ in layers)
    target_names = names if target_names is None else frozenset(target_names)
    if not target_names <= names:
        raise ResetNotSupportedError(
            f"Modules {sorted(target_names - names)[:5]} have no LoRA layer: under a sharded engine every phase's "
            "targets must be wrapped from the start (see `superset_lora_config`)."
        )
    alpha = config.lora_alpha if lora_alpha is None else lora_alpha
    scaling = alpha / (math.sqrt(rank) if config.use_rslora else rank)
    generator = torch.Generator().manual_seed(seed)
    for name, layer in layers:
        weight_a = layer.lora_A[ADAPTER_NAME].weight
        lora_b = layer.lora_B[ADAPTER_NAME]
        tensors = [t for t in (weight_a, lora_b.weight, lora_b.bias) if t is not None]
        rows, columns = full_shape(weight_a)
        fresh = torch.zeros(rows, columns, dtype=torch.float32)
        if name in target_names:
            fresh[:rank] = fresh_lora_a((rank, columns), config.init_lora_weights, rank, generator)
        with gathered(tensors, modifier_rank=0):
            write_full_(weight_a, fresh)
            local_value(lora_b.weight).zero_()
            if lora_b.bias is not None:
                local_value(lora_b.bias).zero_()
        layer.lora_alpha[ADAPTER_NAME] = alpha
        layer.scaling[ADAPTER_NAME] = scaling
    return {"r": rank, "lora_alpha": alpha, "target_names": target_names}


def superset_lora_config(peft_config: Any, shapes: list[tuple[int | None, float | None, Any]]):
    """The LoraConfig that holds every phase's adapter: the largest rank, on the union of the phases' targets.

    `shapes` are the phases' `(lora_r, lora_alpha, lora_target_modules)` (`ResolvedPhase.lora_shape`). Returns None
    when every phase has the rank and targets of `peft_config` (then the plain adapter is already the right one).
    `"all-linear"` in any phase makes the union `"all-linear"`.
    """
    def targets_of(value: Any) -> Any:
        return value if isinstance(value, str) else frozenset(value or ())

    base_targets = targets_of(peft_config.target_modules)
    ranks = [peft_config.r] + [r for r, _, _ in shapes if r is not None]
    targets = [base_targets] + [targets_of(t) for _, _, t in shapes if t is not None]
    if len(set(ranks)) == 1 and len(set(targets)) == 1:
        return None
    if any(t == "all-linear" for t in targets):
        union: Any = "all-linear"
    elif any(isinstance(t, str) for t in targets):
        raise ResetNotSupportedError(
            f"Phases target {[t for t in targets if isinstance(t, str)]} as a regular expression; under FSDP2/ZeRO the "
            "adapter must be allocated once for all phases, which needs lists of module names (or 'all-linear')."
        )
    else:
        union = set().union(*targets)
    superset = copy.deepcopy(peft_config)
    superset.r = max(ranks)
    superset.target_modules = union
    return superset


@torch.no_grad()
def sync_reference_sharded(ref_model: nn.Module, policy: nn.Module, engine: str) -> None:
    """Full fine-tuning: reference := policy, with the reference sharded like the policy (collective).

    FSDP2: each rank copies its local shards (same mesh, same dim-0 sharding: no communication). ZeRO-3: per module,
    the policy's parameters are gathered read-only and the reference's with `modifier_rank=0`. ZeRO-2: TRL keeps the
    reference replicated (ZeRO stage 0), so a plain copy on every rank.
    """
    ref_model, policy = unwrap_model(ref_model), unwrap_model(policy)
    if hasattr(policy, "peft_config"):
        raise TypeError("sync_reference_sharded copies full weights; with LoRA the merge already moves the reference.")
    if engine == FSDP2:
        reshard(ref_model, policy)
    ref_modules = dict(ref_model.named_modules())
    policy_modules = dict(policy.named_modules())
    if set(ref_modules) != set(policy_modules):
        raise ValueError(f"Reference and policy differ in modules, e.g. {sorted(set(ref_modules) ^ set(policy_modules))[:5]}.")
    for module_name, ref_module in ref_modules.items():
        ref_params = dict(ref_module.named_parameters(recurse=False))
        policy_params = dict(policy_modules[module_name].named_parameters(recurse=False))
        if set(ref_params) != set(policy_params):
            raise ValueError(f"Reference and policy differ in the parameters of {module_name!r}.")
        for name, buffer in ref_module.named_buffers(recurse=False):
            buffer.copy_(dict(policy_modules[module_name].named_buffers(recurse=False))[name])
        if not ref_params:
            continue
        pairs = [(ref_params[n], policy_params[n]) for n in sorted(ref_params)]
        if engine == ZERO3:
            with gathered([p for _, p in pairs]), gathered([r for r, _ in pairs], modifier_rank=0):
                for ref, pol in pairs:
                    ref.copy_(pol.to(ref.dtype))
            continue
        for ref, pol in pairs:
            ref_local, pol_local = local_value(ref), local_value(pol)
            if ref_local.shape != pol_local.shape:
                raise RuntimeError(
                    f"{module_name}: reference shard {tuple(ref_local.shape)} vs policy shard {tuple(pol_local.shape)}; "
                    "the reference must be sharded like the policy (TRL's prepare_fsdp on the same mesh)."
                )
            ref_local.copy_(pol_local.to(ref_local.dtype))
