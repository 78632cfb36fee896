"""The state of a run's output folder, and what `train` may do with it: start, resume, overwrite, or refuse.

A folder that already holds a run is never trained into silently: `train` refuses it (exit 2, before anything is
loaded) unless `--resume` (continue from the latest complete checkpoint, or start if there is none yet) or
`--overwrite` (delete that run's outputs, and only those, then start). `validate` shows the same state.

What is "the run's" is what it recorded in its manifest (`prorl_trl.trainer.manifest`), never a name pattern:
`--overwrite` deletes exactly those paths and never deletes through a symlink that leads out of the run folder. A
run starts (fresh or over an old one) only in a folder holding nothing else, unless `--allow-other-files`; the
filesystem root, `$HOME` and the folders above it are refused even then (a run writes and deletes at the top of its
folder).

`ablate` and `distill` guard their `--out` the same way (`trainer.output_guard.check_output_folder`, with the folder's
state and the refusals every command shares): their own folder is used again (a re-run skips or reuses what is done),
anything else there needs `--allow-other-files`, and a folder whose manifest another command wrote is refused
whatever the flags.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import UnreadableFileError
from ..trainer.manifest import MANIFEST_NAME, read_tracker_ids
from ..trainer.output_guard import (
    FolderState,
    OutputFolderError,
    check_other_files,
    describe_checkpoint,
    refuse_shared_folder,
    sort_folder,
)

# Flags of one start, not of a resume (`--allow-changes` confirms one resume's changes; they are recorded then).
RUN_FLAGS = ("--overwrite", "--allow-other-files", "--allow_other_files", "--allow-changes", "--allow_changes")


def inspect_output_folder(path: str | Path) -> FolderState:
    from ..reset.checkpoint import finished_state, latest_checkpoint, read_prorl_state

    state = sort_folder(Path(path))
    if not state.used:
        return state
    try:  # --overwrite deletes a run whose state files are damaged; a resume stops (`plan_start`)
        state.finished = finished_state(path)
        state.latest_checkpoint = latest_checkpoint(path)
        if state.latest_checkpoint is not None:
            state.checkpoint_state = read_prorl_state(state.latest_checkpoint)
        read_tracker_ids(path)
    except UnreadableFileError as error:
        state.damaged = error
    return state


def run_writes(recipe: Any) -> list[str]:
    """The outputs that only some runs write (`distill/` for a `distill:` section, TRL's `completions/` with
    `log_completions`), for `plan_start`'s check of files named like them."""
    training = getattr(recipe, "training", None) or {}
    return (["distill/"] if getattr(recipe, "distill", None) else []) + (
        ["completions/"] if training.get("log_completions") else []
    )


@dataclass
class StartPlan:
    """How `train` starts: `resume` is what `ProRLTrainer.train(resume_from_checkpoint=...)` gets (None: from the
    beginning); `finished` means there is nothing to do; `overwrite` means the old outputs are deleted first."""

    state: FolderState
    resume: str | None = None
    finished: bool = False
    overwrite: bool = False
    note: str | None = None


def plan_start(
    output_dir: str | Path,
    resume: str | bool | None = None,
    overwrite: bool = False,
    allow_other_files: bool = False,
    writes: Iterable[str] = (),
) -> StartPlan:
    """Decide how a run starts in `output_dir`. Raises `OutputFolderError` for the filesystem root or `$HOME`, a
    used folder with neither `resume` nor `overwrite`, both at once, a `resume` path that is not a complete
    checkpoint, and a run starting (fresh or `overwrite`) among files it did not write without `allow_other_files`.

    `resume=True` (`--resume`): the latest complete checkpoint; none yet (killed before the first one) starts from
    the beginning; a finished run is reported finished (`train` then extends it when the recipe asks for more steps,
    `recipe.extend`). `writes`: `run_writes(recipe)`.
    """
    refuse_shared_folder(output_dir)
    state = inspect_output_folder(output_dir)
    if resume and overwrite:
        raise OutputFolderError("--resume and --overwrite contradict each other; pass one.")
    if overwrite:
        check_other_files(state, allow_other_files, writes)
        return StartPlan(state, overwrite=state.used)
    if resume is True and state.damaged is not None:  # an explicit CHECKPOINT is read below
        raise state.damaged
    if resume is True:
        if state.finished:
            return StartPlan(state, finished=True)
        if state.latest_checkpoint is None:
            if not state.used:  # nothing to resume: a fresh start
                check_other_files(state, allow_other_files, writes)
                return StartPlan(state)
            # Only names this run writes over: a resume needs no --allow-other-files (the printed command drops it)
            check_other_files(state, True, writes)
            note = (
                f"no complete checkpoint in {state.path}/ yet: starting from the beginning "
                "(files of the earlier attempt are rewritten as the run goes)"
            )
            return StartPlan(state, note=note)
        return StartPlan(state, resume=str(state.latest_checkpoint), note=f"resuming from {describe_checkpoint(state)}")
    if resume:
        from ..reset.checkpoint import PRORL_STATE_NAME, read_prorl_state

        checkpoint = Path(str(resume))
        if not (checkpoint / PRORL_STATE_NAME).is_file():
            raise OutputFolderError(
                f"--resume {checkpoint}: not a complete ProRL checkpoint (no {PRORL_STATE_NAME}; an interrupted "
                f"save has none). Complete checkpoints are <output_dir>/phase-<i>/checkpoint-<step>/; pass --resume "
                "alone for the latest one."
            )
        read_prorl_state(checkpoint)  # damaged: exit 2 now, before anything is loaded
        read_tracker_ids(state.path)
        return StartPlan(state, resume=str(checkpoint), note=f"resuming from {checkpoint}")
    if state.used:
        raise OutputFolderError(
            f"{state.describe()}. Nothing was changed. Pass --resume to continue it"
            + (
                " (it is finished: --resume says so and exits; with more steps in its last phase or more phases, "
                "--resume --allow-changes extends it)"
                if state.finished
                else ""
            )
            + ", or --overwrite to delete its outputs and start again, or choose another --training.output_dir."
        )
    check_other_files(state, allow_other_files, writes)
    return StartPlan(state)


