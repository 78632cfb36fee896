"""Portable runs: the paths a run's state records, relative to its run folder, and what proves that the files a resume
loads are the ones its checkpoint was made from.

A run folder may be moved or copied (`mv runA runB`) between a kill and its `--resume`. Every path recorded in
`prorl_state.json` is therefore relative to the run folder and resolved against the folder the checkpoint is in now
(`resolve_in_run`); an absolute path from an older run is read only when it lies inside that folder, never another
run's. At each hard reset the run records the sha256 of what a resume will load (the frozen factors file, or the
merged base's weight files: `file_hashes`), and the identity of the base model the deltas sit on, with the files its
tokenizer loads from (`base_model_identity`); a resume checks both (`verify_files`, `base_model_difference`) and
refuses a mismatch, which would otherwise train on a different policy (or other token ids) without a word.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

# The weight files of a `save_pretrained` folder (what `checkpoint.load_merged_base` reads, and what a base model
# fingerprint samples).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
# The files a tokenizer (or its chat template) is loaded from, those a folder has; each is hashed whole (a few MiB).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.txt", "spiece.model",
)  # fmt: skip
# Base model fingerprint: bytes read at each end of a weight file and the number of evenly spaced chunks between.
_EDGE_BYTES = 1 << 20
_SAMPLED_CHUNKS = 16
_CHUNK_BYTES = 1 << 16


class RunFilesError(ValueError):
    """A resume would load files that are not the ones its checkpoint was made from (or a different base model).
    The CLI prints the message and exits 2 (bad input: nothing was trained)."""

    exit_status = 2


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files (and shard indexes) of a `save_pretrained` folder, sorted by name."""
    folder = Path(folder)
    return sorted({path for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern) if path.is_file()})


def file_hashes(path: str | os.PathLike, run_dir: str | os.PathLike) -> dict[str, str]:
    """sha256 of what a resume loads from `path` (a file, or every weight file of a merged save folder), keyed by the
    path relative to `run_dir`. The whole bytes are hashed: a merged base differs from another run's everywhere, but
    a truncated or partly copied file may differ only at its end."""
    path, run_dir = Path(path), Path(run_dir)
    files = [path] if path.is_file() else weight_files(path)
    return {run_relative(file, run_dir): file_sha256(file) for file in files}


def verify_files(hashes: dict[str, str], run_dir: Path, checkpoint: Path, what: str) -> None:
    """Refuse a resume whose recorded files (`hashes`, from `file_hashes`) are missing or changed in `run_dir`."""
    for relative, expected in sorted(hashes.items()):
        path = run_dir / relative
        if os.path.isabs(relative) or not is_inside(path, run_dir):
            raise RunFilesError(
                f"{checkpoint}/prorl_state.json records the sha256 of {relative}, outside the run folder {run_dir}/ "
                "(a run records only its own files: the file is damaged or was edited). Nothing was loaded."
            )
        if not path.is_file():
            raise RunFilesError(
                f"{checkpoint} needs {what} at {path}, which is {'a folder' if path.is_dir() else 'missing'}. Resume the run folder the checkpoint was "
                "written in, whole (a moved or copied run folder must keep its frozen/ and merged/ folders)."
            )
        if file_sha256(path) != expected:
            raise RunFilesError(
                f"{path} is not the file {checkpoint} was made from ({what}; its sha256 differs from the one recorded "
                "at the reset): it was replaced or changed since, e.g. by another run's file or a partial copy. "
                "Nothing was loaded. Put the run's own file back (copy the whole run folder again), or resume from a "
                "checkpoint written before that reset (`--resume <run>/phase-<i>/checkpoint-<step>`)."
            )


