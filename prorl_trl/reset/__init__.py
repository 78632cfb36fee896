"""Hard-reset mechanics as plain functions over the objects they change; the trainer decides *when* to call them.

A hard reset (ProRL) is: `freeze_lora_delta` (the default: the adapter's delta kept exactly as frozen low-rank factors
beside the base weights, `frozen`) or `merge_lora_in_place` (into the base weights), then `reinit_adapter` (LoRA;
`adapter_needs_rebuild` says beforehand whether the fresh adapter needs new Parameters), `broadcast_adapter` (DDP
replicas stay identical), `reset_optimizer_state` (fresh Adam moments), `sync_reference` (full fine-tuning) /
`reset_reference_adapter` (TRL's "ref" adapter) for the KL anchor, and a merged save (`save_merged`, `save_merged_model`; both atomic through
`write_dir_atomically`). `check_reset_support` refuses, before training, what a reset cannot do correctly.
`checkpoint` holds what a ProRL checkpoint adds to TRL's (phase, reset count, the earlier phases' deltas) and how a
resume reads it.

Under FSDP2 and DeepSpeed ZeRO-2/3 the same reset goes through `engine` (where each engine keeps weights, fp32
masters and optimizer state; `engine_of` tells the launch's engine) and `sharded` (`merge_lora_sharded`,
`fresh_adapter_sharded`, `sync_reference_sharded`, and the superset adapter that replaces a LoRA shape change);
`gathered` brings whole weights out of (merged saves) and into (resume) a sharded model.

Modules: `support` (what is supported; shared lookups), `engine`, `frozen`, `lora`, `sharded`, `rounding` (how much
of a delta a merge rounds away), `dense` (dequantised weights), `distributed`, `optimizer`, `reference`, `gathered`,
`save`, `checkpoint`. Nothing here imports the trainer.
"""

from .distributed import broadcast_adapter
from .engine import FSDP2, REPLICATED, ZERO2, ZERO3, Engine, engine_of, refresh_master_weights
from .frozen import (
    BOTH,
    POLICY,
    REFERENCE,
    FreezeReport,
    FrozenDelta,
    freeze_lora_delta,
    frozen_layers,
    frozen_rank_total,
    frozen_state_dict,
    keep_out_of_ddp_broadcasts,
    load_frozen_,
    snapshot_reference_delta,
)
from .gathered import gathered_state_dict, iter_policy_weights, load_state_
from .lora import adapter_needs_rebuild, lora_parameters, merge_lora_in_place, reinit_adapter, targeted_module_names
from .optimizer import reset_optimizer_state, restore_zero_optimizer, snapshot_zero_optimizer
from .reference import reset_reference_adapter, sync_reference
from .rounding import LOST_FRACTION_WARNING, MergeRounding
from .save import (
    merged_state_dict,
    merged_weights,
    recover_interrupted_save,
    save_merged,
    save_merged_model,
    write_dir_atomically,
)
from .sharded import fresh_adapter_sharded, merge_lora_sharded, superset_lora_config, sync_reference_sharded
from .support import (
    ADAPTER_NAME,
    ResetNotSupportedError,
    check_engine_support,
    check_lora_supported,
    check_reset_support,
    lora_layers,
    peft_model_of,
    quantization_method,
    unwrap_model,
)

__all__ = [
    "ADAPTER_NAME",
    "BOTH",
    "FSDP2",
    "REPLICATED",
    "ZERO2",
    "ZERO3",
    "Engine",
    "FreezeReport",
    "FrozenDelta",
    "LOST_FRACTION_WARNING",
    "MergeRounding",
    "POLICY",
    "REFERENCE",
    "ResetNotSupportedError",
    "adapter_needs_rebuild",
    "broadcast_adapter",
    "check_engine_support",
    "check_lora_supported",
    "check_reset_support",
    "engine_of",
    "freeze_lora_delta",
    "fresh_adapter_sharded",
    "frozen_layers",
    "frozen_rank_total",
    "frozen_state_dict",
    "gathered_state_dict",
    "iter_policy_weights",
    "keep_out_of_ddp_broadcasts",
    "load_frozen_",
    "load_state_",
    "lora_layers",
    "lora_parameters",
    "merge_lora_in_place",
    "merge_lora_sharded",
    "merged_state_dict",
    "merged_weights",
    "peft_model_of",
    "quantization_method",
    "recover_interrupted_save",
    "refresh_master_weights",
    "reinit_adapter",
    "reset_optimizer_state",
    "reset_reference_adapter",
    "restore_zero_optimizer",
    "save_merged",
    "save_merged_model",
    "snapshot_reference_delta",
    "snapshot_zero_optimizer",
    "superset_lora_config",
    "sync_reference",
    "sync_reference_sharded",
    "targeted_module_names",
    "unwrap_model",
    "write_dir_atomically",
]
