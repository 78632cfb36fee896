"""Where the parameters live under each training engine, and how a reset reads and writes them there.

A hard reset reads and edits weights in place (freeze or merge LoRA, fresh adapter, reference := policy). Each engine
keeps the weights somewhere else (../shared/notes/sharded-resets.md §a), so every edit goes through the few primitives here:

* `REPLICATED` (one process, DDP): every rank holds whole tensors; an edit is a plain in-place op.
* `FSDP2` (accelerate's `fsdp_version: 2`, `fully_shard`): each parameter is a `DTensor` sharded on dim 0. A rank
  edits its local shard (`to_local()`, never `.data =`, which FSDP2 ignores), after `reshard()`: a root module keeps
  its unsharded copy after a forward, and that copy (not the shard) is what the next forward would use.
* `ZERO2` (DeepSpeed ZeRO-1/2): parameters are replicated (trainable ones are views into DeepSpeed's flat bf16
  buffer) and the ZeRO optimizer holds fp32 master copies that its next `step()` would write back over an edit:
  edit in place, then `refresh_master_weights`.
* `ZERO3`: a parameter is a placeholder; its values live in `ds_tensor` partitions. Edits happen only inside
  `gathered(..., modifier_rank=0)` (DeepSpeed's `GatheredParameters`), which broadcasts rank 0's values and
  re-partitions on exit; then `refresh_master_weights` as for ZeRO-2.

`engine_of` says which engine a launch uses, from the live accelerator or, before any model is loaded, from the
training arguments and what `accelerate launch` exported.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPLICATED, FSDP2, ZERO2, ZERO3 = "replicated", "fsdp2", "zero2", "zero3"
SHARDED = (FSDP2, ZERO2, ZERO3)


@dataclass(frozen=True)
class Engine:
    """How a launch holds parameters and optimizer state, as far as a hard reset is concerned.

    `kind` is one of `REPLICATED`, `FSDP2`, `ZERO2`, `ZERO3`, or "unsupported"; `label` names it for messages
    (e.g. "DeepSpeed ZeRO-3"); `problems` says why an unsupported launch cannot reset (empty otherwise).
    """

    kind: str
    label: str
    problems: tuple[str, ...] = ()
    ram_efficient_loading: bool = False  # FSDP: transformers loads the weights on rank 0 only (zeros elsewhere)

    @property
    def sharded(self) -> bool:
        return self.kind in SHARDED

    @property
    def deepspeed(self) -> bool:
        return self.kind in (ZERO2, ZERO3)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def _deepspeed_config(args: Any) -> dict[str, Any] | None:
    """The DeepSpeed config from `args.deepspeed` (a dict or a JSON file), or None."""
    config = getattr(args, "deepspeed", None)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        return json.loads(open(config).read())
    return config if isinstance(config, dict) else None


# A problem of the engine itself, not only of resets: every phase boundary (a new DeepSpeed engine per `train()` call)
# carries the optimizer, so a run of several phases is refused for it even without a reset.
BF16_OPTIMIZER_PROBLEM = (
    "ZeRO stage 1 with bf16 and `data_types.grad_accum_dtype: fp32` (DeepSpeed's BF16_Optimizer, whose fp32 master "
    "weights a phase boundary cannot carry into the next engine); use ZeRO stage 2, or drop grad_accum_dtype"
)


def _zero_engine(stage: int, offload_optimizer: str, offload_param: str, config: dict[str, Any]) -> Engine:
    label = f"DeepSpeed ZeRO-{stage}"
    problems = []
    if offload_optimizer not in ("", "none", None) or offload_param not in ("", "none", None):
        problems.append(
            f"CPU/NVMe offload (offload_optimizer={offload_optimizer or 'none'}, offload_param={offload_param or 'none'}): "
            "the fp32 master weights and Adam moments then live off the GPU in DeepSpeed's swap buffers, which a reset "
            "does not refresh (and NVMe offload is untested)"
        )
    zero = config.get("zero_optimization", {}) if config else {}
    if int(zero.get("zero_hpz_partition_size", 1) or 1) > 1:
        problems.append("ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1) keeps a second parameter copy")
    if config and "scheduler" in config:
        problems.append(
            "a DeepSpeed `scheduler` block (DeepSpeed then steps its own LR schedule, which a reset cannot restart); "
            "use the trainer's `lr_scheduler_type` instead"
        )
    if stage == 0:
        problems.append("ZeRO stage 0 (use plain DDP, `recipes/accelerate/multi_gpu.yaml`, instead)")
    accumulate = str(((config or {}).get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    bf16 = ((config or {}).get("bf16") or {}).get("enabled", "auto")
    if stage == 1 and accumulate in ("fp32", "float32", "float") and bf16 is not False:
        # DeepSpeed's engine then builds its `BF16_Optimizer` (engine.py `_do_optimizer_sanity_check`), whose fp32
        # masters (`fp32_groups_flat_partition`) a phase boundary does not carry: the optimizer would silently
        # restart at every phase, `reset_optimizer: false` included
        problems.append(BF16_OPTIMIZER_PROBLEM)
    kind = ZERO3 if stage == 3 else ZERO2
    return Engine("unsupported" if problems else kind, label, tuple(problems))


def _fsdp_engine(version: int, offload: bool, ram_efficient_loading: bool = False) -> Engine:
    if version != 2:
        return Engine(
            "unsupported",
            f"FSDP{version}",
            ("FSDP version 1 flattens parameters into FlatParameters that a reset cannot edit by name",),
        )
    if offload:
        return Engine("unsupported", "FSDP2", ("FSDP2 with CPU offload (fsdp_offload_params: true)",))
    return Engine(FSDP2, "FSDP2", ram_efficient_loading=ram_efficient_loading)


def _true(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def engine_of_accelerate_config(config: dict[str, Any]) -> Engine:
    """The engine an accelerate config file (`recipes/accelerate/*.yaml`) launches, read as `accelerate launch` does."""
    kind = str(config.get("distributed_type") or "NO").upper()
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        file_config = {}
        if ds.get("deepspeed_config_file") and os.path.isfile(ds["deepspeed_config_file"]):
            file_config = json.loads(open(ds["deepspeed_config_file"]).read())
        zero = file_config.get("zero_optimization", {})
        return _zero_engine(
            int(zero.get("stage", ds.get("zero_stage", 2))),
            str(zero.get("offload_optimizer", {}).get("device", ds.get("offload_optimizer_device", "none"))).lower(),
            str(zero.get("offload_param", {}).get("device", ds.get("offload_param_device", "none"))).lower(),
            file_config,
        )
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        return _fsdp_engine(
            int(fsdp.get("fsdp_version", 1)), _true(fsdp.get("fsdp_offload_params")), _true(fsdp.get("fsdp_cpu_ram_efficient_loading"))
        )
    if kind == "MEGATRON_LM":
        return Engine("unsupported", "Megatron-LM", ("Megatron-LM keeps tensor-parallel weight shards",))
    return Engine(REPLICATED, "DDP" if kind.startswith("MULTI_") else "single process")


def engine_of(args: Any = None, accelerator: Any = None) -> Engine:
    """The engine of this launch: from `accelerator`'s plugins when given, else from `args` and the environment.

    The environment is what `accelerate launch --config_file recipes/accelerate/<x>.yaml` exports
    (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_*`, `ACCELERATE_USE_FSDP`, `FSDP_VERSION`, ...), so the launch
    can be checked before any model is loaded.
    """
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "") or "")
    state = getattr(accelerator, "state", None)
    if kind == "DEEPSPEED":
        plugin = state.deepspeed_plugin
        config = plugin.deepspeed_config
        zero = config.get("zero_optimization", {})
        return _zero_engine(
            int(zero.get("stage", plugin.zero_stage)),
            str(zero.get("offload_optimizer", {}).get("device", "none")),
            str(zero.get("offload_param", {}).get("device", "none")),
            config,
        )
    if kind == "FSDP":
        plugin = state.fsdp_plugin
        offload = getattr(plugin, "cpu_offload", None)  # FSDP2: an OffloadPolicy (truthy) that offloads only if CPU
        offloaded = type(offload).__name__ == "CPUOffloadPolicy" or getattr(offload, "offload_params", False) is True
        return _fsdp_engine(int(plugin.fsdp_version), offloaded, bool(getattr(plugin, "cpu_ram_efficient_loading", False)))
    if kind == "MEGATRON_LM" or (accelerator is None and _env_flag("ACCELERATE_USE_MEGATRON_LM")):
        return Engine("unsupported", "Megatron-LM", ("Megatron-LM keeps tensor-parallel weight shards",))
    if accelerator is None:
        config = _deepspeed_config(args)
        if config is not None or getattr(args, "deepspeed", None) or _env_flag("ACCELERATE_USE_DEEPSPEED"):
            config = config or {}
            zero = config.get("zero_optimization", {})
            stage = zero.get("stage", os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))
            offload_optimizer = zero.get("offload_optimizer", {}).get(
                "device", os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
            )
            offload_param = zero.get("offload_param", {}).get(
                "device", os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
            )
            return _zero_engine(int(stage), str(offload_optimizer).lower(), str(offload_param).lower(), config)
        fsdp = getattr(args, "fsdp", None)
        if fsdp:  # TrainingArguments(fsdp=..., fsdp_config=...): transformers defaults to FSDP2
            fsdp_config = getattr(args, "fsdp_config", None) or {}
            version = fsdp_config.get("version", fsdp_config.get("fsdp_version", 2))
            offload = "offload" in str(fsdp) or _true(fsdp_config.get("offload_params"))
            return _fsdp_engine(int(version), offload, _true(fsdp_config.get("cpu_ram_efficient_loading")))
        if _env_flag("ACCELERATE_USE_FSDP"):  # accelerate launch: its plugin defaults to FSDP1
            return _fsdp_engine(
                int(os.environ.get("FSDP_VERSION", 1)),
                _env_flag("FSDP_OFFLOAD_PARAMS"),
                _env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"),
            )
    multi = kind in ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")
    return Engine(REPLICATED, "DDP" if multi else "single process")


# --------------------------------------------------------------------------------------------- parameter access
def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_zero3_param(tensor: Any) -> bool:
    """A DeepSpeed ZeRO-3 partitioned parameter (a placeholder whose values live in `ds_tensor`)."""
    return hasattr(tensor, "ds_id")


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor], modifier_rank: int | None = None) -> Iterator[None]:
    """Make ZeRO-3 parameters whole for the block (collective); a no-op for every other kind of tensor.

    With `modifier_rank=r`, rank r's values are broadcast and re-partitioned on exit, so an edit persists; with
    None the gathered copies are read-only (edits are discarded on exit).
    """
    zero3 = [p for p in params if is_zero3_param(p)]
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero3, modifier_rank=modifier_rank):
        yield


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape (a ZeRO-3 placeholder is empty; a DTensor's `shape` is already the global one)."""
    return tuple(tensor.ds_shape) if is_zero3_param(tensor) else tuple(tensor.shape)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's all-gather (collective), else the tensor itself (ZeRO-3: call inside `gathered`)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank owns and the engine reads: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@torch.no_grad()
def write_full_(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Write the whole-tensor `value` (identical on every rank) into `tensor`, in its existing storage.

    DTensor: this rank's rows of `value` go into its local shard (no communication). ZeRO-3: call inside
    `gathered(..., modifier_rank=0)`. Plain tensors: `copy_`.
    """
    if is_dtensor(tensor):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(
            value.to(device=tensor.device, dtype=tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None
        ).to_local()
        tensor.to_local().copy_(local)
    else:
        tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))


def reshard(*models: nn.Module | None) -> None:
    """Drop FSDP2's unsharded copies, so the local shards (which a reset edits) are what the next forward gathers."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for module in model.modules() if model is not None else ():
            if isinstance(module, FSDPModule):
                module.reshard()


def refresh_master_weights(optimizer: Any) -> bool:
    """Copy edited bf16 parameters into a ZeRO optimizer's fp32 master weights; False when there is none to refresh.

    Without this, DeepSpeed's next `step()` writes the stale masters back over the edit (trap 1 of the notes).
    """
    inner = optimizer
    while inner is not None and not hasattr(inner, "refresh_fp32_params"):
        inner = getattr(inner, "optimizer", None)
    if inner is None:
        return False
    inner.refresh_fp32_params()
    return True


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@torch.no_grad()
def broadcast_tensors_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Make replicated tensors bitwise equal to rank `src`'s (one collective per tensor); no-op without a group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise RuntimeError("broadcast_tensors_ needs contiguous tensors (a broadcast into a copy would be lost).")
        dist.broadcast(tensor.data, src=src)
