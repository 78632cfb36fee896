"""Hard-reset mechanics: merge the LoRA delta into the base in place, start a fresh adapter, clear optimizer state.

These are plain functions over the objects they change, so they can be tested without a training loop; the trainer
and callbacks only decide *when* to call them (at a step boundary, never between micro-batches).

Why "in place": the HF training loop, the DDP wrapper, `accelerator._models`, `callback_handler.model` and TRL's
`vllm_generation.model` all hold the live `PeftModel` and its Parameter objects (see
`../shared/notes/trl-internals.md` §4-5). A reset therefore never replaces the PeftModel: the merge edits the base
weights' storage, a same-shape re-init overwrites the existing LoRA tensors, and only a change of rank/targets creates
new Parameter objects (the caller must then build a new optimizer, and under DDP do it between `train()` calls).

Functions: `merge_lora_in_place` + `reinit_adapter` (the reset; `adapter_needs_rebuild` says beforehand whether it
creates new Parameters), `broadcast_adapter` (DDP), `reset_optimizer_state`, `sync_reference` (full fine-tuning) /
`reset_reference_adapter` (TRL's "ref" adapter), `save_merged_model` (+ `recover_interrupted_save`), and
`check_reset_support` (from `prorl_trl.reset_support`).

Supported: PEFT LoRA on `nn.Linear` layers (`peft.tuners.lora.layer.Linear`), init `True`/`"gaussian"`, full-precision
(fp32/bf16/fp16) base weights, single process or DDP. Refused with a clear error: DoRA and other LoRA variants,
PiSSA/OLoRA/LoftQ/EVA/CorDA inits (their A/B are tied to a decomposition of the base), `modules_to_save`,
`target_parameters`, quantised (QLoRA) bases, DeepSpeed ZeRO, FSDP — see `check_reset_support`.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prorl_trl.reset_support import (  # noqa: F401  (re-exported: callers import everything from here)
    ADAPTER_NAME,
    ResetNotSupportedError,
    check_lora_supported,
    check_reset_support,
    lora_layers,
    peft_model_of,
    quantization_method,
    unwrap_model,
)


@torch.no_grad()
def merge_lora_in_place(model: nn.Module) -> None:
    """Add the "default" LoRA delta (scale * B @ A) to each base weight, in the weight's existing storage.

    No module or Parameter is replaced, so optimizers, DDP and vLLM keep valid references. "default" is then removed
    from each layer's `merged_adapters`, so nothing (PEFT's `unmerge_adapter`, TRL's vLLM sync, disabling adapters)
    ever subtracts the delta again: it now *is* the base. The function is unchanged only once B is zeroed by
    `reinit_adapter`; call the two back to back.
    """
    check_lora_supported(model)
    for _, layer in lora_layers(model):
        if ADAPTER_NAME not in layer.merged_adapters:
            layer.merge(adapter_names=[ADAPTER_NAME])
        layer.merged_adapters.remove(ADAPTER_NAME)


def _adapter_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    layers = lora_layers(model)
    if not layers:
        raise ResetNotSupportedError(f"The model has no LoRA layers for adapter {ADAPTER_NAME!r}.")
    weight = layers[0][1].lora_A[ADAPTER_NAME].weight
    return weight.dtype, weight.device


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
        fresh = torch.empty(weight_a.shape, dtype=torch.float32)
        if init_lora_weights is True:
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
        else:  # "gaussian", as PEFT: std 1/r
            nn.init.normal_(fresh, std=1 / layer.r[ADAPTER_NAME], generator=generator)
        weight_a.copy_(fresh)
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


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget Adam moments and step counts; param groups (and their Parameter objects and lr) are kept.

    Works on a plain optimizer and on accelerate's `AcceleratedOptimizer` (whose `.state` is the wrapped one's).
    The state is re-created lazily by the next `step()`, exactly as for a new optimizer.
    """
    inner = optimizer
    while hasattr(inner, "optimizer") and isinstance(inner.optimizer, torch.optim.Optimizer):
        inner = inner.optimizer
    inner.state.clear()


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
def merged_state_dict(model: nn.Module, device: str | torch.device | None = "cpu") -> dict[str, torch.Tensor]:
    """The base model's state dict with the active, unmerged "default" LoRA delta added, and no LoRA tensors.

    Computed out of place, one layer at a time (the live model is not touched); the sum is done in float32 and cast
    to the base dtype. Merged tensors are moved to `device` (default CPU) as they are made, so GPU memory grows by one
    layer at most; untouched tensors (and layers whose B is zero, e.g. right after a reset) are not copied.
    """
    check_lora_supported(model)
    base = peft_model_of(model).get_base_model()
    pending = {}  # state-dict key -> (layer, "weight" | "bias")
    for name, layer in lora_layers(base):
        if layer.disable_adapters or ADAPTER_NAME in layer.merged_adapters or ADAPTER_NAME not in layer.active_adapters:
            continue
        lora_b = layer.lora_B[ADAPTER_NAME]
        if lora_b.weight.count_nonzero() or (lora_b.bias is not None and lora_b.bias.count_nonzero()):
            pending[f"{name}.weight"] = (layer, "weight")
            if layer.lora_bias[ADAPTER_NAME]:
                pending[f"{name}.bias"] = (layer, "bias")
    state = {}
    for key, tensor in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        if key in pending:
            layer, kind = pending[key]
            if kind == "weight":
                delta = layer.lora_B[ADAPTER_NAME].weight.float() @ layer.lora_A[ADAPTER_NAME].weight.float()
                delta = delta.T if layer.fan_in_fan_out else delta
            else:
                delta = layer.lora_B[ADAPTER_NAME].bias.float()
            tensor = (tensor.float() + delta * layer.scaling[ADAPTER_NAME]).to(tensor.dtype)
            tensor = tensor.to(device) if device is not None else tensor
        state[key] = tensor
    return state


