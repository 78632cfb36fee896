"""Reset on demand: a user or a script asks a running job to end its phase at the next step boundary, hard-reset, and
start the next phase of the recipe (or a later one), by writing a request file into the run's output folder.

`prorl-trl reset OUTPUT_DIR [--to-phase N] [--reason TEXT]` writes `<output_dir>/prorl_reset_request.json`
atomically (`write_reset_request`). `OnDemandResetCallback` looks for it at the end of every optimizer step on the
main process, checks it against the run (`request_target`: a phase that exists and comes later) and broadcasts the
decision, so every rank ends the phase after the same step. The trainer then goes on as after a plateau stop: the
phase is over (`phase_end_reason`), the next phase starts with a hard reset (forced, as `_pending_reset`), phases
between are skipped, and the next phase runs its own `max_steps` (the ended phase's remaining steps are not trained,
which is announced with the run's new total).

Which phase ends: the verb records the phase the run folder shows the job in (`written_in_phase`) and names the phase to
start (`to_phase`) even without --to-phase (then the next one, `to_phase_given: false`), so that what it prints is what
the job does. Such a request read in another phase (the job went on to the next phase before reading it, or a resume
from an earlier checkpoint is in an earlier one) is refused, never carried to the phase after the one the job happens to
be in, one further than the verb said. A request without `written_in_phase` (written by hand, by `write_reset_request`
without it, or by an earlier version of this package) keeps `to_phase: null` as "the phase after the one the job is in
when it reads the request".

Exactly once, across kills: the decision is recorded in the trainer's `prorl_on_demand_resets`, saved in the checkpoint
written at that step (`prorl_state.json`, `on_demand_resets`); only after that commit is the request filed as
`prorl_reset_requests/handled-step-<N>.json`. A request whose `request_id` is already recorded (killed between the
commit and the filing) is filed without acting again. A request that names no later phase, or one the job reads in
another phase than the one it was written for, is filed as `refused-step-<N>.json` with a warning; training goes on. A
request waiting while the job is down is checked by `--resume` against its recipe changes before anything loads
(`waiting_request`, used by `recipe.changes.refuse_waiting_request_conflicts`): a change it would void, or one that
leaves it unfit, is refused.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..reset.checkpoint import json_text, write_text_atomically

logger = logging.getLogger("prorl_trl")

REQUEST_NAME = "prorl_reset_request.json"
RECORDS_FOLDER = "prorl_reset_requests"
REQUEST_MAX_BYTES = 64 * 1024  # a request is a few hundred bytes
LOG_KEY = "prorl/reset_on_demand"


def request_path(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / REQUEST_NAME


def write_reset_request(
    output_dir: str | os.PathLike, to_phase: int | None = None, reason: str = "", written_in_phase: int | None = None
) -> dict[str, Any]:
    """Write the request atomically (a reader sees the whole file or none); returns what was written (as
    `parse_request` reads it). A pending request is replaced.

    With `written_in_phase` (the phase the job is in as the writer sees it; `prorl-trl reset` always gives it) the
    request names its target even when `to_phase` is None (the next phase, `to_phase_given: false`), and a job that
    reads it in another phase refuses it (`request_target`). Without it, `to_phase=None` means the phase after the one
    the job is in when it reads the request, whichever that is."""
    request: dict[str, Any] = {"request_id": uuid.uuid4().hex, "to_phase": to_phase}
    if written_in_phase is not None:
        given = to_phase is not None
        request.update(to_phase=to_phase if given else written_in_phase + 1, to_phase_given=given,
                       written_in_phase=written_in_phase)  # fmt: skip
    request.update(reason=reason,
                   requested_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))  # fmt: skip
    write_text_atomically(request_path(output_dir), json_text(request))
    return request


REQUEST_KEYS = ("request_id", "to_phase", "to_phase_given", "written_in_phase", "reason", "requested_at")


def parse_request(text: str) -> dict[str, Any]:
    """The request in `text`, normalised (`to_phase` None or an int, `reason` text, a `request_id`; with
    `written_in_phase`, also `to_phase_given` and `to_phase` an int: the next phase when not given); `ValueError`
    saying what is wrong otherwise. A hand-written request without an id gets the hash of its text."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"holds a {type(raw).__name__}, not a JSON object")
    unknown = sorted(set(raw) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"has unknown keys {unknown} (allowed: {', '.join(REQUEST_KEYS)})")
    to_phase = raw.get("to_phase")
    if to_phase is not None and not _is_index(to_phase):
        raise ValueError(f"has to_phase={to_phase!r}: it must be a phase index (a whole number) or null")
    reason = raw.get("reason") or ""
    if not isinstance(reason, str):
        raise ValueError(f"has reason={reason!r}: it must be text")
    request_id = raw.get("request_id") or hashlib.sha256(text.encode()).hexdigest()[:32]
    request = {"request_id": str(request_id), "to_phase": to_phase, "reason": reason[:500],
               "requested_at": raw.get("requested_at")}  # fmt: skip
    return {**request, **_written_phase(raw, to_phase)}


