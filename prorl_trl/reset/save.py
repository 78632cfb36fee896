"""Merged saves: the policy as a plain `from_pretrained` model (base + LoRA delta), written atomically.

Saved at every hard reset (`merged/reset-<k>/`, the base a resumed run reloads) and at the end (`final/`). Atomic
means: written into a temporary sibling folder and renamed into place (`write_dir_atomically`), for LoRA and full
fine-tuning alike, so a kill or a full disk never leaves a half-written model where a loadable one was expected.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import PRORL_STATE_NAME
from .lora import lora_delta
from .support import ADAPTER_NAME, check_lora_supported, lora_layers, peft_model_of


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
                delta = lora_delta(layer)
            else:
                delta = layer.lora_B[ADAPTER_NAME].bias.float() * layer.scaling[ADAPTER_NAME]
            tensor = (tensor.float() + delta).to(tensor.dtype)
            tensor = tensor.to(device) if device is not None else tensor
        state[key] = tensor
    return state


def save_merged_model(
    model: nn.Module,
    tokenizer: Any,
    path: str | os.PathLike,
    state: dict | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save base + all LoRA deltas as a plain model (no LoRA tensors) and the tokenizer; return the final path.

    Loadable with `AutoModelForCausalLM.from_pretrained(path)` and equal in function to the live PeftModel, which is
    left untouched (no merge/unload of the live object). Atomic (`write_dir_atomically`). `state`, if given, is
    written beside the weights as `prorl_state.json` (what the run had done when it saved). `weights`: the merged
    weights already gathered from a sharded model (`gathered.gathered_state_dict`; default `merged_state_dict`).
    Call it on the main process only (it does not synchronise ranks).
    """
    base = peft_model_of(model).get_base_model()
    merged = merged_state_dict(model) if weights is None else weights

    def write(folder: Path) -> None:
        base.save_pretrained(folder, state_dict=merged)
        _write_extras(folder, tokenizer, state)

    return write_dir_atomically(path, write)


def write_dir_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Write a whole folder at once: `write(tmp)` fills a temporary sibling of `path`, which is then renamed into
    place (a previous `path` is moved aside first and deleted only after the rename).

    Whatever stops the process (SIGKILL, a full disk, an exception inside `write`), `path` is either the previous
    complete version or the new complete one, never a mix; an exception removes the temporary folder (freeing the
    space) and propagates. Leftovers of a killed call are cleaned by the next call (`recover_interrupted_save`).
    Every folder ProRL writes for `from_pretrained` (`merged/reset-<k>/`, `final/`) goes through here.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_extras(folder: Path, tokenizer: Any, state: dict | None) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if state is not None:
        (folder / PRORL_STATE_NAME).write_text(json.dumps(state, indent=2, default=str))


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


def save_merged(
    model: nn.Module,
    tokenizer: Any,
    path: str | os.PathLike,
    state: dict | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """The live policy as a plain model at `path`: base + LoRA delta for a PeftModel, the weights as they are for full
    fine-tuning. Atomic either way (`write_dir_atomically`); `state` as in `save_merged_model`; `weights` gathered
    from a sharded model (FSDP2/ZeRO: `gathered.gathered_state_dict`, whose shards the model itself cannot save).
    Main process only."""
    if hasattr(model, "peft_config"):
        return save_merged_model(model, tokenizer, path, state, weights=weights)

    def write(folder: Path) -> None:
        model.save_pretrained(folder, state_dict=weights)
        _write_extras(folder, tokenizer, state)

    return write_dir_atomically(path, write)
