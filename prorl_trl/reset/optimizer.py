"""The optimizer side of a hard reset: fresh Adam moments and step counts, same Parameters and param groups; and, under
DeepSpeed, carrying the optimizer across the engine HF rebuilds at every phase (every `train()` call)."""

from __future__ import annotations

from typing import Any

import torch


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The innermost torch optimizer under accelerate's and DeepSpeed's wrappers (`AcceleratedOptimizer`,
    `DeepSpeedOptimizerWrapper` -> ZeRO optimizer -> the torch/DeepSpeed Adam that owns `.state`)."""
    inner = optimizer
    while hasattr(inner, "optimizer") and inner.optimizer is not None and inner.optimizer is not inner:
        inner = inner.optimizer
    return inner


def reset_optimizer_state(optimizer: Any) -> None:
    """Forget Adam moments and step counts; param groups (and their Parameter objects and lr) are kept.

    Works on a plain optimizer, accelerate's `AcceleratedOptimizer`, and DeepSpeed's ZeRO optimizers (whose Adam runs
    over flat fp32 partitions). The state is re-created lazily by the next `step()`, exactly as for a new optimizer.
    DeepSpeed's FusedAdam also counts steps per param group (`group["step"]`, notes §b): reset too.
    """
    inner = base_optimizer(optimizer)
    inner.state.clear()
    for group in inner.param_groups:
        if "step" in group:
            group["step"] = 0


def _zero_masters(optimizer: Any) -> list[torch.Tensor] | None:
    """The flat fp32 master partitions of a DeepSpeed ZeRO optimizer (one per group / sub-group), or None."""
    inner = optimizer
    while inner is not None:
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
            masters = getattr(inner, name, None)
            if masters is not None:
                return list(masters)
        inner = getattr(inner, "optimizer", None)
    return None


def snapshot_zero_optimizer(optimizer: Any) -> dict[str, Any] | None:
    """References to a ZeRO optimizer's fp32 masters and Adam state, to restore into the next engine's optimizer.

    HF's `_prepare_for_training` calls `deepspeed_init` at every `train()` call, which builds a new engine and a new
    optimizer (from the bf16 parameters) and destroys the old one: a kept optimizer (no reset, or
    `reset_optimizer=False`) would silently start fresh at every phase. No copy is made (the tensors outlive the old
    engine while referenced); returns None for a non-ZeRO optimizer.
    """
    masters = _zero_masters(optimizer)
    if masters is None:
        return None
    state = base_optimizer(optimizer).state
    return {"masters": masters, "state": [dict(state[m]) if m in state else None for m in masters]}


@torch.no_grad()
def restore_zero_optimizer(optimizer: Any, snapshot: dict[str, Any]) -> None:
    """Put a `snapshot_zero_optimizer` snapshot into a new ZeRO optimizer over the same trainable parameters.

    The fp32 masters are copied (they carry the precision bf16 parameters lack) and the Adam state re-keyed to the new
    partitions. Raises if the partition layout differs (other trainable parameters, world size or ZeRO stage).
    """
    masters = _zero_masters(optimizer)
    old = snapshot["masters"]
    if masters is None or [m.shape for m in masters] != [m.shape for m in old]:
        raise RuntimeError(
            "Cannot carry the DeepSpeed optimizer into the next phase: its fp32 partitions changed "
            f"({[tuple(m.shape) for m in old]} -> {[tuple(m.shape) for m in masters or []]}). The trainable "
            "parameters, world size and ZeRO stage must stay the same across phases."
        )
    state = base_optimizer(optimizer).state
    for new, previous, saved in zip(masters, old, snapshot["state"]):
        new.data.copy_(previous.data)
        if saved is not None:
            state[new] = saved