def run_relative(path: str | os.PathLike, run_dir: str | os.PathLike) -> str:
    """`path` relative to `run_dir` (POSIX spelling), as a run's state records it; `path` must lie inside it."""
    return Path(os.path.relpath(Path(path).resolve(), Path(run_dir).resolve())).as_posix()


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def resolve_in_run(recorded: str, run_dir: Path, checkpoint: Path, key: str) -> Path:
    """A path a checkpoint's state recorded under `key`, resolved against the run folder the checkpoint is in now.

    Relative paths (every run since run folders are portable) are joined to `run_dir`. An absolute path (older runs)
    is used only when it lies inside `run_dir`: one outside is another folder's file (the run was moved or copied,
    and another run's may sit at the old place), so it is refused rather than loaded.
    """
    if not isinstance(recorded, str) or not recorded:
        raise RunFilesError(f"{checkpoint}/prorl_state.json is damaged: `{key}` is {recorded!r}, not a path.")
    path = Path(recorded)
    if not path.is_absolute():
        if not is_inside(run_dir / path, run_dir):  # `../other-run/merged/reset-1`: never read, whoever wrote it
            raise RunFilesError(
                f"{checkpoint}/prorl_state.json records `{key}` as {recorded}, which leads out of the run folder "
                f"{run_dir}/. Nothing was loaded: a run reads its deltas from its own folder only. The file is "
                "damaged or was edited: restore it from a copy of the run, or resume from another checkpoint."
            )
        return run_dir / path
    if is_inside(path, run_dir):
        return path
    own = run_dir / path.parent.name / path.name
    fix = (
        f" This run folder's own copy is {own}: if the run was moved or copied, set `{key}` to "
        f'"{path.parent.name}/{path.name}" (relative to the run folder) in {checkpoint}/prorl_state.json and resume.'
        if own.exists()
        else ""
    )
    raise RunFilesError(
        f"{checkpoint}/prorl_state.json records `{key}` as {path}, outside the run folder {run_dir}/ (a run written "
        f"before run folders were portable, then moved or copied). Nothing was loaded: that path may hold another "
        f"run's weights.{fix}"
    )


