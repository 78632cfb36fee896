"""Whole weights out of, and into, a model sharded by FSDP2 or DeepSpeed ZeRO (merged saves, resume, checks).

`iter_policy_weights` streams the policy one module at a time (GPU memory grows by one layer at most), folding every
LoRA delta (the live adapter's and the frozen ones of earlier resets) into its base weight on the way and dequantising
a quantised base, with the names `from_pretrained` expects (no `base_model.model.`, no `.base_layer`, no LoRA tensors):
merged saves (`gathered_state_dict`, `save.merged_state_dict`) and the vLLM weight push read it. `load_state_` writes
such a dict back into the engine's storage (local shards, ZeRO-3 partitions through a `modifier_rank=0` gather, or plain tensors).

Both are collective under FSDP2/ZeRO-3 (every rank calls them, with the same model) and plain loops otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .dense import dense_weight, is_quantized_weight
from .engine import full_value, gathered, rank, reshard, write_full_
from .frozen import FROZEN_MODULE, REFERENCE, frozen_delta_of
from .rounding import MergeRounding
from .support import ADAPTER_NAME, base_model_of, canonical_name

def _lora_owner(base: nn.Module) -> dict[str, nn.Module]:
    """`<layer>.base_layer` module name -> its LoRA layer, for layers whose "default" delta is live (not merged)."""
    from peft.tuners.lora import LoraLayer

    owners = {}
    for name, module in base.named_modules():
        if (
            isinstance(module, LoraLayer)
            and ADAPTER_NAME in module.lora_A
            and ADAPTER_NAME not in module.merged_adapters
            and not module.disable_adapters
            and ADAPTER_NAME in module.active_adapters
        ):
            owners[f"{name}.base_layer" if name else "base_layer"] = module
    return owners


def float_dtype(base: nn.Module) -> torch.dtype:
    """The dtype a dequantised weight is saved in: the model's first floating-point, unquantised parameter's."""
    for param in base.parameters():
        if param.dtype.is_floating_point and not is_quantized_weight(param):
            return param.dtype
    return torch.float32


@torch.no_grad()
def iter_policy_weights(
    model: nn.Module,
    buffers: bool = True,
    folded_dtype: torch.dtype | None = None,
    rounding: MergeRounding | None = None,
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """`(name, whole tensor, is_new)` for every base parameter (and persistent buffer, with `buffers`), named as
    `from_pretrained` names them: the policy as a plain model, one module at a time.

    Each weight (and bias) gets its frozen deltas (`frozen.FrozenDelta`) and the live "default" LoRA delta folded in,
    summed in float32 and cast once to `folded_dtype` (default: the weight's dtype); a quantised weight is dequantised
    first, its dtype then the model's float dtype. `rounding`, if given, adds up what casting each folded weight to
    its own dtype would round away of its deltas. `is_new` says the tensor is not the live parameter itself (folded,
    dequantised or gathered).
    A tensor is valid until the next one is asked for (a ZeRO-3 gather ends there): copy what you keep. The live model
    is not changed. Collective under FSDP2/ZeRO-3: every rank iterates to the end.
    """
    base = base_model_of(model)
    reshard(base)
    owners = _lora_owner(base)
    dequantised_dtype = float_dtype(base)
    for module_name, module in base.named_modules():
        parts = module_name.split(".")
        if "lora_" in module_name or FROZEN_MODULE in parts:
            continue
        prefix = f"{module_name}." if module_name else ""
        params = dict(module.named_parameters(recurse=False))
        layer = owners.get(module_name)
        frozen = frozen_delta_of(module)
        if frozen is not None and frozen.acts_in == REFERENCE:
            frozen = None  # the reference's own copy of the live delta (a reference reset): not part of the policy
        extra = []
        if layer is not None:
            lora_b = layer.lora_B[ADAPTER_NAME]
            extra = [t for t in (layer.lora_A[ADAPTER_NAME].weight, lora_b.weight, lora_b.bias) if t is not None]
        with gathered(list(params.values()) + extra):
            if layer is not None and not _has_live_delta(layer):
                layer = None  # B = 0 (a fresh adapter): nothing to add, and nothing copied
            for name, param in params.items():
                if name == "weight" and is_quantized_weight(param):
                    value, dtype = dense_weight(module), dequantised_dtype
                else:
                    value, dtype = full_value(param), param.dtype
                if name in ("weight", "bias") and (layer is not None or frozen is not None):
                    exact = _with_deltas(module, layer, frozen, name, value)
                    if rounding is not None:
                        rounding.add(exact - value.float(), exact, exact.to(dtype))
                    value = exact.to(folded_dtype or dtype)
                elif value.dtype != dtype:
                    value = value.to(dtype)
                yield canonical_name(prefix + name), value, value is not param
        if buffers:
            for name, buffer in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    yield canonical_name(prefix + name), buffer, False


@torch.no_grad()
def gathered_state_dict(
    model: nn.Module,
    to_all_ranks: bool = False,
    folded_dtype: torch.dtype | None = None,
    rounding: MergeRounding | None = None,
) -> dict[str, torch.Tensor] | None:
    """The policy as a plain `from_pretrained` state dict on rank 0's CPU (every rank's with `to_all_ranks`).

    Every LoRA delta (the live one and the frozen ones) is folded into its base weight (`iter_policy_weights`, whose
    `folded_dtype` and `rounding` this passes on); the live model is not changed. Other ranks get None. Collective
    under FSDP2/ZeRO-3: call it on every rank.
    """
    keep = to_all_ranks or rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, value, _ in iter_policy_weights(model, folded_dtype=folded_dtype, rounding=rounding):
        if keep:
            state[name] = value.detach().to("cpu", copy=True)
    return state if keep else None


def _has_live_delta(layer: nn.Module) -> bool:
    """Whether the layer's live adapter adds anything (B or its bias non-zero); collective under FSDP2."""
    lora_b = layer.lora_B[ADAPTER_NAME]
    return any(bool(full_value(t).count_nonzero()) for t in (lora_b.weight, lora_b.bias) if t is not None)


