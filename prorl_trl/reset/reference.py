"""The reference side of a hard reset: the KL anchor moves to the current policy.

With LoRA and `beta > 0`, TRL's reference is the adapter-disabled base, which `merge_lora_in_place` already moves;
these functions cover the two other cases: full fine-tuning (a separate reference model) and TRL's "ref" adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from .engine import gathered, local_value, reshard
from .support import lora_layers, unwrap_model


@torch.no_grad()
def sync_reference(ref_model: nn.Module, policy: nn.Module) -> None:
    """Full fine-tuning: copy the policy's parameters and buffers into the reference model's existing tensors.

    (With LoRA + `beta > 0`, TRL's reference is the adapter-disabled base, which `merge_lora_in_place` already moves.)
    """
    ref_model, policy = unwrap_model(ref_model), unwrap_model(policy)
    from peft import PeftModel

    if isinstance(policy, PeftModel):
        raise TypeError(
            "sync_reference copies full weights; the policy is a PeftModel. With LoRA the reference (adapters "
            "disabled) is the base, which merge_lora_in_place already updates."
        )
    source = dict(policy.named_parameters()) | dict(policy.named_buffers())
    target = dict(ref_model.named_parameters()) | dict(ref_model.named_buffers())
    missing = sorted(set(target) ^ set(source))
    if missing:
        raise ValueError(f"Reference and policy models differ in tensor names, e.g. {missing[:5]}.")
    for name, tensor in target.items():
        if tensor.shape != source[name].shape:
            raise ValueError(f"Shape mismatch for {name}: reference {tuple(tensor.shape)}, policy {tuple(source[name].shape)}.")
        tensor.copy_(source[name])


@torch.no_grad()
def reset_reference_adapter(model: nn.Module, adapter_name: str = "ref") -> bool:
    """Zero the B matrices of TRL's frozen reference adapter, so the reference becomes the (merged) base.

    TRL adds a "ref" adapter (a copy of "default") when it is given a ready PeftModel and `beta > 0`. After
    `merge_lora_in_place` that reference is "new base + old ref delta", i.e. neither the old nor the current policy;
    zeroing its B makes it exactly the current policy (the hard reset of the KL anchor). Works under every engine
    (collective under FSDP2/ZeRO-3). Returns False if the model has no such adapter (then the reference is the adapter-disabled base, which the merge already moved).
    """
    reshard(model)  # FSDP2: after a forward the root unit holds unsharded copies, which the next reshard drops
    layers = lora_layers(model, adapter_name)
    for _, layer in layers:
        lora_b = layer.lora_B[adapter_name]
        tensors = [t for t in (lora_b.weight, lora_b.bias) if t is not None]
        with gathered(tensors, modifier_rank=0):  # ZeRO-3: edit the whole tensors; FSDP2: the local shards
            for tensor in tensors:
                local_value(tensor).zero_()
    return bool(layers)

