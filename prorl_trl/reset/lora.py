"""LoRA mechanics of a hard reset: merge the delta into the base in place (`lora_reset_mode="merge"`; the default keeps
it as frozen factors instead, `frozen.py`), then start a fresh adapter.

Why "in place": the HF training loop, the DDP wrapper, `accelerator._models`, `callback_handler.model` and TRL's
`vllm_generation.model` all hold the live `PeftModel` and its Parameter objects (see
`../shared/notes/trl-internals.md` §4-5). A reset therefore never replaces the PeftModel: the merge edits the base
weights' storage, a same-shape re-init overwrites the existing LoRA tensors, and only a change of rank/targets creates
new Parameter objects (the caller must then build a new optimizer, and under DDP do it between `train()` calls).

Supported: PEFT LoRA on `nn.Linear` layers (`peft.tuners.lora.layer.Linear`), init `True`/`"gaussian"`, full-precision
(fp32/bf16/fp16) base weights (`prorl_trl.reset.support` says what is refused and why).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
from torch import nn

from .rounding import MergeRounding
from .support import (
    ADAPTER_NAME,
    ResetNotSupportedError,
    check_lora_supported,
    is_bnb_lora_layer,
    lora_layers,
    peft_model_of,
    unwrap_model,
)


def lora_delta(layer: nn.Module) -> torch.Tensor:
    """The "default" adapter's `scale * B @ A` of one LoRA layer in float32, in the base weight's layout."""
    delta = layer.lora_B[ADAPTER_NAME].weight.float() @ layer.lora_A[ADAPTER_NAME].weight.float()
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[ADAPTER_NAME]


@torch.no_grad()
def merge_lora_in_place(model: nn.Module) -> MergeRounding:
    """Add the "default" LoRA delta (scale * B @ A) to each base weight, in the weight's existing storage.

    No module or Parameter is replaced, so optimizers, DDP and vLLM keep valid references. "default" is then removed
    from each layer's `merged_adapters`, so nothing (PEFT's `unmerge_adapter`, TRL's vLLM sync, disabling adapters)
    ever subtracts the delta again: it now *is* the base. The function is unchanged only once B is zeroed by
    `reinit_adapter`; call the two back to back. Returns how much of the delta the base dtype rounded away (layers
    that PEFT had already merged, e.g. mid vLLM sync, are not counted: their pre-merge weight is gone).
    """
    check_lora_supported(model)
    rounding = MergeRounding()
    for name, layer in lora_layers(model):
        if is_bnb_lora_layer(layer):
            raise ResetNotSupportedError(
                f"LoRA layer {name} sits on a quantised (bitsandbytes) weight: merging into it would re-quantise the "
                "base. Keep the delta as frozen factors instead (`frozen.freeze_lora_delta`, lora_reset_mode 'frozen')."
            )
    for _, layer in lora_layers(model):
        if ADAPTER_NAME not in layer.merged_adapters:
            weight = layer.get_base_layer().weight
            delta = lora_delta(layer)
            exact = weight.float() + delta
            layer.merge(adapter_names=[ADAPTER_NAME])
            rounding.add(delta, exact, weight)
        layer.merged_adapters.remove(ADAPTER_NAME)
    return rounding


def _adapter_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    layers = lora_layers(model)
    if not layers:
        raise ResetNotSupportedError(f"The model has no LoRA layers for adapter {ADAPTER_NAME!r}.")
    weight = layers[0][1].lora_A[ADAPTER_NAME].weight
    return weight.dtype, weight.device


def fresh_lora_a(shape: tuple[int, int], init_lora_weights: Any, r: int, generator: torch.Generator) -> torch.Tensor:
    """A fresh fp32 LoRA A of `shape` (r x in) on the CPU, drawn from `generator` as PEFT initialises it.

    `True`: kaiming-uniform with a=sqrt(5) (PEFT's default); `"gaussian"`: normal with std 1/r. Every rank that
    draws from the same seeded generator gets the same numbers.
    """
    fresh = torch.empty(shape, dtype=torch.float32)
    if init_lora_weights is True:
        nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
    else:  # "gaussian", as PEFT: std 1/r
        nn.init.normal_(fresh, std=1 / r, generator=generator)
    return fresh


@torch.no_grad()
def _init_adapter_weights(model: nn.Module, init_lora_weights: Any, seed: int | None) -> None:
    """PEFT's default LoRA init (kaiming-uniform A, zero B) on the existing tensors.

    With a seed, A is drawn on the CPU from a private `torch.Generator` (layer by layer in module order) and copied
    to the layer's device, so every rank and every device type draws the same numbers; the global RNG is untouched.
    """
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for _, layer in lora_layers(model):
        if generator is None:
            layer.reset_lora_parameters(ADAPTER_NAME, init_lora_weights=init_lora_weights)
            continue
        weight_a = layer.lora_A[ADAPTER_NAME].weight
        weight_a.copy_(fresh_lora_a(tuple(weight_a.shape), init_lora_weights, layer.r[ADAPTER_NAME], generator))
        layer.lora_B[ADAPTER_NAME].weight.zero_()
        if layer.lora_B[ADAPTER_NAME].bias is not None:
            layer.lora_B[ADAPTER_NAME].bias.zero_()


def targeted_module_names(model: nn.Module, target_modules: list[str] | str) -> frozenset[str]:
    """Names of the base-model modules a LoRA adapter with `target_modules` would wrap (as PEFT matches them).

    `"all-linear"` means every `nn.Linear` except the output embedding (PEFT's rule). Comparing these sets, rather
    than the configs, matters because PEFT rewrites `target_modules="all-linear"` into the list of full module names
    (in the user's own `LoraConfig` object, too), so the two spellings of one adapter would look different.
    """
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_target_module_exists

    base = peft_model_of(model).get_base_model()
    config = copy.copy(peft_model_of(model).peft_config[ADAPTER_NAME])
    config.target_modules = target_modules if isinstance(target_modules, str) else set(target_modules)
    output_embeddings = base.get_output_embeddings()
    names = set()
    for name, module in base.named_modules():
        parts = name.split(".")
        if "base_layer" in parts or any(part.startswith("lora_") for part in parts):
            continue  # inside a LoRA wrapper: the wrapper stands for the layer
        layer = module.get_base_layer() if isinstance(module, LoraLayer) else module
        if target_modules == "all-linear":
            if isinstance(layer, nn.Linear) and layer is not output_embeddings:
                names.add(name)
        elif bool(check_target_module_exists(config, name)):
            names.add(name)
    return frozenset(names)


def adapter_needs_rebuild(
    model: nn.Module, r: int | None = None, target_modules: list[str] | str | None = None
) -> bool:
    """Whether a fresh adapter of rank `r` on `target_modules` (None: unchanged) needs new Parameter objects.

    True when the rank or the set of wrapped modules changes; a new `lora_alpha` alone never does (it is a scale).
    """
    peft_model = peft_model_of(model)
    if r is not None and r != peft_model.peft_config[ADAPTER_NAME].r:
        return True
    if target_modules is None:
        return False
    current = frozenset(name for name, _ in lora_layers(peft_model.get_base_model()))
    return targeted_module_names(peft_model, target_modules) != current


def reinit_adapter(
    model: nn.Module,
    r: int | None = None,
    lora_alpha: float | None = None,
    target_modules: list[str] | str | None = None,
    seed: int | None = None,
) -> bool:
    """Start a fresh "default" adapter (A kaiming-uniform as PEFT's default, B zero) after `merge_lora_in_place`.

    Same rank and targets: the existing Parameter objects are overwritten (optimizer, DDP reducer and vLLM stay
    valid); a new `lora_alpha` only changes each layer's scaling. Returns False.
    New rank or targets: the adapter is deleted and re-added under the same name "default" (TRL's reference
    logic and vLLM weight renaming look for `.default.`) with a copy of the old `LoraConfig`, made active and
    trainable, in the old adapter's dtype/device. Returns True: the Parameters are new, so the caller must build a new
    optimizer (under DDP: between `train()` calls, with `trainer.model_wrapped = trainer.model`).
    `seed` makes the init deterministic and identical on every rank (else use `broadcast_adapter`).
    """
    check_lora_supported(model)
    peft_model = peft_model_of(model)
    old = peft_model.peft_config[ADAPTER_NAME]
    new = copy.deepcopy(old)  # the caller's LoraConfig (PEFT keeps a reference) is never modified
    if r is not None:
        new.r = r
    if lora_alpha is not None:
        new.lora_alpha = lora_alpha
    if target_modules is not None:
        new.target_modules = target_modules if isinstance(target_modules, str) else set(target_modules)
    if not adapter_needs_rebuild(peft_model, r=r, target_modules=target_modules):
        new.target_modules = old.target_modules  # same modules, maybe spelled differently ("all-linear")
        if new.lora_alpha != old.lora_alpha:
            if old.alpha_pattern or old.rank_pattern:
                raise ResetNotSupportedError(
                    "Changing lora_alpha of an adapter with per-layer alpha_pattern/rank_pattern is not supported; "
                    "keep lora_alpha, or drop the patterns from the LoraConfig."
                )
            for _, layer in lora_layers(peft_model):
                layer.lora_alpha[ADAPTER_NAME] = new.lora_alpha
                layer.scaling[ADAPTER_NAME] = new.lora_alpha / (math.sqrt(new.r) if new.use_rslora else new.r)
        peft_model.peft_config[ADAPTER_NAME] = new
        _init_adapter_weights(peft_model, new.init_lora_weights, seed)
        return False
    dtype, device = _adapter_dtype_device(peft_model)
    active_elsewhere = [name for name in peft_model.peft_config if name != ADAPTER_NAME]
    with warnings.catch_warnings():  # "Adapter default was active which is now deleted": we re-add it right away
        warnings.simplefilter("ignore", UserWarning)
        peft_model.delete_adapter(ADAPTER_NAME)
    new.inference_mode = False
    if seed is not None:
        with torch.random.fork_rng(devices=[]):  # PEFT's own init draws from the global RNG; keep it untouched
            peft_model.add_adapter(ADAPTER_NAME, new)
    else:
        peft_model.add_adapter(ADAPTER_NAME, new)
    peft_model.set_adapter(ADAPTER_NAME)
    for _, layer in lora_layers(peft_model):
        for module in (layer.lora_A[ADAPTER_NAME], layer.lora_B[ADAPTER_NAME]):
            module.to(device=device, dtype=dtype)
    for name in active_elsewhere:  # e.g. TRL's frozen "ref" adapter stays frozen
        for param_name, param in peft_model.named_parameters():
            if f".{name}." in param_name:
                param.requires_grad_(False)
    _init_adapter_weights(peft_model, new.init_lora_weights, seed)
    return True


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every LoRA tensor of the model (all adapters), in a fixed order."""
    return [(name, param) for name, param in unwrap_model(model).named_parameters() if "lora_" in name]