def _with_deltas(
    module: nn.Module, layer: nn.Module | None, frozen: Any, kind: str, value: torch.Tensor
) -> torch.Tensor:
    """`value` (the whole base weight or bias) plus the frozen deltas and the live LoRA delta, summed in float32."""
    total = value.float()
    transpose = bool(getattr(layer, "fan_in_fan_out", False)) or type(module).__name__ == "Conv1D"
    if frozen is not None:
        if kind == "weight":
            delta = frozen.weight_delta().to(total.device)
            total = total + (delta.T if transpose else delta)
        elif frozen.bias is not None:
            total = total + frozen.bias.to(total.device)
    if layer is not None:
        lora_b = layer.lora_B[ADAPTER_NAME]
        scaling = layer.scaling[ADAPTER_NAME]
        if kind == "weight":
            delta = full_value(lora_b.weight).float() @ full_value(layer.lora_A[ADAPTER_NAME].weight).float()
            total = total + (delta.T if layer.fan_in_fan_out else delta) * scaling
        elif layer.lora_bias.get(ADAPTER_NAME) and lora_b.bias is not None:
            total = total + full_value(lora_b.bias).float() * scaling
    return total


@torch.no_grad()
def load_state_(model: nn.Module, lookup: Callable[[str], torch.Tensor | None] | Mapping[str, torch.Tensor]) -> list[str]:
    """Write whole tensors (by `from_pretrained` name) into the model's base parameters and persistent buffers.

    `lookup(name)` returns the tensor or None (a mapping works too). LoRA tensors are left alone. Returns the names
    of parameters that had no value (the caller decides whether that is an error). Collective under ZeRO-3.
    """
    get = lookup.get if isinstance(lookup, Mapping) else lookup
    base = base_model_of(model)
    reshard(base)
    missing = []
    for module_name, module in base.named_modules():
        if "lora_" in module_name:
            continue
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            key = canonical_name(prefix + name)
            value = get(key)
            if value is None:
                missing.append(key)
                continue
            with gathered([param], modifier_rank=0):
                write_full_(param, value)
        for name, buffer in module.named_buffers(recurse=False):
            value = get(canonical_name(prefix + name))
            if value is not None:
                buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))
    return missing


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
