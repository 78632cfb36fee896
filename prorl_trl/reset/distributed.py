"""Keeping replicas identical after a reset: one rank's fresh adapter copied to all (DDP)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .lora import lora_parameters


@torch.no_grad()
def broadcast_adapter(model: nn.Module, src: int = 0) -> None:
    """Copy every LoRA tensor from rank `src` to all ranks (one collective per dtype); no-op without a process group.

    TRL seeds each rank differently (`set_seed(seed, device_specific=True)`), so an unseeded re-init gives each DDP
    replica different A matrices and they would silently drift apart. The Parameter objects are kept.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, param in lora_parameters(model):
        by_dtype.setdefault(param.dtype, []).append(param.data)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src=src)
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

