"""Which models and launches a hard reset supports, checked before training (see `check_reset_support`), and the
small lookups every reset function shares (`unwrap_model`, `peft_model_of`, `lora_layers`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .engine import Engine, engine_of

ADAPTER_NAME = "default"
SUPPORTED_INIT_LORA_WEIGHTS = (True, "gaussian")


class ResetNotSupportedError(ValueError):
    """A hard reset cannot be done correctly for this model or launch configuration (raised before training)."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The PeftModel/PreTrainedModel under DDP or DeepSpeed (`.module`) or `torch.compile` (`._orig_mod`) wrappers.

    (FSDP2 wraps nothing: `fully_shard` changes the module's class in place.)"""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter or module name as `from_pretrained` spells it: no wrapper prefixes (activation checkpointing,
    compile), no PEFT `.base_layer`."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")


def base_model_of(model: nn.Module) -> nn.Module:
    """The model under wrappers and, for a PeftModel, under PEFT (whose LoRA layers live inside it)."""
    model = unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def peft_model_of(model: nn.Module):
    """The `PeftModel` under any wrapper; `TypeError` (saying what to pass) for anything else."""
    from peft import PeftModel

    model = unwrap_model(model)
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"Expected a peft.PeftModel with a LoRA adapter named {ADAPTER_NAME!r}, got {type(model).__name__}. "
            "LoRA hard resets need the policy wrapped by PEFT (pass `peft_config=LoraConfig(...)` to the trainer); "
            "for full fine-tuning only the optimizer and the reference model are reset."
        )
    return model


def lora_layers(model: nn.Module, adapter_name: str = ADAPTER_NAME) -> list[tuple[str, nn.Module]]:
    """`(name, layer)` for every LoRA layer that holds `adapter_name`, in module order (deterministic)."""
    from peft.tuners.lora import LoraLayer

    return [
        (name, module)
        for name, module in unwrap_model(model).named_modules()
        if isinstance(module, LoraLayer)
        and (adapter_name in module.lora_A or adapter_name in getattr(module, "lora_embedding_A", {}))
    ]


def check_lora_supported(model: nn.Module) -> None:
    """Raise `ResetNotSupportedError` unless the "default" adapter is plain LoRA on Linear layers."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear

    peft_model = peft_model_of(model)
    config = peft_model.peft_config.get(ADAPTER_NAME)
    supported = (
        "Supported: LoraConfig on Linear layers (or bitsandbytes 4/8-bit ones) with init_lora_weights=True or "
        "'gaussian', use_dora=False, "
        "no modules_to_save / target_parameters / trainable_token_indices, lora_bias only on layers with a bias. Use a plain LoraConfig(r=..., lora_alpha=..., target_modules=...) or turn "
        "hard resets off (`hard_reset_between_phases: false`, no `hard_reset: true` phase, no HardResetCallback)."
    )
    if not isinstance(config, LoraConfig):
        raise ResetNotSupportedError(
            f"Hard reset needs a LoRA adapter named {ADAPTER_NAME!r}; found adapters "
            f"{ {name: type(cfg).__name__ for name, cfg in peft_model.peft_config.items()} }. {supported}"
        )
    problems = []
    if config.use_dora:
        problems.append("use_dora=True (the DoRA magnitude vector cannot be merged and re-initialised like LoRA)")
    if config.init_lora_weights not in SUPPORTED_INIT_LORA_WEIGHTS:
        problems.append(
            f"init_lora_weights={config.init_lora_weights!r} (PiSSA/OLoRA/LoftQ/EVA/CorDA/... initialise A and B from "
            "the base weights, so a fresh adapter would not be function-preserving)"
        )
    if config.modules_to_save:
        problems.append(f"modules_to_save={sorted(config.modules_to_save)} (their trained copies are not merged)")
    if getattr(config, "target_parameters", None):
        problems.append("target_parameters (LoRA on raw parameters) is set")
    if getattr(config, "trainable_token_indices", None):
        problems.append("trainable_token_indices is set")
    for name, layer in lora_layers(peft_model):
        if type(layer) is not LoraLinear and not is_bnb_lora_layer(layer):
            problems.append(
                f"layer {name} is a {type(layer).__module__}.{type(layer).__name__}, not a LoRA Linear (on an "
                "nn.Linear or a bitsandbytes 4/8-bit layer)"
            )
            break
        if layer.lora_bias.get(ADAPTER_NAME) and getattr(layer.get_base_layer(), "bias", None) is None:
            problems.append(f"lora_bias=True but layer {name} has no bias to merge it into")
            break
        if ADAPTER_NAME in getattr(layer, "lora_variant", {}):
            problems.append(f"layer {name} uses a LoRA variant ({type(layer.lora_variant[ADAPTER_NAME]).__name__})")
            break
    if problems:
        raise ResetNotSupportedError("Hard reset is not supported for this adapter: " + "; ".join(problems) + f". {supported}")


def is_bnb_lora_layer(layer: nn.Module) -> bool:
    """PEFT's LoRA layer over a bitsandbytes 4-bit or 8-bit base (QLoRA): `peft.tuners.lora.bnb.Linear4bit/8bitLt`."""
    cls = type(layer)
    return cls.__module__ == "peft.tuners.lora.bnb" and cls.__name__ in ("Linear4bit", "Linear8bitLt")