def delete_run_outputs(state: FolderState) -> tuple[list[str], list[str]]:
    """`--overwrite`: delete the run's outputs and leftovers listed in `state`, then its manifest; nothing else.

    Returns (deleted, kept). A path reached through a symlink that leads out of the run folder is kept (a `runs/`
    linked into a shared TensorBoard folder: nothing is deleted there); a recorded path that is itself a symlink
    loses the link only. Folders left empty by a deletion (`runs/`) are removed, up to the run folder.
    """
    root = state.path.resolve()
    deleted, kept = [], []
    for name in state.outputs + state.leftovers:
        target = state.path / name.rstrip("/")
        clean = not Path(name).is_absolute() and ".." not in Path(name).parts
        inside = clean and target.parent.resolve().is_relative_to(root)
        if not inside or target.resolve() == root:  # `..` or the run folder itself: never deleted, whoever named it
            kept.append(name)
            continue
        if target.is_symlink():  # the link goes; what it points to is not the run's to delete, and the message says so
            target.unlink()
            deleted.append(f"{name} (a symlink: the link removed and its target kept)")
            continue
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
        deleted.append(name)
        parent = target.parent
        while parent != state.path and not parent.is_symlink() and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    (state.path / MANIFEST_NAME).unlink(missing_ok=True)
    return deleted, kept


def split_run_flags(tokens: list[str], after_recipe: bool = True) -> tuple[str | bool | None, bool, list[str]]:
    """`--resume [CHECKPOINT]` / `--resume=CHECKPOINT` and `--overwrite` among command-line tokens (after RECIPE,
    argparse hands them over with the overrides); returns (resume, overwrite, the other tokens in order).
    `--allow-other-files` is dropped too: it lets a run start, and a resume of that run does not need it.
    `after_recipe=False`: the tokens start before RECIPE, and, as `train` reads them (`cli.split_options`), `--resume`
    takes the next word as its checkpoint only once RECIPE has been seen (`train --resume RECIPE` resumes RECIPE)."""
    resume, overwrite, rest, index, recipe_seen = None, False, [], 0, after_recipe
    while index < len(tokens):
        token = tokens[index]
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if token in RUN_FLAGS:
            overwrite = overwrite or token == "--overwrite"
        elif token == "--resume":
            if recipe_seen and following is not None and not following.startswith("--"):
                resume, index = following, index + 1
            else:
                resume = True
        elif token.startswith("--resume="):
            resume = token.split("=", 1)[1]
        elif token.startswith("--") and "=" not in token and following is not None and not following.startswith("--"):
            rest += [token, following]  # an override and its value
            index += 1
        else:
            rest.append(token)
            recipe_seen = recipe_seen or not token.startswith("-")
        index += 1
    return resume, overwrite, rest


def resume_command(launcher_argv: list[str] | None = None, argv: list[str] | None = None) -> str:
    """The command that continues this run: as it was launched (`accelerate launch ...` or `torchrun ...` when the
    parent process is that launcher, so the resumed run has the same processes, else this process's own command
    line), with `--overwrite`/`--allow-other-files`/`--resume ...` replaced by `--resume`. Under `prorl-trl launch`
    (which names its command line in the environment, `prorl_trl.launch.LAUNCH_ARGV_ENV`) that command."""
    argv = list(sys.argv if argv is None else argv)
    launcher_argv = list(launcher_argv or [])
    launchers = ("accelerate", "accelerate.commands.launch", "torchrun", "torch.distributed.run")
    if os.environ.get("PRORL_LAUNCH_ARGV"):
        command = json.loads(os.environ["PRORL_LAUNCH_ARGV"])
    elif any(part in launchers or Path(part).name in launchers for part in launcher_argv) and "train" in launcher_argv:
        command = launcher_argv
    else:
        program = ["prorl-trl"] if Path(argv[0]).name == "prorl-trl" else [sys.executable, "-m", "prorl_trl"]
        command = program + argv[1:]
    if "train" in command:
        at = command.index("train") + 1
        _, _, rest = split_run_flags(command[at:], after_recipe=False)
        command = command[:at] + rest
    return shlex.join(command + ["--resume"])


def is_disk_full(error: BaseException, folder: str | Path) -> bool:
    """Whether `error` (or an error it came from) is a full disk: ENOSPC, or a write failure of torch's or
    safetensors' writers (which do not keep the errno) while `folder`'s disk has less than 64 MiB free."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if "No space left on device" in text or "StorageFull" in text or "os error 28" in text:
            return True
        if any(marker in text for marker in ("file write failed", "basic_ios::clear", "unexpected pos")):
            return free_bytes(folder) < 64 * 2**20
        current = current.__cause__ or current.__context__
    return False


def free_bytes(folder: str | Path) -> int:
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
