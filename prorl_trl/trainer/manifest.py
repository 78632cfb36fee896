"""The run manifest: every path a run creates in its output folder, recorded before it is created.

`--overwrite` deletes exactly these paths (`prorl_trl.recipe.output_folder`), so files that only look like a run's
(a user's `completions/`, `phase-1-plan.md`, `runs/other-experiment/`) are never touched. The manifest is
`<output_dir>/.prorl_manifest.json`: paths relative to the run folder, folders ending in `/`, written atomically by
the process that writes the run's files (the CLI for its own files, `ProRLTrainer.train` for checkpoints, merged
saves and logs, the tracker span for TensorBoard's event folder).

A path that already exists when it would be recorded is not the run's (a user's folder named like an output) and is
never recorded, unless the caller has just created it (`created=True`). The temporary siblings of a recorded path
(`.<name>.tmp`, `.<name>.tmp-*`, `.<name>.old-*`, left by an atomic write that was killed) belong to the run too.

A run folder written before manifests existed has none: `legacy_outputs` names its outputs by the exact names such a
run wrote (`phase-<i>/`, `final/`, ...; `completions/` and `distill/` only when its `recipe.yaml` asked for them; the
TensorBoard folder recorded in `prorl_trackers.json`), never by pattern.

`prorl-trl ablate` and `prorl-trl distill` keep the same manifest in their output folders; its `kind` (an
`OutputKind`'s name; `train` when absent) says which command wrote it, so no command takes another's folder for its
own (`train --overwrite` never deletes an ablation's tables, an ablation never writes among a run's checkpoints).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = ".prorl_manifest.json"
# Top-level files and folders every run may write (a folder ends in `/`); `phase-<i>/` are counted per run.
CLI_FILES = ("recipe.yaml", "resume_history.yaml", "data_files.json", "run_summary.json")  # by `prorl-trl train`
# nonfinite/: a stopped step kept for a replay; prorl_reset_request.json and prorl_reset_requests/: `prorl-trl reset`'s
# request and the requests filed once acted on or refused (`prorl_trl.trainer.on_demand`)
RUN_FILES = (*CLI_FILES, "prorl_log_history.json", "prorl_trackers.json", "README.md", "prorl_reset_request.json")
RUN_FOLDERS = ("merged/", "frozen/", "final/", "nonfinite/", "prorl_reset_requests/")
PHASE_FOLDER = re.compile(r"phase-\d+")
# exactly the forms the package writes: `.tmp` (atomic file writes), `mkdtemp`'s `.tmp-` + 8 characters, `.old-<pid>`
_LEFTOVER = re.compile(r"\.(?P<name>.+?)\.(tmp|tmp-[a-z0-9_]{8}|old-\d+)")
_RUN_EVIDENCE = ("final/", "run_summary.json", "prorl_log_history.json")  # what only a run writes (`legacy_outputs`)


TRACKER_IDS_NAME = "prorl_trackers.json"
# What to do about a damaged manifest (`read_manifest`).
_FIX = (
    "It lists what the run wrote (what --overwrite deletes); nothing was changed. Restore it from a copy of the run, "
    "or delete it: the run's outputs are then found by their exact names, as for a run from before manifests."
)


@dataclass(frozen=True)
class OutputKind:
    """A command that keeps a manifest in its output folder, and how its folder is checked
    (`output_guard.check_output_folder`): a foreign file named like one of `writes` (or matching
    `pattern`) is refused even with `--allow-other-files`, since the command would write over it."""

    name: str  # recorded in the manifest: `train`, `ablate`, `distill`
    option: str  # how the user names the folder, for messages: `--training.output_dir`, `--out`
    legacy: Callable[[Path], list[str]]  # its outputs in a folder from before manifests, by exact names
    writes: tuple[str, ...] = ()  # top-level names every run of it may write (folders end in `/`)
    pattern: re.Pattern | None = None  # more top-level names it writes (`phase-<i>`)


def read_manifest(run_dir: str | os.PathLike) -> list[str] | None:
    """The recorded paths (relative, folders ending in `/`), or None when the folder has no manifest. Entries that
    would leave the run folder (absolute, `..`) are dropped: the manifest never names anything outside it. A damaged
    manifest raises `UnreadableFileError` (exit 2): what is the run's cannot be told, so nothing is deleted."""
    from ..files import UnreadableFileError

    manifest = _read_manifest_file(run_dir)
    if manifest is None:
        return None
    paths = manifest.get("paths", [])
    if not isinstance(paths, list):
        raise UnreadableFileError(Path(run_dir) / MANIFEST_NAME, "is damaged: its `paths` is not a list", _FIX)
    return [p for p in paths if isinstance(p, str) and _relative(p) == p]


