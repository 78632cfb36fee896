"""What a command may do in its output folder, whatever it does there: which entries are its own (its manifest,
`manifest.py`), which are other files, and the refusals every command applies before any work.

`train` (`prorl_trl.recipe.output_folder`), `ablate` and `distill` start only in a folder holding nothing but their
own outputs, unless `--allow-other-files`; the filesystem root, `$HOME` and the folders above it are refused even then
(a command writes and deletes at the top of its folder); a folder whose manifest another command wrote is refused
whatever the flags. Here, below both `recipe` and `distill`, so each can use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .manifest import MANIFEST_NAME, TRAIN, OutputKind, is_leftover_of, manifest_kind, owned_outputs


class OutputFolderError(ValueError):
    """The output folder holds a run (or files) and the command did not say what to do with it (exit 2)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)

    def render(self) -> str:
        return self.message


@dataclass
class FolderState:
    """What `inspect_output_folder` found, as paths relative to `path` (folders end in `/`). `outputs`: the run's
    outputs present (from its manifest, else by the exact names of a run from before manifests); `leftovers`:
    temporary files of the run's interrupted writes; `foreign`: everything else (the run did not write it)."""

    path: Path
    outputs: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    latest_checkpoint: Path | None = None
    checkpoint_state: dict[str, Any] | None = None
    finished: dict[str, Any] | None = None
    damaged: Exception | None = None  # a run file a resume reads is damaged (`UnreadableFileError`): a resume stops

    @property
    def used(self) -> bool:
        return bool(self.outputs)

    def describe(self) -> str:
        """One line: empty, finished, resumable from where, or outputs without a checkpoint yet."""
        if not self.used:
            return f"{self.path}/ holds no run yet"
        if self.finished:
            return (
                f"{self.path}/ holds a finished run (final/ written at global step {self.finished.get('global_step')}, "
                f"{self.finished.get('resets')} resets)"
            )
        if self.latest_checkpoint is not None:
            return f"{self.path}/ holds an unfinished run; latest complete checkpoint: {describe_checkpoint(self)}"
        return f"{self.path}/ holds outputs of a run that wrote no complete checkpoint ({shown(self.outputs)})"


def describe_checkpoint(state: FolderState) -> str:
    saved = state.checkpoint_state or {}
    return (
        f"{state.latest_checkpoint} (phase {saved.get('phase_index', 0) + 1} '{saved.get('phase_name')}', "
        f"global step {saved.get('global_step')}, {saved.get('resets')} resets)"
    )


