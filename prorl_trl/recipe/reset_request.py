"""`prorl-trl reset OUTPUT_DIR [--to-phase N] [--reason TEXT]`: ask the running job in OUTPUT_DIR to end its phase at
the next step boundary, hard-reset and start the next phase (or phase N).

What the folder tells is checked here (a run of this package, not finished, N a phase of its recorded recipe and later
than its latest checkpoint's phase); the trainer checks the request again against the phase it is in when it reads
it, and refuses (with a warning; training goes on) what no longer fits. The request is written atomically and acted on
once (`prorl_trl.trainer.on_demand`); a job that is not running acts on it at its resumed run's first step end.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..trainer.manifest import record_outputs
from ..trainer.on_demand import RECORDS_FOLDER, REQUEST_NAME, check_target, request_path, write_reset_request
from ..trainer.output_guard import OutputFolderError
from .changes import phase_names, recorded_recipe
from .output_folder import inspect_output_folder


def add_reset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Ask a running `prorl-trl train` job to end its current phase at the next step boundary, hard-reset and start "
        "the next phase of its recipe (or phase --to-phase). The phase's remaining steps are not trained; the next "
        "phase runs its own max_steps. The request is a file in OUTPUT_DIR, so a stopped run acts on it when resumed."
    )
    parser.add_argument("output_dir", help="the run's output folder (training.output_dir)")
    parser.add_argument(
        "--to-phase", type=int, default=None, metavar="N",
        help="index (from 0) of the phase to start; phases between are skipped (default: the next phase)",
    )  # fmt: skip
    parser.add_argument("--reason", default="", help="why, kept in the run's log and run_summary.json")


def recorded_phase_names(run_dir: Path) -> list[str] | None:
    """The phase names of the run's recorded recipe (None without one: the run was not started by the CLI)."""
    flat = recorded_recipe(run_dir)
    return None if flat is None else phase_names(flat)


def run_reset(args: Any) -> int:
    output_dir = Path(args.output_dir)
    state = inspect_output_folder(output_dir)
    if not state.used or not (output_dir / "recipe.yaml").is_file():
        raise OutputFolderError(
            f"{output_dir}/ holds no prorl-trl run (no recipe.yaml and run outputs): nothing was written. Give the "
            "`training.output_dir` of the run to reset."
        )
    if state.finished:
        raise OutputFolderError(
            f"{state.describe()}: no phase is running, nothing was written. A reset on demand ends a running phase."
        )
    if state.damaged is not None:
        raise state.damaged
    names = recorded_phase_names(output_dir) or []
    current = int((state.checkpoint_state or {}).get("phase_index", 0))  # the job is at this phase or later
    if args.to_phase is not None or current + 1 >= len(names):
        try:
            check_target(args.to_phase, current, names)
        except ValueError as problem:
            raise OutputFolderError(
                f"{output_dir}: {problem} (the latest checkpoint is in phase {current}); nothing was written."
            ) from None
    pending = request_path(output_dir).is_file()
    record_outputs(output_dir, [REQUEST_NAME, f"{RECORDS_FOLDER}/"])  # the run's, so --overwrite deletes them
    request = write_reset_request(output_dir, args.to_phase, args.reason)
    target = "the next phase" if args.to_phase is None else f"phase {args.to_phase} '{names[args.to_phase]}'"
    print(
        f"{'replaced the pending request: ' if pending else ''}wrote {request_path(output_dir)} (id "
        f"{request['request_id']}): the job ends its phase at its next step end, hard-resets and starts {target}; "
        f"then the request is moved to {output_dir / RECORDS_FOLDER}/handled-step-<step>.json. A stopped job acts on "
        "it when resumed."
    )
    return 0
