"""Hard-reset mechanics as plain functions over the objects they change; the trainer decides *when* to call them.

A hard reset (ProRL) is: `merge_lora_in_place` + `reinit_adapter` (LoRA; `adapter_needs_rebuild` says beforehand
whether the fresh adapter needs new Parameters), `broadcast_adapter` (DDP replicas stay identical),
`reset_optimizer_state` (fresh Adam moments), `sync_reference` (full fine-tuning) / `reset_reference_adapter` (TRL's
"ref" adapter) for the KL anchor, and a merged save (`save_merged`, `save_merged_model`; both atomic through
`write_dir_atomically`). `check_reset_support` refuses, before training, what a reset cannot do correctly.
`checkpoint` holds what a ProRL checkpoint adds to TRL's (phase, reset count, merged base) and how a resume reads it.

Modules: `support` (what is supported; shared lookups), `lora`, `distributed`, `optimizer`, `reference`, `save`,
`checkpoint`. Nothing here imports the trainer.
"""

from .distributed import broadcast_adapter
from .lora import adapter_needs_rebuild, lora_parameters, merge_lora_in_place, reinit_adapter, targeted_module_names
from .optimizer import reset_optimizer_state
from .reference import reset_reference_adapter, sync_reference
from .save import merged_state_dict, recover_interrupted_save, save_merged, save_merged_model, write_dir_atomically
from .support import (
    ADAPTER_NAME,
    ResetNotSupportedError,
    check_lora_supported,
    check_reset_support,
    lora_layers,
    peft_model_of,
    quantization_method,
    unwrap_model,
)

__all__ = [
    "ADAPTER_NAME",
    "ResetNotSupportedError",
    "adapter_needs_rebuild",
    "broadcast_adapter",
    "check_lora_supported",
    "check_reset_support",
    "lora_layers",
    "lora_parameters",
    "merge_lora_in_place",
    "merged_state_dict",
    "peft_model_of",
    "quantization_method",
    "recover_interrupted_save",
    "reinit_adapter",
    "reset_optimizer_state",
    "reset_reference_adapter",
    "save_merged",
    "save_merged_model",
    "sync_reference",
    "targeted_module_names",
    "unwrap_model",
    "write_dir_atomically",
]