def manifest_kind(run_dir: str | os.PathLike) -> str | None:
    """Which command wrote the folder's manifest (`OutputKind.name`; `train` for one without a `kind`), None without
    a manifest."""
    manifest = _read_manifest_file(run_dir)
    return None if manifest is None else str(manifest.get("kind", TRAIN.name))


def _read_manifest_file(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    from ..files import read_json

    path = Path(run_dir) / MANIFEST_NAME
    return read_json(path, dict, _FIX) if os.path.lexists(path) else None


def read_tracker_ids(run_dir: str | os.PathLike) -> dict[str, Any]:
    """`prorl_trackers.json`: the ids a resumed run continues its tracker runs with ({} when there is none); a damaged
    file raises `UnreadableFileError` (exit 2)."""
    from ..files import UnreadableFileError, read_json

    path = Path(run_dir) / TRACKER_IDS_NAME
    if not os.path.lexists(path):
        return {}
    fix = (
        "It names the tracker runs (TensorBoard folder, W&B/MLflow run ids) a resume continues; nothing was loaded or "
        "changed. Restore it from a copy of the run, or delete it: the resumed run then logs to new tracker runs."
    )
    ids = read_json(path, dict, fix)
    wrong = [key for key, value in ids.items() if not isinstance(value, str)]
    if wrong:
        raise UnreadableFileError(path, f"is damaged: {', '.join(map(str, wrong))} not text", fix)
    return ids


def tensorboard_folder_in(run_dir: str | os.PathLike, recorded: str | None) -> Path | None:
    """The TensorBoard folder recorded in `prorl_trackers.json`, when its path lies inside the run folder; None
    otherwise: a resume never writes events into another run's folder (`../other/runs/x`, the old absolute place of
    a moved run). Checked on the path, so a `runs/` the user linked into a shared folder is followed."""
    if not recorded:
        return None
    run_dir = Path(os.path.normpath(Path(run_dir).absolute()))
    path = Path(os.path.normpath(run_dir / recorded))  # an absolute `recorded` stays itself
    return path if path.is_relative_to(run_dir) and path != run_dir else None


def owned_outputs(run_dir: str | os.PathLike, kind: OutputKind | None = None) -> tuple[list[str], bool]:
    """(the run's paths, whether they come from a manifest): the manifest's, else `kind.legacy`'s (default
    `legacy_outputs`)."""
    recorded = read_manifest(run_dir)
    return (recorded, True) if recorded is not None else ((kind or TRAIN).legacy(Path(run_dir)), False)


def record_outputs(
    run_dir: str | os.PathLike, names: Iterable[str], created: bool = False, kind: OutputKind | None = None
) -> None:
    """Add `names` (relative to `run_dir`; folders end in `/`) to the manifest of `kind` (default: `train`'s),
    before creating them.

    Call it from the process that writes the run's files only. A name that already exists is not recorded (it is
    not the run's) unless `created`; a folder without a manifest that holds an earlier run adopts that run's outputs
    (`kind.legacy`) first. Writes only when something changed.
    """
    run_dir, kind = Path(run_dir), kind or TRAIN
    recorded = read_manifest(run_dir)
    known = list(recorded) if recorded is not None else kind.legacy(run_dir)
    added = []
    for name in names:
        relative = _relative(name)
        if relative is None or relative in known or relative in added:
            continue
        if not created and os.path.lexists(run_dir / relative):
            continue
        added.append(relative)
    if added or (recorded is None and known):
        from ..reset.checkpoint import write_json

        write_json(run_dir / MANIFEST_NAME, {"format": 1, "kind": kind.name, "paths": sorted(known + added)})


def trainer_outputs(args: Any, num_phases: int) -> list[str]:
    """What `ProRLTrainer` (and TRL inside it) may create in `args.output_dir`: the phase checkpoint folders, the
    merged/frozen/final saves, the log history and tracker ids, TRL's model card, TRL's `completions/`."""
    names = [f"phase-{index}/" for index in range(num_phases)] + list(RUN_FOLDERS)
    names += [name for name in RUN_FILES if name not in CLI_FILES]
    return names + (["completions/"] if getattr(args, "log_completions", False) else [])


def is_leftover_of(name: str, owned: Iterable[str]) -> bool:
    """Whether `name` (relative) is a temporary sibling of an owned path, or the manifest itself (or its own)."""
    parent, _, base = name.rpartition("/")
    if name in (MANIFEST_NAME, f".{MANIFEST_NAME}.tmp"):
        return True
    match = _LEFTOVER.fullmatch(base)
    if match is None:
        return False
    sibling = f"{parent}/{match['name']}" if parent else match["name"]
    return any(path.rstrip("/") == sibling for path in owned)


def legacy_outputs(run_dir: str | os.PathLike) -> list[str]:
    """The outputs of a run written before manifests, by the exact names it wrote (never a pattern that also
    matches a user's `phase-1-plan.md` or `completions-old/`); symlinks are never counted."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in sorted(run_dir.iterdir()):
        if child.is_symlink():
            continue
        if child.is_dir() and (PHASE_FOLDER.fullmatch(child.name) or f"{child.name}/" in RUN_FOLDERS):
            found.append(f"{child.name}/")
        elif child.is_file() and child.name in RUN_FILES and (child.name != "README.md" or _is_trl_card(child)):
            found.append(child.name)
    recipe = _read_yaml(run_dir / "recipe.yaml")
    training = recipe.get("training") if isinstance(recipe.get("training"), dict) else {}
    for folder, written in (("distill", recipe.get("distill")), ("completions", training.get("log_completions"))):
        if written and (run_dir / folder).is_dir() and not (run_dir / folder).is_symlink():
            found.append(f"{folder}/")
    # Names alone are no evidence (a user's own recipe.yaml or README.md beside the recipe it writes into): a run
    # leaves a phase folder, final/ or its log history.
    if not any(PHASE_FOLDER.fullmatch(name.rstrip("/")) or name in _RUN_EVIDENCE for name in found):
        return []
    tensorboard = _tensorboard_folder(run_dir)
    return found + ([tensorboard] if tensorboard else [])


def present_outputs(run_dir: Path, names: Iterable[str]) -> list[str]:
    """The `names` that are in `run_dir` as what they name (a folder for `x/`, else a file), never as a symlink: a
    folder from before manifests never has an output counted through a link (`OutputKind.legacy`)."""
    found = []
    for name in names:
        path = run_dir / name.rstrip("/")
        if not path.is_symlink() and (path.is_dir() if name.endswith("/") else path.is_file()):
            found.append(name)
    return found


def _relative(name: str | os.PathLike) -> str | None:
    """`name` as a clean relative posix path (a folder keeps its trailing `/`), or None if it leaves the folder."""
    text = str(name)
    folder = text.endswith(("/", os.sep))
    parts = [part for part in Path(text).parts if part not in ("", ".")]
    if not parts or Path(text).is_absolute() or ".." in parts:
        return None
    return "/".join(parts) + ("/" if folder else "")


def _is_trl_card(path: Path) -> bool:
    """TRL's model card (written at every save by `GRPOTrainer._save_checkpoint`), not a user's README."""
    head = path.read_text(errors="replace")[:2000]
    return head.startswith("---") and "- trl" in head and "- prorl" in head


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _tensorboard_folder(run_dir: Path) -> str | None:
    """`runs/<name>/`: the TensorBoard folder recorded in `prorl_trackers.json`, when it is in the run folder."""
    logged = read_tracker_ids(run_dir).get("tensorboard")
    parts = Path(str(logged or "")).parts
    if len(parts) < 2 or parts[-2] != "runs" or parts[-1] in ("..", "."):  # `runs/..` is the run folder
        return None
    folder = run_dir / "runs" / parts[-1]
    if folder.is_dir() and not folder.is_symlink() and not (run_dir / "runs").is_symlink():
        return f"runs/{parts[-1]}/"
    return None


TRAIN = OutputKind("train", "--training.output_dir", legacy_outputs, (*RUN_FILES, *RUN_FOLDERS), PHASE_FOLDER)