def _written_phase(raw: dict[str, Any], to_phase: int | None) -> dict[str, Any]:
    """`written_in_phase` and `to_phase_given` of a request that records the phase it was written in, with the
    `to_phase` it names (the next phase when not given); {} for one that does not (the old meaning of `to_phase:
    null` holds). `ValueError` for fields that contradict each other: the job would have to guess which one holds."""
    written, given = raw.get("written_in_phase"), raw.get("to_phase_given")
    if written is None:
        if given is not None:
            raise ValueError(f"has to_phase_given={given!r} without written_in_phase (the phase it refers to)")
        return {}
    if not _is_index(written) or written < 0:
        raise ValueError(f"has written_in_phase={written!r}: it must be a phase index (a whole number) or null")
    given = to_phase is not None if given is None else given
    if not isinstance(given, bool):
        raise ValueError(f"has to_phase_given={given!r}: it must be true or false")
    if given and to_phase is None:
        raise ValueError("has to_phase_given=true and to_phase=null: it names no phase")
    if not given and to_phase not in (None, written + 1):
        raise ValueError(f"has to_phase={to_phase} with to_phase_given=false and written_in_phase={written} (the "
                         f"next phase is {written + 1})")  # fmt: skip
    return {"to_phase": to_phase if given else written + 1, "to_phase_given": given, "written_in_phase": written}


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_target(to_phase: int | None, current: int, names: list[str]) -> int:
    """The phase a request leads to (`to_phase`, default the next one); `ValueError` unless it exists and is later
    than `current` (a run only moves forward: its finished phases' deltas are already part of the model)."""
    target = current + 1 if to_phase is None else to_phase
    if 0 <= target < len(names) and target > current:
        return target
    listed = ", ".join(f"{index} '{name}'" for index, name in enumerate(names))
    if to_phase is None:
        problem = f"phase {current} '{names[current]}' is the run's last phase: there is no next phase to start"
    elif not 0 <= target < len(names):
        problem = f"to_phase={target} is no phase of the run (phases: {listed})"
    else:
        problem = f"to_phase={target} is not after the running phase {current} '{names[current]}'"
    raise ValueError(problem)


def request_target(request: dict[str, Any], current: int, names: list[str]) -> int:
    """The phase the job in phase `current` starts for `request` (`parse_request`'s): `check_target`'s, and for a
    request written without --to-phase against a recorded phase (`written_in_phase`, `to_phase_given: false`) only in
    that phase. Read in a later one (the job left that phase before reading it) or an earlier one (a resume from an
    earlier checkpoint), it would end a phase the verb did not name and start one further, or skip one: `ValueError`
    saying so, and the request is refused rather than guessed at. A request naming its phase (--to-phase, or a file
    without `written_in_phase`) is checked by `check_target` alone."""
    written = request.get("written_in_phase")
    if written is not None and not request.get("to_phase_given", True) and current != written:
        why = (f"phase {written} is over" if current > written else
               f"an earlier one: resumed from an earlier checkpoint, or with phase {current} made longer")  # fmt: skip
        raise ValueError(
            f"written_in_phase={written} is not the phase the job is in, {phase_label(current, names)} ({why}): "
            f"written by `prorl-trl reset` without --to-phase to end phase {phase_label(written, names)} and start "
            f"phase {phase_label(written + 1, names)}, the request does not end another phase"
        )
    return check_target(request["to_phase"], current, names)