def base_model_identity(
    name_or_path: str, revision: str | None, commit: str | None, run_dir: Path,
    tokenizer_name_or_path: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What identifies the base model a run's LoRA deltas sit on (recorded in every checkpoint).

    A hub model is its name, revision and the snapshot's commit (`config._commit_hash`). A local folder is a
    `fingerprint`: sha256 over its `config.json` and, per weight file, its name, size, first and last MiB and 16
    chunks of 64 KiB evenly spaced between. That reads a few MiB whatever the model's size (a full hash of a 7B
    model would read 15-30 GB at every start), survives a copy (mtimes do not), and tells two checkpoints of one
    architecture apart (their sizes are equal, but training changes every tensor, so the sampled bytes differ). A
    folder inside the run folder (a distilled student) is recorded relative to it.

    The tokenizer, loaded from `tokenizer_name_or_path` (None: the model's folder; "": built in memory), is recorded
    apart when it is a local folder: the sha256 of each of its files (`tokenizer_files`), and the folder when it is
    not the model's. Apart, so the fingerprint keeps its meaning for runs recorded before tokenizers were, and a
    resume can name the file that changed.
    """
    identity: dict[str, Any] = {"name_or_path": name_or_path, "revision": revision, "commit": commit}
    folder = Path(name_or_path) if name_or_path else None
    if folder is not None and folder.is_dir():
        identity["fingerprint"] = folder_fingerprint(folder)
        if is_inside(folder, run_dir):
            identity["name_or_path"] = run_relative(folder, run_dir)
    if tokenizer_name_or_path is None:
        tokenizer = folder
    else:  # "": a tokenizer built in memory, nothing to record
        tokenizer = Path(tokenizer_name_or_path) if tokenizer_name_or_path else None
    hashes = tokenizer_files(tokenizer) if tokenizer is not None and tokenizer.is_dir() else {}
    if hashes:  # none for a hub tokenizer (not recorded)
        identity["tokenizer_files"] = hashes
        if folder is None or tokenizer.resolve() != folder.resolve():
            inside = is_inside(tokenizer, run_dir)
            identity["tokenizer_name_or_path"] = run_relative(tokenizer, run_dir) if inside else str(tokenizer)
    return identity


def tokenizer_files(folder: Path) -> dict[str, str]:
    """sha256 of each tokenizer file (`TOKENIZER_FILES`) that `folder` holds, keyed by its name in the folder."""
    return {name: file_sha256(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}


def folder_fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in weight_files(folder):
        size = path.stat().st_size
        digest.update(json.dumps([path.name, size]).encode())
        with open(path, "rb") as stream:
            if size <= 2 * _EDGE_BYTES + _SAMPLED_CHUNKS * _CHUNK_BYTES:
                digest.update(stream.read())
                continue
            offsets = [0] + [
                _EDGE_BYTES + i * (size - 2 * _EDGE_BYTES - _CHUNK_BYTES) // (_SAMPLED_CHUNKS - 1)
                for i in range(_SAMPLED_CHUNKS)
            ]
            for offset in offsets:
                stream.seek(offset)
                digest.update(stream.read(_EDGE_BYTES if offset == 0 else _CHUNK_BYTES))
            stream.seek(size - _EDGE_BYTES)
            digest.update(stream.read())
    return digest.hexdigest()


def base_model_difference(recorded: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """How the base model of a resume differs from the one its checkpoint recorded (None: the same, or unknown).

    Local folders compare by fingerprint only (a moved model folder is the same model); hub models by commit when
    both are known, else by name and revision. Then the tokenizer files (`tokenizer_difference`).
    """
    if not recorded:
        return None  # a checkpoint from before base models were recorded
    return _weights_difference(recorded, current) or tokenizer_difference(recorded, current)


def _weights_difference(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    if recorded.get("fingerprint") and current.get("fingerprint"):
        if recorded["fingerprint"] == current["fingerprint"]:
            return None
        return (
            f"the base model folder {current['name_or_path']} holds other weights or another config than "
            f"{recorded['name_or_path']} had when the checkpoint was written"
        )
    names = (recorded.get("name_or_path") or "", current.get("name_or_path") or "")
    if not all(names):
        return None  # a model object built in memory: nothing recorded to compare
    if names[0] != names[1] or bool(recorded.get("fingerprint")) != bool(current.get("fingerprint")):
        return f"the checkpoint was made on {names[0]}, this run loads {names[1]}"
    if recorded.get("commit") and current.get("commit") and recorded["commit"] != current["commit"]:
        return f"{names[1]} is now at commit {current['commit']}, the checkpoint was made on {recorded['commit']}"
    if (recorded.get("revision") or "main") != (current.get("revision") or "main"):
        return f"the checkpoint was made on revision {recorded.get('revision')}, this run has {current.get('revision')}"
    return None


def tokenizer_difference(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Which tokenizer files differ from those the checkpoint recorded, by sha256 (None: the same, or unknown).

    Compared only when both sides recorded them: a checkpoint written before tokenizers were recorded, or a
    tokenizer that is not a local folder now (a hub name, one built in memory), has nothing to compare. A file
    added or removed is a difference: it changes what the tokenizer loads.
    """
    old, new = recorded.get("tokenizer_files"), current.get("tokenizer_files")
    if not isinstance(old, dict) or not old or not new:
        return None
    changed = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
    if not changed:
        return None
    folder = current.get("tokenizer_name_or_path") or current["name_or_path"]
    how = ["changed" if name in old and name in new else "added" if name in new else "removed" for name in changed]
    files = ", ".join(f"{Path(folder) / name} ({what})" for name, what in zip(changed, how))
    return (
        f"this run's tokenizer files differ (by sha256) from those the checkpoint was written with: {files}; the same "
        "text would map to other token ids. Put the run's own tokenizer files back (or point "
        "`model.tokenizer_name_or_path` at a copy of them)"
    )