def shown(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def sort_folder(path: Path, kind: OutputKind = TRAIN) -> FolderState:
    """`path`'s entries as `kind`'s outputs (its manifest's, else `kind.legacy`'s), leftovers and foreign ones.
    Raises `OutputFolderError` when another command's manifest is there: its outputs are not `kind`'s to use, and
    one manifest cannot tell two commands' outputs apart."""
    state = FolderState(path=path)
    if not path.is_dir():
        return state
    found = manifest_kind(path)
    if found not in (None, kind.name):
        raise OutputFolderError(
            f"{path}/ holds the outputs of `prorl-trl {found}` (its {MANIFEST_NAME} says so), and `prorl-trl "
            f"{kind.name}` never writes among another command's outputs, whatever the flags. Nothing was changed. "
            f"Choose a new or empty {kind.option}."
        )
    owned, _ = owned_outputs(path, kind)
    state.outputs = sorted(name for name in owned if os.path.lexists(path / name.rstrip("/")))
    _sort_out(path, "", {name.rstrip("/") for name in owned}, owned, state)
    return state


def _sort_out(folder: Path, prefix: str, owned: set[str], recorded: list[str], state: FolderState) -> None:
    """Sort the entries of `folder` that are not the run's outputs into leftovers and foreign ones; descend only
    into real folders that hold a recorded path (`runs/` holding the run's own TensorBoard folder)."""
    for child in sorted(folder.iterdir()):
        name = prefix + child.name
        if name in owned or name == MANIFEST_NAME:
            continue
        if is_leftover_of(name, recorded):
            state.leftovers.append(name + ("/" if child.is_dir() and not child.is_symlink() else ""))
        elif child.is_dir() and not child.is_symlink() and any(path.startswith(name + "/") for path in owned):
            _sort_out(child, name + "/", owned, recorded, state)
        else:
            state.foreign.append(name + ("/" if child.is_dir() else ""))


def refuse_shared_folder(output_dir: str | Path, option: str = TRAIN.option) -> None:
    """Refuse the filesystem root, `$HOME` and any folder above it (symlinks resolved), whatever the flags: a run
    writes, and `--overwrite` deletes, at the top of its folder."""
    path = Path(output_dir).resolve()
    home = Path(os.path.expanduser("~")).resolve()
    if path.parent == path:
        what = "the filesystem root"
    elif path == home:
        what = "your home folder ($HOME)"
    elif home.is_relative_to(path):
        what = f"a folder that holds your home folder ({home})"
    else:
        return
    raise OutputFolderError(
        f"{option} {output_dir} is {what}. A run never writes there (not even with --allow-other-files): "
        f"it writes and deletes files at the top of its folder. Nothing was changed. Choose a folder of its own, "
        f"e.g. {option} {home / 'runs' / 'my-run'}."
    )


def check_other_files(
    state: FolderState, allow_other_files: bool, writes: Iterable[str], kind: OutputKind = TRAIN
) -> None:
    """A run starts only in a folder holding nothing but its own outputs, unless `allow_other_files`; a file named
    like one the run writes (its `phase-0/`, `README.md`, ...) is refused even then: the run would write over it."""
    if not state.foreign:
        return
    written = {name.rstrip("/") for name in (*kind.writes, *writes)}
    clashes = [
        name for name in state.foreign
        if "/" not in name.rstrip("/")
        and (name.rstrip("/") in written or (kind.pattern and kind.pattern.fullmatch(name.rstrip("/"))))
    ]  # fmt: skip
    if clashes:
        doing = "training" if kind is TRAIN else f"prorl-trl {kind.name}"
        raise OutputFolderError(
            f"{state.path}/ holds {shown(clashes)}, named like outputs this run writes, but not written by a run "
            f"(not in {MANIFEST_NAME}): {doing} would write over them. Nothing was changed. Move them out of the "
            f"folder, or choose another {kind.option}."
        )
    if not allow_other_files:
        kept = (
            f"--overwrite deletes only what a run recorded in {MANIFEST_NAME}" if kind is TRAIN
            else f"prorl-trl {kind.name} writes and deletes only what it records in {MANIFEST_NAME}"
        )  # fmt: skip
        raise OutputFolderError(
            f"{state.path}/ holds files this run did not write: {shown(state.foreign)}. Nothing was changed. Choose a "
            f"new or empty {kind.option}, or pass --allow-other-files to start the run among them (they are kept: "
            f"{kept})."
        )


def check_output_folder(
    output_dir: str | Path, kind: OutputKind, writes: Iterable[str] = (), allow_other_files: bool = False
) -> FolderState:
    """`ablate`'s and `distill`'s `--out`, before any work: the filesystem root, `$HOME`, a file, another command's
    folder and a file named like one the command writes (`kind.writes`, `writes`) are refused whatever the flags;
    other files need `allow_other_files` unless the folder already holds the command's own outputs (a re-run, like
    `train --resume`, needs no flag). Raises `OutputFolderError`; returns the folder's state."""
    refuse_shared_folder(output_dir, kind.option)
    path = Path(output_dir)
    if os.path.lexists(path) and not path.is_dir():
        raise OutputFolderError(
            f"{kind.option} {output_dir} is a file, not a folder: prorl-trl {kind.name} writes a folder there. "
            f"Nothing was changed. Choose a folder path, or move the file."
        )
    state = sort_folder(path, kind)
    check_other_files(state, allow_other_files or state.used, writes, kind)
    return state