def phase_label(index: int, names: list[str]) -> str:
    """How messages name a phase: `2 'middle'` (the bare index where the run has no such phase)."""
    return f"{index} '{names[index]}'" if 0 <= index < len(names) else str(index)


def acted_on(request: dict[str, Any], records: list[Any]) -> bool:
    """Whether `records` (the run's `on_demand_resets`) hold the request: a kill came between its checkpoint's commit
    and its filing, so it is only filed."""
    return any(isinstance(record, dict) and record.get("request_id") == request["request_id"] for record in records)


def waiting_request(output_dir: str | os.PathLike, records: list[Any]) -> dict[str, Any] | None:
    """The request in `output_dir` that a job resumed with `records` (its checkpoint's `on_demand_resets`) acts on at
    its first step end, unchecked against its phases (`request_target`); None without one, for one it cannot read (it
    files that as refused) and for one already acted on (`acted_on`)."""
    text = _read_request_text(output_dir)
    if text is None:
        return None
    try:
        request = parse_request(text)
    except ValueError:
        return None
    return None if acted_on(request, records) else request


def describe_request(output_dir: str | os.PathLike, request: dict[str, Any]) -> str:
    """How a message names a waiting request: its file, id, target, reason and time."""
    to_phase = "next" if request["to_phase"] is None else request["to_phase"]
    if request.get("to_phase_given") is False:
        to_phase = f"{to_phase} (the next phase: written in phase {request['written_in_phase']})"
    parts = [f"id {request['request_id']}", f"to_phase {to_phase}"]
    parts += [f"reason '{request['reason']}'"] if request["reason"] else []
    parts += [f"written {request['requested_at']}"] if request.get("requested_at") else []
    return f"{request_path(output_dir)} ({', '.join(parts)})"


def next_phase_after(records: list[dict[str, Any]]) -> int:
    """The earliest phase the run may still train: phases before the last on-demand target were jumped over."""
    return max((int(record["to_phase"]) for record in records), default=0)


def file_request(output_dir: str | os.PathLike, text: str, outcome: str, step: int) -> Path:
    """Move the request as read (`text`) to `prorl_reset_requests/<outcome>-step-<step>.json`. A newer request written
    meanwhile stays for the next step; the record then holds `text`."""
    folder = Path(output_dir) / RECORDS_FOLDER
    record = folder / f"{outcome}-step-{step}.json"
    count = 1
    while record.exists():
        count += 1
        record = folder / f"{outcome}-step-{step}-{count}.json"
    if _read_request_text(output_dir) == text:
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(request_path(output_dir), record)
    else:
        write_text_atomically(record, text)
    return record


def _read_request_text(output_dir: str | os.PathLike) -> str | None:
    """The request file's text (None without one); one too large to be a request reads as a short description."""
    path = request_path(output_dir)
    try:
        if not path.is_file():
            return None
        if path.stat().st_size > REQUEST_MAX_BYTES:
            return f"<{path.stat().st_size} bytes: more than a request can be>"
        return path.read_text(errors="replace")
    except OSError:  # removed between the check and the read: nothing to do
        return None


def _total_steps(phases: list[Any], done: int, start: int) -> int | None:
    """The run's steps when it has trained `done` and then runs `phases[start:]` (None with epoch-based phases)."""
    later = [phase.max_steps for phase in phases[start:]]
    return None if any(steps < 1 for steps in later) else done + sum(later)


