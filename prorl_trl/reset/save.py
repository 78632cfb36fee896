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
from .gathered import float_dtype, gathered_state_dict, iter_policy_weights
from .rounding import MergeRounding
from .support import base_model_of, check_lora_supported, peft_model_of, quantization_method

# "auto" writes a merged save in the base dtype when rounding into it loses at most this share of the deltas' norm.
AUTO_KEPT_LOSS = 0.01


@torch.no_grad()
def merged_state_dict(
    model: nn.Module,
    device: str | torch.device | None = "cpu",
    folded_dtype: torch.dtype | None = None,
    rounding: MergeRounding | None = None,
) -> dict[str, torch.Tensor]:
    """The policy as a plain model's state dict: base weights with every LoRA delta folded in (the live "default"
    adapter's and the frozen ones of earlier resets), and no LoRA tensors.

    Computed out of place, one layer at a time (`gathered.iter_policy_weights`, whose `folded_dtype` and `rounding`
    this passes on; the live model is not touched); each sum is done in float32 and cast once (default: to the base
    dtype), and a quantised base is dequantised to the model's float dtype. Folded tensors are moved to `device`
    (default CPU) as they are made, so GPU memory grows by one layer at most; untouched tensors (and layers whose B is
    zero and have nothing frozen, e.g. right after a merge) are not copied.
    """
    check_lora_supported(model)
    return {
        name: value.to(device) if is_new and device is not None else value
        for name, value, is_new in iter_policy_weights(model, folded_dtype=folded_dtype, rounding=rounding)
    }


@torch.no_grad()
def merged_weights(
    model: nn.Module, save_dtype: str = "auto", sharded: bool = False
) -> tuple[dict[str, torch.Tensor] | None, torch.dtype, MergeRounding]:
    """A LoRA policy's weights for a merged save, on the CPU in the dtype to write: `(state, dtype, rounding)`.

    Every delta is folded in float32 (`merged_state_dict`, or `gathered.gathered_state_dict` when `sharded`, which is
    collective and gives rank 0 the state, the others None); `rounding` says what casting them into the base dtype
    rounds away. `save_dtype` "auto" writes the base dtype when that keeps the deltas (at most `AUTO_KEPT_LOSS` of
    their norm rounded away) and float32 otherwise: a bf16 merged save of a run at a small learning rate would
    silently drop most of what it learned (the reason hard resets keep frozen factors). A named dtype is written as
    asked.
    """
    rounding = MergeRounding()  # every rank measures the same whole weights: the same on all of them
    if sharded:
        state = gathered_state_dict(model, folded_dtype=torch.float32, rounding=rounding)
    else:
        state = merged_state_dict(model, folded_dtype=torch.float32, rounding=rounding)
    base_dtype = rounding.dtype or float_dtype(base_model_of(model))
    if save_dtype == "auto":
        dtype = base_dtype if rounding.lost_fraction <= AUTO_KEPT_LOSS else torch.float32
    else:
        dtype = getattr(torch, save_dtype)
    if state is not None:
        state = {k: v.to("cpu", dtype) if v.is_floating_point() else v.to("cpu") for k, v in state.items()}
    return state, dtype, rounding


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
        dtypes = {t.dtype for t in merged.values() if t.is_floating_point()}
        if quantization_method(base) is not None or dtypes != {base.dtype}:
            _save_plain(base, merged, folder, next(iter(dtypes)) if len(dtypes) == 1 else base.dtype)
        else:
            base.save_pretrained(folder, state_dict=merged)
        _write_extras(folder, tokenizer, state)

    return write_dir_atomically(path, write)


def _save_plain(base: nn.Module, state: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype) -> None:
    """Save merged weights that `save_pretrained` would mislabel: in another dtype than the live model's (its
    `config.dtype` follows the live model, and `from_pretrained` casts to it) or dense weights of a quantised base
    (its quantizer replaces the state dict). The config says `dtype` and has no `quantization_config`; safetensors
    shards as `save_pretrained` names them; a tied output embedding left out as transformers leaves it out."""
    import copy

    from huggingface_hub import save_torch_state_dict

    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    if getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, folder)


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
