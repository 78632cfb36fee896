"""What a ProRL checkpoint needs beyond TRL's: the phase, the reset count, the continuous step and the earlier phases'
LoRA deltas.

TRL/HF checkpoints of a LoRA run hold only the live adapter, but after a hard reset the policy also holds every earlier
phase's delta: as frozen factors (`lora_reset_mode="frozen"`, saved at each reset as `frozen/reset-<k>.safetensors`)
or merged into the base weights (`"merge"`, the `merged/reset-<k>` folder). `ProRLTrainer` therefore writes
`prorl_state.json` next to every checkpoint (which phase, how many resets, the step offset, and which of those files
holds the deltas at that point) and, on resume, restores them into the live model before TRL loads the checkpoint's
adapter, optimizer and scheduler.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .gathered import load_state_
from .provenance import RunFilesError, file_sha256
from .support import base_model_of

PRORL_STATE_NAME = "prorl_state.json"
CHECKPOINT_HASHES_NAME = "prorl_checkpoint_hashes.json"
SUPERSEDED_STATE_NAME = "prorl_state.superseded.json"
LOG_HISTORY_NAME = "prorl_log_history.json"
FINAL_DIR_NAME = "final"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def phase_dir_name(index: int) -> str:
    """Checkpoint folder of phase `index` (`ProRLTrainer._get_output_dir` writes it, `latest_checkpoint` globs it)."""
    return f"phase-{index}"


def in_phase_dir(checkpoint: str | os.PathLike) -> bool:
    """Whether `checkpoint` sits in a phase folder (`<run>/phase-<i>/checkpoint-<step>`), i.e. was written by
    ProRLTrainer; its run folder is then two levels up."""
    return re.fullmatch(phase_dir_name(r"\d+"), Path(checkpoint).resolve().parent.name) is not None


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (`write_text_atomically`), so a crash never leaves a truncated state file."""
    write_text_atomically(path, json_text(data))