class OnDemandResetCallback(TrainerCallback):
    """Acts on `<output_dir>/prorl_reset_request.json` at step ends (see module doc). Added by `ProRLTrainer`."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self._to_file: tuple[str, int] | None = None  # a handled request, filed once its checkpoint is committed

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        decision = self._decide(state) if trainer.accelerator.is_main_process else None
        if trainer.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            decision = broadcast_object_list([decision], from_process=0)[0]
        if decision is not None:
            self._act(decision, args, state, control)
        return control

    def on_save(self, args, state, control, **kwargs):
        if self._to_file is not None and self.trainer.accelerator.is_main_process:  # after the state's commit
            file_request(args.output_dir, self._to_file[0], "handled", self._to_file[1])
        self._to_file = None
        return control

    def _decide(self, state: Any) -> dict[str, Any] | None:
        """Main process: the request to act on now, or None (none, a refused one, or one already acted on)."""
        trainer = self.trainer
        output_dir = trainer.args.output_dir
        text = _read_request_text(output_dir)
        if text is None:
            return None
        step = trainer.prorl_global_step
        current = trainer.current_phase.index
        try:
            request = parse_request(text)
            if acted_on(request, trainer.prorl_on_demand_resets):
                file_request(output_dir, text, "handled", step)  # acted on before a kill; its filing was lost
                return None
            target = request_target(request, current, [phase.name for phase in trainer.phases])
        except ValueError as problem:
            record = file_request(output_dir, text, "refused", step)
            logger.warning(
                "Reset on demand refused at global step %d: %s %s. Training goes on in phase %d '%s'; the request was "
                "moved to %s. Write a new one with `prorl-trl reset %s [--to-phase N]`.",
                step, REQUEST_NAME, problem, current, trainer.current_phase.name, record, output_dir,
            )  # fmt: skip
            return None
        return {**request, "to_phase": target, "text": text}

    def _act(self, decision: dict[str, Any], args: Any, state: Any, control: Any) -> None:
        """Every rank, at the same step: end the phase here, force a hard reset, record and announce it."""
        trainer = self.trainer
        phase, target = trainer.current_phase, trainer.phases[decision["to_phase"]]
        step = trainer.prorl_global_step
        planned = phase.max_steps if phase.max_steps > 0 else state.max_steps
        record = {
            "step": step,
            "phase_step": state.global_step,
            "from_phase": phase.index,
            "from_phase_name": phase.name,
            "to_phase": target.index,
            "to_phase_name": target.name,
            "reason": decision["reason"],
            "steps_not_trained": max(planned - state.global_step, 0),
            "skipped_phases": list(range(phase.index + 1, target.index)),
            "request_id": decision["request_id"],
            "requested_at": decision["requested_at"],
        }
        trainer.prorl_on_demand_resets.append(record)
        why = f" ({decision['reason']})" if decision["reason"] else ""
        trainer._phase_end_reason = f"reset on demand{why}"
        trainer.request_hard_reset(f"reset on demand{why}")  # done where the next phase starts
        control.should_training_stop = True
        saving = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
        control.should_save = control.should_save or saving
        if trainer.accelerator.is_main_process:
            if saving:
                self._to_file = (decision["text"], step)
            else:  # no checkpoint to wait for: a kill restarts the run anyway
                file_request(args.output_dir, decision["text"], "handled", step)
        should_log = control.should_log
        trainer.log_event({LOG_KEY: target.index})
        control.should_log = should_log  # HF's `on_log` clears it; the step's own entry still comes
        trainer.announce(self._describe(record, target))

    def _describe(self, record: dict[str, Any], target: Any) -> str:
        """The console line: where the phase ends, what is not trained, and the run's new total."""
        phases = self.trainer.phases
        skipped = [phases[index] for index in record["skipped_phases"]]
        lost = record["steps_not_trained"]
        parts = [
            f"Reset on demand at global step {record['step']}"
            + (f" ({record['reason']})" if record["reason"] else "")
            + f": phase {record['from_phase']} '{record['from_phase_name']}' ends after {record['phase_step']} steps"
            + (f", its remaining {lost} steps are not trained" if lost else ""),
        ]
        if skipped:
            names = ", ".join(f"{phase.index} '{phase.name}'" for phase in skipped)
            parts.append(f"skipped phases {names} ({sum(max(p.max_steps, 0) for p in skipped)} steps)")
        parts.append(
            f"then hard reset and phase {target.index} '{target.name}' with its own max_steps={target.max_steps}"
        )
        total = _total_steps(phases, record["step"], target.index)
        recipe = _total_steps(phases, 0, 0)
        if total is not None and recipe is not None:
            parts.append(f"the run now trains {total} steps in all (the recipe plans {recipe})")
        return "; ".join(parts) + "."
