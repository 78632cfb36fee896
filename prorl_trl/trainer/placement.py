"""Where the models TRL 1.16 loads by path land under FSDP2, and how ProRLTrainer puts them on the process's GPU.

Why: TRL sets `device_map=None` for the models it loads by path only under DDP and DeepSpeed; under FSDP it keeps
`create_model_from_path`'s default `device_map="auto"`, which on a multi-GPU host loads every rank's copy across all
visible GPUs (with accelerate dispatch hooks). accelerate's FSDP2 preparation of the policy copes, but TRL's
`prepare_fsdp` for the KL reference model only calls `fully_shard`, which moves parameters to the rank's device and
leaves buffers (the rotary `inv_freq`) and the hooks where loading put them: the reference's first forward then
mixes `cuda:0` and `cuda:1` (seen on 2 x H100). So under FSDP2 the models are loaded on the process's own device
(unless the user chose a `device_map`), and whatever still sits elsewhere on the reference after TRL's init is moved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..reset.engine import is_dtensor


def fsdp2_model_init_kwargs(model_init_kwargs: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """A copy of `model_init_kwargs` that loads on `device` (one GPU per process) unless it names a `device_map`."""
    kwargs = dict(model_init_kwargs or {})
    if device.type != "cpu":
        kwargs.setdefault("device_map", {"": str(device)})
    return kwargs


@torch.no_grad()
def move_stray_tensors_(module: nn.Module, device: torch.device) -> list[str]:
    """Move `module`'s plain (non-DTensor) parameters and buffers that are not on `device` there, in place, and drop
    accelerate's dispatch hooks; returns the moved names. FSDP2-sharded parameters (DTensors) are left alone."""
    moved = []
    for owner_name, owner in module.named_modules():
        for name, tensor in list(owner._parameters.items()) + list(owner._buffers.items()):
            if tensor is None or is_dtensor(tensor) or tensor.device == device:
                continue
            if name in owner._parameters:
                tensor.data = tensor.data.to(device)
            else:
                owner._buffers[name] = tensor.to(device)
            moved.append(f"{owner_name}.{name}" if owner_name else name)
    if any(hasattr(sub, "_hf_hook") for sub in module.modules()):
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(module, recurse=True)
        moved.append("<accelerate dispatch hooks>")
    return moved