def json_text(data: Any) -> str:
    """The text `write_json` writes for `data`."""
    return json.dumps(data, indent=2, default=str)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Temporary file + rename: a kill or a full disk leaves the previous file (or none), never a truncated one; the
    temporary file of a failed write is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_tensors_atomically(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written as `write_text_atomically` writes text: the previous file or the new one, never a
    truncated one."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# What a resume reads from a checkpoint's `prorl_state.json` without a default; whole numbers >= 0.
STATE_COUNTS = ("phase_index", "phase_global_step", "global_step_offset", "resets")


def record_checkpoint_hashes(checkpoint: str | os.PathLike, commit_text: str) -> None:
    """Write `prorl_checkpoint_hashes.json` into a checkpoint HF has just written: the size and sha256 of every file
    in it (weights, optimizer.pt, scheduler.pt, rng_state*.pth, trainer_state.json, the sharded engines' subfolders),
    plus those of `commit_text`, the `prorl_state.json` about to be written. Called before that commit record, so a
    committed checkpoint always has its hashes; `verify_checkpoint` checks them at resume.

    Cost: the files are read once more (from the page cache the save just filled), streamed in 4 MiB blocks through
    sha256 at 0.7-1 GB/s on one core: the recipe's 100-600 MB of adapter and optimizer state add 0.1-0.8 s per save.
    Measured on a shared 2-core CPU box, 300 MB (an adapter and its Adam state): 0.37-0.43 s of hashing against
    1.05-1.5 s for `torch.save` of them plus a sync to local disk, about a third of that save (less where the disk
    is slower, e.g. network storage) and nothing against a GRPO step, which generates for seconds to minutes. Worth
    it: a damaged file would otherwise resume silently on other weights.
    """
    checkpoint = Path(checkpoint)
    files = {
        path.relative_to(checkpoint).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file()
        and path.relative_to(checkpoint).as_posix() not in (CHECKPOINT_HASHES_NAME, PRORL_STATE_NAME)
        and not (path.name.startswith(".") and path.name.endswith(".tmp"))  # a killed atomic write's leftover
    }
    files[PRORL_STATE_NAME] = {
        "bytes": len(commit_text.encode()),
        "sha256": hashlib.sha256(commit_text.encode()).hexdigest(),
    }
    write_json(checkpoint / CHECKPOINT_HASHES_NAME, {"files": files})


def verify_checkpoint(checkpoint: str | os.PathLike) -> str | None:
    """Check a checkpoint's files against its `prorl_checkpoint_hashes.json` before a resume loads any of them.

    A file that is missing, a folder, of another size (truncated) or another sha256 raises `RunFilesError` naming it
    and how to go on (the run's complete checkpoint before this one, if any). Returns a note for a checkpoint without
    hashes (written before checkpoints were hashed, or by TRL): it resumes unchecked, as it always did.
    """
    checkpoint = Path(checkpoint)
    record = checkpoint / CHECKPOINT_HASHES_NAME
    if not record.is_file():
        return (
            f"{checkpoint} has no {CHECKPOINT_HASHES_NAME} (written before checkpoints were hashed, or by TRL): its "
            "files are loaded unchecked."
        )
    try:
        files = json.loads(record.read_text())["files"]
        files = {str(name): (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
        files, problem, path = None, "is damaged (not the JSON a save writes)", record
    for relative, expected in sorted((files or {}).items()):  # expected: (bytes, sha256)
        path = checkpoint / relative
        if path.is_dir():
            problem = "is a folder, where the checkpoint saved a file"
        elif not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != expected[0]:
            problem = f"has {path.stat().st_size} bytes, the save wrote {expected[0]} (truncated or overwritten)"
        elif file_sha256(path) != expected[1]:
            problem = "changed since the save (its sha256 differs from the one recorded then)"
        else:
            continue
        break
    else:
        if files is not None:
            return None
    earlier = _checkpoint_before(checkpoint)
    retreat = (
        f"resume from the checkpoint before it (`--resume {earlier}`), or delete the folder {checkpoint}/ and "
        "resume from the latest one left (`--resume`)"
        if earlier is not None
        else f"or start the run again (`--overwrite`): {checkpoint} is the run's first checkpoint"
    )
    raise RunFilesError(
        f"{path} {problem}: {checkpoint} cannot be resumed as it is, and nothing was loaded. Put the file back "
        f"(from a copy of the run folder), {retreat}."
    )


def _checkpoint_before(checkpoint: Path) -> Path | None:
    """The committed checkpoint of `checkpoint`'s run folder just before it (by phase, then step), or None. Ordered by
    folder names, reading no state file: it names a way on from a checkpoint whose files may be damaged."""
    if not in_phase_dir(checkpoint):
        return None
    checkpoint = checkpoint.resolve()
    phase = re.compile(phase_dir_name(r"(\d+)"))

    def order(path: Path) -> tuple[int, int]:
        return int(phase.fullmatch(path.parent.name).group(1)), int(_CHECKPOINT_RE.match(path.name).group(1))

    earlier = [
        path
        for path in checkpoint.parent.parent.glob(f"{phase_dir_name('*')}/{PREFIX_CHECKPOINT_DIR}-*")
        if phase.fullmatch(path.parent.name) and _CHECKPOINT_RE.match(path.name) and (path / PRORL_STATE_NAME).is_file()
        and order(path) < order(checkpoint)
    ]  # fmt: skip
    return max(earlier, key=order) if earlier else None


def read_prorl_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's `prorl_state.json`; `UnreadableFileError` (exit 2) when it is damaged: not a JSON object, or
    without the whole numbers a resume reads (`STATE_COUNTS`)."""
    from ..files import UnreadableFileError, read_json

    path = Path(checkpoint) / PRORL_STATE_NAME
    if not path.is_file() and not path.is_dir():
        raise FileNotFoundError(
            f"{checkpoint} has no {PRORL_STATE_NAME}: it was not written by ProRLTrainer (or the save was "
            "interrupted). Resume from a checkpoint under <output_dir>/phase-<i>/checkpoint-<step>/."
        )
    fix = (
        f"It is the commit record of the checkpoint {checkpoint}; nothing was loaded or changed. Move that checkpoint "
        "folder out of the run folder (an earlier complete checkpoint is then the latest) or pass --resume with an "
        "earlier one; or start again with --overwrite."
    )
    state = read_json(path, dict, fix)
    bad = [key for key in STATE_COUNTS if not _is_count(state.get(key))]
    if bad:
        raise UnreadableFileError(path, f"is damaged: {', '.join(bad)} missing or not a whole number >= 0", fix)
    return state


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def complete_checkpoints(output_dir: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """Every complete ProRL checkpoint under `<output_dir>/phase-*/checkpoint-*`, oldest first (by phase, then step).

    `prorl_state.json` is the commit record: it is written last (after HF's files and the log history), so a
    checkpoint folder without it was interrupted mid-save and is not a checkpoint.
    """
    found = []
    for phase_dir in Path(output_dir).glob(phase_dir_name("*")):
        for checkpoint in phase_dir.iterdir() if phase_dir.is_dir() else []:
            match = _CHECKPOINT_RE.match(checkpoint.name)
            if match and (checkpoint / PRORL_STATE_NAME).is_file():
                state = read_prorl_state(checkpoint)
                found.append(((state["phase_index"], int(match.group(1))), checkpoint, state))
    return [(checkpoint, state) for _, checkpoint, state in sorted(found, key=lambda item: item[0])]


def prune_committed_checkpoints(phase_dir: str | os.PathLike, keep: int | None, protected: Any = ()) -> list[Path]:
    """`save_total_limit` for one phase folder, applied after a commit: delete its oldest complete checkpoints
    beyond `keep`, never the newest complete one nor a `protected` path (the best model's). Only complete
    checkpoints count and go: HF prunes before the new one is committed, so a kill there left a phase with none.
    Returns the folders deleted (all the run's own `checkpoint-<step>` folders)."""
    if not keep or keep <= 0:
        return []
    ordered = sorted(
        (int(match.group(1)), path)
        for path in Path(phase_dir).iterdir()
        if (match := _CHECKPOINT_RE.match(path.name)) and path.is_dir() and not path.is_symlink()
        and (path / PRORL_STATE_NAME).is_file()
    )  # fmt: skip
    keep_paths = {ordered[-1][1].resolve()} if ordered else set()
    keep_paths |= {Path(path).resolve() for path in protected if path}
    deleted, left = [], len(ordered)
    for _, path in ordered:
        if left <= max(keep, len(keep_paths)):
            break
        if path.resolve() not in keep_paths:
            shutil.rmtree(path)
            deleted.append(path)
            left -= 1
    return deleted


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The most advanced complete ProRL checkpoint under `<output_dir>/phase-*/checkpoint-*` (by phase, then step)."""
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1][0] if checkpoints else None


def finished_state(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The state saved with `<output_dir>/final/` when the run finished (every phase done), else None.

    `final/` is written atomically with its `prorl_state.json` inside, so the file exists only for a finished run.
    """
    from ..files import read_json

    path = Path(output_dir) / FINAL_DIR_NAME / PRORL_STATE_NAME
    if not path.is_file() and not path.is_dir():
        return None
    fix = (
        f"It marks the run finished ({FINAL_DIR_NAME}/ holds its final model); nothing was loaded or changed. Restore "
        f"it from a copy of the run, or move {FINAL_DIR_NAME}/ out of the run folder to resume from the latest "
        "checkpoint, or start again with --overwrite."
    )
    return read_json(path, dict, fix)


def supersede_after(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> list[Path]:
    """Resuming from an older `checkpoint` than the latest abandons what came after it: un-commit those checkpoints
    (and a finished run's `final/` marker) by renaming their `prorl_state.json`, so a later "resume from the latest"
    cannot pick a state of the abandoned continuation. Nothing is deleted. Returns the folders changed."""
    checkpoint = Path(checkpoint).resolve()
    ordered = [path for path, _ in complete_checkpoints(output_dir)]
    if checkpoint not in [path.resolve() for path in ordered]:
        return []
    later = ordered[[path.resolve() for path in ordered].index(checkpoint) + 1 :]
    final = Path(output_dir) / FINAL_DIR_NAME
    if (final / PRORL_STATE_NAME).is_file():
        later.append(final)
    for folder in later:
        os.replace(folder / PRORL_STATE_NAME, folder / SUPERSEDED_STATE_NAME)
    return later


def uncommit(checkpoint: str | os.PathLike) -> None:
    """Remove a checkpoint's commit record before its files are rewritten in place (HF saves into the same folder),
    so a kill during the rewrite cannot leave a mix of two saves that looks complete."""
    Path(checkpoint, PRORL_STATE_NAME).unlink(missing_ok=True)


def load_optimizer_state(optimizer: Any, checkpoint: str | os.PathLike) -> None:
    """Load `optimizer.pt` of an HF checkpoint into `optimizer`, as HF's resume does for single-device/DDP runs (read
    on the CPU; `load_state_dict` moves the state to the parameters' device)."""
    from transformers.trainer import OPTIMIZER_NAME

    optimizer.load_state_dict(torch.load(Path(checkpoint) / OPTIMIZER_NAME, map_location="cpu", weights_only=True))


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
    model, under every engine (FSDP2 shards, ZeRO-3 partitions: collective there, see `gathered.load_state_`).
    Every base tensor must be present: a partial load would silently mix two bases.
    """
    base = base_model_of(model)
    missing = load_state_(base, _read_weights(Path(path)))
    tied = getattr(base.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing:
        raise ValueError(f"The merged save at {path} lacks base weights, e.g. {missing[:5]}; it does not fit this model.")
