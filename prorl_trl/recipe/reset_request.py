"""`prorl-trl reset OUTPUT_DIR [--to-phase N] [--reason TEXT]`: ask the running job in OUTPUT_DIR to end its phase at
the next step boundary, hard-reset and start the next phase (or phase N).

What the folder tells is checked here (a run of this package, not finished, N a phase of its recorded recipe and later
than the phase the job is in: `job_phase`); the trainer checks the request again against the phase it is in when it
reads it, and refuses (with a warning; training goes on) what no longer fits. The request is written atomically and
acted on once (`prorl_trl.trainer.on_demand`); a job that is not running acts on it at its resumed run's first step
end.

The request records that phase (`written_in_phase`) and, without --to-phase, names the next one as its target: the
message says which phase ends and which starts, and the job does exactly that or refuses the request (it read it in
another phase: it had gone on past the phase's end, or was resumed from an earlier checkpoint). Before, the request
said only "the next phase" and a job that read it one phase later than the folder showed jumped one phase further.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..trainer.manifest import record_outputs
from ..trainer.on_demand import (RECORDS_FOLDER, REQUEST_NAME, check_target, phase_label, request_path,
                                 write_reset_request)  # fmt: skip
from ..trainer.output_guard import OutputFolderError
from .changes import phase_names, recorded_recipe, resumed_into
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
        help="index (from 0) of the phase to start; phases between are skipped (default: the one after the phase the "
        "run folder shows the job in, which the job then ends; it refuses the request if it has left that phase)",
    )  # fmt: skip
    parser.add_argument("--reason", default="", help="why, kept in the run's log and run_summary.json")


def recorded_phase_names(run_dir: Path) -> list[str] | None:
    """The phase names of the run's recorded recipe (None without one: the run was not started by the CLI)."""
    flat = recorded_recipe(run_dir)
    return None if flat is None else phase_names(flat)


def job_phase(saved: dict[str, Any]) -> tuple[int, str]:
    """The phase the job is in (running) or resumes into (stopped), from its latest checkpoint's `prorl_state.json`
    (`saved`, {} before the first), and how a message says why: the checkpoint's phase, or a later one when that
    checkpoint ended its phase (its last step, or a reset on demand: `recipe.changes.resumed_into` without changes).
    The job reads a request only at step ends of a phase it still trains, so a phase whose last checkpoint is
    committed is over for it (unless a resume lengthens it: then the job refuses a request written without
    --to-phase against the next phase, `trainer.on_demand.request_target`)."""
    if not saved:
        return 0, "no checkpoint written yet"
    own, current = int(saved["phase_index"]), resumed_into([], saved)
    if current == own:
        return current, f"the latest checkpoint is in phase {own}"
    return current, f"the latest checkpoint ends phase {own}: the job is in phase {current} or resumes into it"


def saves_phase_ends(flat: dict[str, Any]) -> bool:
    """Whether a run of the recipe (`flat`, flattened) checkpoints every phase's last step, so that its latest
    checkpoint shows the phase the job is in (`job_phase`) up to the steps since it: `save_strategy: steps`, the
    default. With `no` (or `epoch`, `best`) the job may be phases past its latest checkpoint, or have none: a request
    written against the phase that checkpoint shows would be refused by a job in a later one."""
    return str(flat.get("training.save_strategy", "steps")) == "steps"


def describe_effect(
    names: list[str], current: int, target: int, why: str, given: bool, unshown: dict[str, Any] | None = None
) -> str:  # fmt: skip
    """What the verb says the request does: the phase that ends (`current`, the one the folder shows the job in,
    `why`), the one that starts and the ones skipped, and when the job refuses it instead (`request_target`). Where
    the folder does not show the job's phase (`unshown`: the recipe of a run that does not checkpoint its phases'
    ends), the phase the job is in when it reads the request ends, and without --to-phase (`given`) the one after
    it starts, whichever they are."""
    if unshown is not None:
        starts = f"phase {phase_label(target, names)}" if given else "the phase after it"
        return (
            f"the job ends the phase it is in at its next step end, hard-resets and starts {starts} (the run saves no "
            f"checkpoint at its phases' ends, training.save_strategy '{unshown.get('training.save_strategy')}', so "
            "this folder does not show which phase the job is in)"
        )
    between = range(current + 1, target)
    listed = ", ".join(phase_label(index, names) for index in between)
    skipped = f", skipping phase{'s' if len(between) > 1 else ''} {listed}" if listed else ""
    refused = (
        f"A job in phase {target} or later when it reads the request refuses it (filed as refused, with a warning)"
        if given else f"A job that has left phase {current} when it reads the request refuses it (filed as refused, "
        "with a warning) rather than end another phase"
    )  # fmt: skip
    return (
        f"the job ends phase {phase_label(current, names)} at its next step end ({why}), hard-resets and starts "
        f"phase {phase_label(target, names)}{skipped}. {refused}"
    )


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
    flat = recorded_recipe(output_dir) or {}
    names = phase_names(flat) if flat else []
    current, why = job_phase(state.checkpoint_state or {})
    shown = saves_phase_ends(flat)  # else the folder does not show the job's phase: the request names none
    if current >= len(names):  # its last phase's last checkpoint is committed: final/ is all that is left to write
        raise OutputFolderError(
            f"{output_dir}: the latest checkpoint ends the run's last phase ({state.latest_checkpoint}): no phase is "
            "left to end, nothing was written."
        )
    try:
        target = check_target(args.to_phase, current, names)
    except ValueError as problem:
        raise OutputFolderError(f"{output_dir}: {problem} ({why}); nothing was written.") from None
    pending = request_path(output_dir).is_file()
    record_outputs(output_dir, [REQUEST_NAME, f"{RECORDS_FOLDER}/"])  # the run's, so --overwrite deletes them
    request = write_reset_request(output_dir, args.to_phase, args.reason, written_in_phase=current if shown else None)
    effect = describe_effect(names, current, target, why, args.to_phase is not None, None if shown else flat)
    print(
        f"{'replaced the pending request: ' if pending else ''}wrote {request_path(output_dir)} (id "
        f"{request['request_id']}): {effect}. Then the request is moved to {output_dir / RECORDS_FOLDER}/"
        "handled-step-<step>.json; a stopped job acts on it when resumed."
    )
    return 0
