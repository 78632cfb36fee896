"""What a ProRL checkpoint needs beyond TRL's: the phase, the reset count, the continuous step and the merged base.

TRL/HF checkpoints of a LoRA run hold only the adapter, but after a hard reset the base weights themselves have moved
(the old deltas were merged in place). `ProRLTrainer` therefore writes `prorl_state.json` next to every checkpoint
(which phase, how many resets, the step offset, and the `merged/reset-<k>` directory that holds the base at that
point) and, on resume, loads that merged base into the live model before TRL loads the checkpoint's adapter,
optimizer and scheduler.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .support import unwrap_model

PRORL_STATE_NAME = "prorl_state.json"
LOG_HISTORY_NAME = "prorl_log_history.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def phase_dir_name(index: int) -> str:
    """Checkpoint folder of phase `index` (`ProRLTrainer._get_output_dir` writes it, `latest_checkpoint` globs it)."""
    return f"phase-{index}"


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (temporary file + rename), so a crash never leaves a truncated state file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_prorl_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    path = Path(checkpoint) / PRORL_STATE_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no {PRORL_STATE_NAME}: it was not written by ProRLTrainer (or the save was "
            "interrupted). Resume from a checkpoint under <output_dir>/phase-<i>/checkpoint-<step>/."
        )
    return json.loads(path.read_text())


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The most advanced ProRL checkpoint under `<output_dir>/phase-*/checkpoint-*` (by phase, then step)."""
    best, best_key = None, None
    for phase_dir in Path(output_dir).glob(phase_dir_name("*")):
        for checkpoint in phase_dir.iterdir() if phase_dir.is_dir() else []:
            match = _CHECKPOINT_RE.match(checkpoint.name)
            if not match or not (checkpoint / PRORL_STATE_NAME).is_file():
                continue
            state = read_prorl_state(checkpoint)
            key = (state["phase_index"], int(match.group(1)))
            if best_key is None or key > best_key:
                best, best_key = checkpoint, key
    return best


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"No model.safetensors(.index.json) in {path}: not a merged ProRL save.")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(path / shard)))
    return state


@torch.no_grad()
def load_merged_base(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy the weights of a merged save (`save_merged_model`) into the live model's base weights, in place.

    Works on a PeftModel (LoRA tensors are left alone; `.base_layer.` names are mapped to plain ones) and on a plain
    model. Every base tensor must be present: a partial load would silently mix two bases.
    """
    model = unwrap_model(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = _read_weights(Path(path))
    missing = []
    for name, tensor in list(base.named_parameters()) + list(base.named_buffers()):
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        if key not in saved:
            if isinstance(tensor, nn.Parameter):
                missing.append(key)
            continue
        tensor.copy_(saved[key].to(device=tensor.device, dtype=tensor.dtype))
    tied = getattr(base.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing:
        raise ValueError(f"The merged save at {path} lacks base weights, e.g. {missing[:5]}; it does not fit this model.")
