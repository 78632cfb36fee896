"""Whole weights out of, and into, a model sharded by FSDP2 or DeepSpeed ZeRO (merged saves, resume, checks).

`gathered_state_dict` streams the policy to one rank's CPU one module at a time (GPU memory grows by one layer at
most), folding a live LoRA delta into its base weight on the way, with the names `from_pretrained` expects
(no `base_model.model.`, no `.base_layer`, no LoRA tensors). `load_state_` writes such a dict back into the engine's
storage (local shards, ZeRO-3 partitions through a `modifier_rank=0` gather, or plain tensors).

Both are collective under FSDP2/ZeRO-3 (every rank calls them, with the same model) and plain loops otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .engine import full_value, gathered, rank, reshard, write_full_
from .support import ADAPTER_NAME, unwrap_model

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name as `from_pretrained` spells it: no wrapper prefixes (activation checkpointing, compile), no
    PEFT `.base_layer`."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def _base_model(model: nn.Module) -> nn.Module:
    model = unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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


@torch.no_grad()
def gathered_state_dict(model: nn.Module, to_all_ranks: bool = False) -> dict[str, torch.Tensor] | None:
    """The policy as a plain `from_pretrained` state dict on rank 0's CPU (every rank's with `to_all_ranks`).

    A PeftModel's live "default" delta (scale * B @ A, fp32, rounded once) is folded into each base weight; the live
    model is not changed. Other ranks get None. Collective under FSDP2/ZeRO-3: call it on every rank.
    """
    base = _base_model(model)
    reshard(base)
    owners = _lora_owner(base)
    keep = to_all_ranks or rank() == 0
    state: dict[str, torch.Tensor] = {}
    for module_name, module in base.named_modules():
        if "lora_" in module_name:
            continue
        prefix = f"{module_name}." if module_name else ""
        params = dict(module.named_parameters(recurse=False))
        layer = owners.get(module_name)
        extra = []
        if layer is not None:
            lora_b = layer.lora_B[ADAPTER_NAME]
            extra = [t for t in (layer.lora_A[ADAPTER_NAME].weight, lora_b.weight, lora_b.bias) if t is not None]
        with gathered(list(params.values()) + extra):
            for name, param in params.items():
                value = full_value(param)
                if layer is not None and name in ("weight", "bias"):
                    value = _with_delta(layer, name, value)
                if keep:
                    state[canonical_name(prefix + name)] = value.detach().to("cpu", copy=True)
        if keep:
            for name, buffer in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    state[canonical_name(prefix + name)] = buffer.detach().to("cpu", copy=True)
    return state if keep else None


def _with_delta(layer: nn.Module, kind: str, value: torch.Tensor) -> torch.Tensor:
    """`value` (the whole base weight or bias) plus the layer's LoRA delta, in fp32, cast back once."""
    lora_b = layer.lora_B[ADAPTER_NAME]
    scaling = layer.scaling[ADAPTER_NAME]
    if kind == "weight":
        delta = full_value(lora_b.weight).float() @ full_value(layer.lora_A[ADAPTER_NAME].weight).float()
        delta = delta.T if layer.fan_in_fan_out else delta
    elif layer.lora_bias.get(ADAPTER_NAME) and lora_b.bias is not None:
        delta = full_value(lora_b.bias).float()
    else:
        return value
    return (value.float() + delta * scaling).to(value.dtype)


@torch.no_grad()
def load_state_(model: nn.Module, lookup: Callable[[str], torch.Tensor | None] | Mapping[str, torch.Tensor]) -> list[str]:
    """Write whole tensors (by `from_pretrained` name) into the model's base parameters and persistent buffers.

    `lookup(name)` returns the tensor or None (a mapping works too). LoRA tensors are left alone. Returns the names
    of parameters that had no value (the caller decides whether that is an error). Collective under ZeRO-3.
    """
    get = lookup.get if isinstance(lookup, Mapping) else lookup
    base = _base_model(model)
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