def quantization_method(model: nn.Module) -> str | None:
    """The quantisation of the (base) model's weights, e.g. 'bitsandbytes 4-bit', or None for float weights.

    Inspects flags and config only (no bitsandbytes import): `is_loaded_in_4bit/8bit`, `hf_quantizer`,
    `config.quantization_config`, and integer-typed weights.
    """
    base = unwrap_model(model)
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    if getattr(base, "is_loaded_in_4bit", False):
        return "bitsandbytes 4-bit"
    if getattr(base, "is_loaded_in_8bit", False):
        return "bitsandbytes 8-bit"
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if config is not None:
        values = config if isinstance(config, dict) else vars(config) if hasattr(config, "__dict__") else {}
        if values.get("load_in_4bit") or values.get("_load_in_4bit"):
            return "bitsandbytes 4-bit"
        if values.get("load_in_8bit") or values.get("_load_in_8bit"):
            return "bitsandbytes 8-bit"
        method = values.get("quant_method") or getattr(config, "quant_method", None)
        return str(getattr(method, "value", method) or "quantization_config")
    if getattr(base, "hf_quantizer", None) is not None:
        return type(base.hf_quantizer).__name__
    for param in base.parameters():
        if not param.dtype.is_floating_point:
            return f"{param.dtype} weights"
    return None


SUPPORTED_ENGINES = (
    "single process (one GPU or CPU), DDP (`recipes/accelerate/multi_gpu.yaml`), FSDP2 without CPU offload "
    "(`recipes/accelerate/fsdp.yaml`: fsdp_version 2) and DeepSpeed ZeRO-2/3 without offload "
    "(`recipes/accelerate/zero2.yaml`, `zero3.yaml`)"
)


def check_engine_support(engine: Engine) -> None:
    """Raise `ResetNotSupportedError` naming what works when `engine` (`engine_of`) cannot hard-reset."""
    if engine.kind != "unsupported":
        return
    raise ResetNotSupportedError(
        f"Hard resets are not supported under {engine.label}: " + "; ".join(engine.problems) + ". A reset edits "
        f"weights, fp32 master copies and optimizer state in place, where the engine keeps them. Supported: "
        f"{SUPPORTED_ENGINES}. Either launch with one of those, or disable resets (`hard_reset_between_phases: "
        "false`, no phase with `hard_reset: true`, no HardResetCallback, the same LoRA shape in every phase)."
    )


def check_reset_support(args: Any, model: nn.Module | None, accelerator: Any = None) -> None:
    """Raise `ResetNotSupportedError` before training if a hard reset cannot be done correctly here.

    Call it once, before the first step, whenever the run will hard-reset. Refused:
    * Engines whose weights a reset cannot edit in place (`check_engine_support`: FSDP1, CPU/NVMe offload, ZeRO++
      hpZ, a DeepSpeed `scheduler` block, ZeRO-1 with bf16 and fp32 gradient accumulation, Megatron-LM). Single process,
      DDP, FSDP2 and ZeRO-1/2/3 otherwise are supported.
    * With `lora_reset_mode="merge"`, a quantised base (QLoRA, GPTQ, ...): merging re-quantises the base at every
      reset and the rounding error accumulates over a long run. The default `"frozen"` never writes the base, so a
      bitsandbytes 4/8-bit base is supported there, in one process or under DDP (other quantisations have LoRA
      layers of their own, which `check_lora_supported` refuses).
    * LoRA variants we do not merge/re-init (see `check_lora_supported`).
    Full fine-tuning (no PeftModel) is supported: only the optimizer and the reference model are reset.
    `model=None` checks only the launch (args/accelerator/environment), e.g. before loading a model by name.
    """
    engine = engine_of(args, accelerator)
    check_engine_support(engine)
    if model is None:  # launch-only check, usable before the model is loaded
        return
    method = quantization_method(model)
    mode = getattr(args, "lora_reset_mode", "merge")
    if method is not None and mode == "merge":
        raise ResetNotSupportedError(
            f"Hard resets with lora_reset_mode='merge' are not supported on a quantised base model ({method}, e.g. "
            "QLoRA): merging the LoRA delta re-quantises the base at every reset and the rounding error accumulates "
            "over the run. Set `lora_reset_mode: frozen` (the default: each phase's delta is kept as frozen factors "
            "and the quantised base is never written), or load the base unquantised."
        )
    if method is not None and engine.sharded:
        raise ResetNotSupportedError(
            f"Hard resets on a quantised base ({method}) are supported in one process and under DDP, not under "
            f"{engine.label}. Launch with `recipes/accelerate/single_gpu.yaml` or `multi_gpu.yaml`, or load the base "
            "unquantised."
        )
    from peft import PeftModel

    if isinstance(unwrap_model(model), PeftModel):
        check_lora_supported(model)
