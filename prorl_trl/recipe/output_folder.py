"""The state of a run's output folder, and what `train` may do with it: start, resume, overwrite, or refuse.

A folder that already holds a run is never trained into silently: `train` refuses it (exit 2, before anything is
loaded) unless `--resume` (continue from the latest complete checkpoint, or start if there is none yet) or
`--overwrite` (delete that run's outputs, and only those, then start). `validate` shows the same state.
"""

from __future__ import annotations

import errno
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schema import RecipeError

# What a run writes into its output folder (names and glob patterns); `--overwrite` deletes these and nothing else.
RUN_OUTPUTS = (
    "phase-*",
    "merged",
    "final",
    ".final.*",
    "recipe.yaml",
    "run_summary.json",
    "prorl_log_history.json",
    "prorl_trackers.json",
    ".prorl_*.json.tmp",
    ".recipe.yaml.tmp",
    ".run_summary.json.tmp",
    "runs/*/events.out.tfevents.*",  # TensorBoard (only its event folders: `runs/` often holds other runs)
    "completions",
    "distill",
)


class OutputFolderError(RecipeError):
    """The output folder holds a run and the command did not say what to do with it (exit 2)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__("command line", [])

    def render(self) -> str:
        return self.message


@dataclass
class FolderState:
    """What `inspect_output_folder` found. `outputs`: the run outputs present (names relative to `path`)."""

    path: Path
    outputs: list[str] = field(default_factory=list)
    latest_checkpoint: Path | None = None
    checkpoint_state: dict[str, Any] | None = None
    finished: dict[str, Any] | None = None

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
        shown = ", ".join(self.outputs[:6]) + (", ..." if len(self.outputs) > 6 else "")
        return f"{self.path}/ holds outputs of a run that wrote no complete checkpoint ({shown})"


def describe_checkpoint(state: FolderState) -> str:
    saved = state.checkpoint_state or {}
    return (
        f"{state.latest_checkpoint} (phase {saved.get('phase_index', 0) + 1} '{saved.get('phase_name')}', "
        f"global step {saved.get('global_step')}, {saved.get('resets')} resets)"
    )


def inspect_output_folder(path: str | Path) -> FolderState:
    from ..reset.checkpoint import finished_state, latest_checkpoint, read_prorl_state

    path = Path(path)
    state = FolderState(path=path)
    if not path.is_dir():
        return state
    found = set()
    for pattern in RUN_OUTPUTS:
        for match in path.glob(pattern):
            match = match.parent if match.name.startswith("events.out.tfevents") else match
            found.add(str(match.relative_to(path)) + ("/" if match.is_dir() else ""))
    state.outputs = sorted(found)
    state.finished = finished_state(path)
    state.latest_checkpoint = latest_checkpoint(path)
    if state.latest_checkpoint is not None:
        state.checkpoint_state = read_prorl_state(state.latest_checkpoint)
    return state


@dataclass
class StartPlan:
    """How `train` starts: `resume` is what `ProRLTrainer.train(resume_from_checkpoint=...)` gets (None: from the
    beginning); `finished` means there is nothing to do; `overwrite` means the old outputs are deleted first."""

    state: FolderState
    resume: str | None = None
    finished: bool = False
    overwrite: bool = False
    note: str | None = None


def plan_start(output_dir: str | Path, resume: str | bool | None = None, overwrite: bool = False) -> StartPlan:
    """Decide how a run starts in `output_dir`. Raises `OutputFolderError` for a used folder with neither
    `resume` nor `overwrite`, for both at once, and for a `resume` path that is not a complete checkpoint.

    `resume=True` (`--resume`): the latest complete checkpoint; none yet (killed before the first one) starts from
    the beginning; a finished run is reported finished and left as it is.
    """
    state = inspect_output_folder(output_dir)
    if resume and overwrite:
        raise OutputFolderError("--resume and --overwrite contradict each other; pass one.")
    if overwrite:
        return StartPlan(state, overwrite=state.used)
    if resume is True:
        if state.finished:
            return StartPlan(state, finished=True)
        if state.latest_checkpoint is None:
            note = None if not state.used else (
                f"no complete checkpoint in {state.path}/ yet: starting from the beginning "
                "(files of the earlier attempt are rewritten as the run goes)"
            )
            return StartPlan(state, note=note)
        return StartPlan(state, resume=str(state.latest_checkpoint), note=f"resuming from {describe_checkpoint(state)}")
    if resume:
        from ..reset.checkpoint import PRORL_STATE_NAME

        checkpoint = Path(str(resume))
        if not (checkpoint / PRORL_STATE_NAME).is_file():
            raise OutputFolderError(
                f"--resume {checkpoint}: not a complete ProRL checkpoint (no {PRORL_STATE_NAME}; an interrupted "
                f"save has none). Complete checkpoints are <output_dir>/phase-<i>/checkpoint-<step>/; pass --resume "
                "alone for the latest one."
            )
        return StartPlan(state, resume=str(checkpoint), note=f"resuming from {checkpoint}")
    if state.used:
        raise OutputFolderError(
            f"{state.describe()}. Nothing was changed. Pass --resume to continue it"
            + (" (it is finished: --resume says so and exits)" if state.finished else "")
            + ", or --overwrite to delete its outputs and start again, or choose another --training.output_dir."
        )
    return StartPlan(state)


def delete_run_outputs(state: FolderState) -> list[str]:
    """`--overwrite`: delete the run outputs listed in `state` (never anything else in the folder)."""
    removed = []
    for name in state.outputs:
        target = state.path / name.rstrip("/")
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
        removed.append(name)
    return removed


def split_run_flags(tokens: list[str]) -> tuple[str | bool | None, bool, list[str]]:
    """`--resume [CHECKPOINT]` / `--resume=CHECKPOINT` and `--overwrite` among command-line tokens (after RECIPE,
    argparse hands them over with the overrides); returns (resume, overwrite, the other tokens in order)."""
    resume, overwrite, rest, index = None, False, [], 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--overwrite":
            overwrite = True
        elif token == "--resume":
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            if following is not None and not following.startswith("--"):
                resume, index = following, index + 1
            else:
                resume = True
        elif token.startswith("--resume="):
            resume = token.split("=", 1)[1]
        else:
            rest.append(token)
        index += 1
    return resume, overwrite, rest


def resume_command(launcher_argv: list[str] | None = None, argv: list[str] | None = None) -> str:
    """The command that continues this run: as it was launched (`accelerate launch ...` or `torchrun ...` when the
    parent process is that launcher, so the resumed run has the same processes, else this process's own command
    line), with `--overwrite`/`--resume ...` replaced by `--resume`."""
    argv = list(sys.argv if argv is None else argv)
    launcher_argv = list(launcher_argv or [])
    launchers = ("accelerate", "accelerate.commands.launch", "torchrun", "torch.distributed.run")
    if any(part in launchers or Path(part).name in launchers for part in launcher_argv) and "train" in launcher_argv:
        command = launcher_argv
    else:
        program = ["prorl-trl"] if Path(argv[0]).name == "prorl-trl" else [sys.executable, "-m", "prorl_trl"]
        command = program + argv[1:]
    if "train" in command:
        at = command.index("train") + 1
        _, _, rest = split_run_flags(command[at:])
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