def save_merged_model(model: nn.Module, tokenizer: Any, path: str | os.PathLike) -> Path:
    """Save base + all LoRA deltas as a plain model (no LoRA tensors) and the tokenizer; return the final path.

    Loadable with `AutoModelForCausalLM.from_pretrained(path)` and equal in function to the live PeftModel, which is
    left untouched (no merge/unload of the live object). Atomic: written into a temporary sibling directory and
    renamed into place, so an interrupted save leaves any previous save at `path` intact.
    Call it on the main process only (it does not synchronise ranks).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(path)
    base = peft_model_of(model).get_base_model()
    state = merged_state_dict(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        base.save_pretrained(tmp, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def recover_interrupted_save(path: str | os.PathLike) -> None:
    """Clean up after a save killed mid-way: restore a previous save left aside (`.<name>.old-*`) if `path` is
    missing, and delete leftover temporary directories. Call before reading `path` after a crash."""
    path = Path(path)
    aside = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if aside and not path.exists():
        os.replace(aside.pop(), path)
    for leftover in aside + list(path.parent.glob(f".{path.name}.tmp-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first and deleted only after the rename succeeded."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def reset_reference_adapter(model: nn.Module, adapter_name: str = "ref") -> bool:
    """Zero the B matrices of TRL's frozen reference adapter, so the reference becomes the (merged) base.

    TRL adds a "ref" adapter (a copy of "default") when it is given a ready PeftModel and `beta > 0`. After
    `merge_lora_in_place` that reference is "new base + old ref delta", i.e. neither the old nor the current policy;
    zeroing its B makes it exactly the current policy (the hard reset of the KL anchor). Returns False if the model
    has no such adapter (then the reference is the adapter-disabled base, which the merge already moved).
    """
    layers = lora_layers(model, adapter_name)
    for _, layer in layers:
        layer.lora_B[adapter_name].weight.zero_()
        if layer.lora_B[adapter_name].bias is not None:
            layer.lora_B[adapter_name].bias.zero_()
    return bool(layers)
