"""Extending a finished run: `train --resume --allow-changes` with more steps in its last phase, or more phases.

A finished run (`final/` written) goes on from the checkpoint of its last step, as a run stopped right there would:
the steps it trained are kept and never trained again, an appended phase starts with the hard reset every phase
boundary has, and more steps in the last phase continue that phase (from the resumed step on at the rates of its new
length, issue 37). Before anything is loaded (exit 2 otherwise, nothing changed) this module checks that the recipe
asks for something a continuation can honour: the phases that trained keep their recorded settings and lengths, the
run keeps every phase it trained, only the last phase can get more steps (and not after a plateau stop), and the run
kept a checkpoint of its last step. A finished run resumed with settings that change training but add no step is
refused too: nothing would train with them.

The previous `final/` is kept, renamed `final-phase<i>-step<N>/` (the phase it ended, counted from 0 as the
`phase-<i>/` folders, and its global step), and the resume is recorded in `resume_history.yaml` (`extended`, next to
the changed keys). The run's log, summary, model card and trackers go on along the same global steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..reset.checkpoint import FINAL_DIR_NAME
from ..trainer.manifest import record_outputs
from ..trainer.output_guard import FolderState
from .changes import (
    Change,
    ChangedRecipeError,
    canonical,
    checkpoint_global_step,
    data_file_changes,
    flatten,
    phase_of_key,
    recorded_changes,
    recorded_recipe,
)


@dataclass(frozen=True)
class Extension:
    """What a resume adds to the finished run in `run_dir`: more steps in its last phase (`new_length`) and/or the
    phases after it (`appended`: index, name, max_steps); it starts from `checkpoint`, the run's last step."""

    run_dir: Path
    checkpoint: Path
    last_phase: int
    last_name: str
    trained_steps: int  # steps the last phase trained
    global_step: int  # where the run finished
    new_length: int | None  # the last phase's new `max_steps`; None when it keeps its length
    appended: list[tuple[int, str, int]] = field(default_factory=list)
    kept_final: str = ""  # the name `final/` is kept under

    def added(self) -> str:
        """What the extension trains beyond the finished run, in a line."""
        parts = []
        if self.new_length is not None:
            parts.append(f"phase {self.last_phase} '{self.last_name}' {self.trained_steps} -> {self.new_length} steps")
        parts += [f"appended phase {index} '{name}' ({steps} steps)" for index, name, steps in self.appended]
        return ", ".join(parts)

    def describe(self) -> str:
        return (
            f"extending the run finished at global step {self.global_step}: {self.added()}; from {self.checkpoint}; "
            f"its final model is kept as {self.kept_final}/"
        )

    def record(self) -> dict[str, Any]:
        """The `extended` entry of `resume_history.yaml`."""
        record: dict[str, Any] = {"finished_at_global_step": self.global_step, "previous_final": f"{self.kept_final}/"}
        if self.new_length is not None:
            record["last_phase"] = {"index": self.last_phase, "name": self.last_name,
                                    "max_steps": {"old": self.trained_steps, "new": self.new_length}}  # fmt: skip
        if self.appended:
            record["appended_phases"] = [
                {"index": index, "name": name, "max_steps": steps} for index, name, steps in self.appended
            ]
        return record

    def keep_previous_final(self) -> None:
        """Main process, before training: rename `final/` to `kept_final/`, recorded in the manifest first (it is the
        run's, so `--overwrite` deletes it; a folder of that name the run did not write is never touched)."""
        record_outputs(self.run_dir, [f"{self.kept_final}/"])
        os.replace(self.run_dir / FINAL_DIR_NAME, self.run_dir / self.kept_final)


def plan_extension(
    state: FolderState, recipe: Any, allow_changes: bool, data_now: dict[str, dict[str, str]] | None = None
) -> Extension | None:
    """For `train --resume` on a finished run (`state.finished`): the `Extension` the recipe asks for, or None when it
    asks for nothing more than the run did (nothing to do). Raises `ChangedRecipeError` (exit 2, nothing loaded or
    changed) for what a continuation cannot honour, and for an extension without `allow_changes`."""
    run_dir, finished = state.path, state.finished or {}
    phases = recipe.resolved_phases
    saved = state.checkpoint_state or {}
    altering = [change for change in _changes(run_dir, recipe.raw, data_now, saved) if change.alters_training]
    reached = saved.get("global_step_offset", 0) + saved.get("phase_global_step", 0)  # where the checkpoint is
    at_end = state.latest_checkpoint is not None and reached == finished.get("global_step")
    if not at_end:
        if altering or len(phases) > int(finished.get("phases") or 0):
            raise ChangedRecipeError(_no_last_checkpoint(state, altering))
        return None
    last, trained, reason = saved["phase_index"], saved["phase_global_step"], saved.get("phase_end_reason")
    if len(phases) <= last:
        raise ChangedRecipeError(
            f"--resume: {run_dir}/ trained {last + 1} phases and this recipe has {len(phases)}: a phase that trained "
            f"cannot be removed. Nothing was loaded or changed. Keep the run's phases (0-{last}) as recorded. "
            f"{_what_extends(last, saved.get('phase_name', ''), trained)}"
        )
    phase = phases[last]
    grows = phase.max_steps > trained and reason == "max_steps"
    _refuse_changes_to_trained_phases(run_dir, recipe.raw, altering, last, phase, trained, grows, reason)
    appended = [(later.index, later.name, later.max_steps) for later in phases[last + 1 :]]
    if not grows and not appended:
        if altering:
            listed = "\n".join(f"  {change.describe()}" for change in altering)
            raise ChangedRecipeError(
                f"--resume: {state.describe()}; the recipe changes settings that alter training but adds no step:\n"
                f"{listed}\nNothing would train with them: nothing was loaded or changed. "
                f"{_what_extends(last, phase.name, trained)} To train with these settings from the start, use another "
                "--training.output_dir (or --overwrite)."
            )
        return None
    extension = Extension(
        run_dir=run_dir,
        checkpoint=state.latest_checkpoint,
        last_phase=last,
        last_name=phase.name,
        trained_steps=trained,
        global_step=int(finished["global_step"]),
        new_length=phase.max_steps if grows else None,
        appended=appended,
        kept_final=_free_name(run_dir, f"{FINAL_DIR_NAME}-phase{last}-step{finished['global_step']}"),
    )
    if not allow_changes:
        raise ChangedRecipeError(
            f"--resume: {state.describe()}, and the recipe asks for more: {extension.added()}.\n"
            "Nothing was loaded or changed. Extending a finished run changes its recipe: pass --allow-changes with "
            "--resume to train on from its last checkpoint (the steps trained are kept, the changes recorded in "
            "resume_history.yaml); or drop the added steps and phases to leave the run as it is."
        )
    if f"{FINAL_DIR_NAME}/" not in state.outputs:
        raise ChangedRecipeError(
            f"--resume: {run_dir / FINAL_DIR_NAME}/ is not recorded as this run's output, so it is not renamed to make "
            f"room for the extended run's. Nothing was loaded or changed. Move it out of {run_dir}/, then resume again."
        )
    return extension


def extended_plan(
    plan: Any, recipe: Any, allow_changes: bool, data_now: dict[str, dict[str, str]] | None
) -> tuple[Any, Extension | None]:
    """`plan_start`'s plan as `train` and `validate` follow it: a finished run the recipe extends becomes a resume from
    the checkpoint of its last step (with the extension), anything else is left as planned."""
    extension = plan_extension(plan.state, recipe, allow_changes, data_now) if plan.finished else None
    if extension is not None:
        plan = replace(plan, finished=False, resume=str(extension.checkpoint), note=extension.describe())
    return plan, extension


def _changes(
    run_dir: Path, current: dict[str, Any], data_now: dict[str, dict[str, str]] | None, saved: dict[str, Any]
) -> list[Change]:
    """The recipe's changes against the run's recorded one (and its data files'), as a resume from the checkpoint
    (`saved`: its `prorl_state.json`) sees them: both as recorded up to its global step."""
    changes = recorded_changes(run_dir, current, saved) or []
    step = checkpoint_global_step(saved)
    return changes + (data_file_changes(run_dir, data_now, step) if data_now is not None else [])


def _refuse_changes_to_trained_phases(
    run_dir: Path, current: dict[str, Any], altering: list[Change], last: int, phase: Any, trained: int, grows: bool,
    reason: str | None,
) -> None:  # fmt: skip
    """The phases that trained keep their settings (`phases.<i>.*`) and lengths (also through `training.max_steps`):
    every phase before the last, and the last one unless it gets more steps. The last phase is not made shorter than
    it trained, and a phase that ended otherwise than at its `max_steps` (a plateau stop) gets no more steps."""
    recorded = recorded_recipe(run_dir)
    now = flatten(canonical(current))
    if 0 < phase.max_steps < trained:
        raise ChangedRecipeError(
            f"--resume: phase {last} '{phase.name}' of {run_dir}/ trained {trained} steps, and this recipe makes it "
            f"{phase.max_steps} steps long: the steps trained cannot be taken back. Nothing was loaded or changed. "
            f"{_what_extends(last, phase.name, trained)}"
        )
    if reason != "max_steps" and recorded is not None and _length(recorded, last) != _length(now, last):
        raise ChangedRecipeError(
            f"--resume: phase {last} '{phase.name}' of {run_dir}/ ended at step {trained} by "
            f"{reason or 'an end its checkpoint did not record'}, not at its max_steps: more steps cannot continue "
            f"it (a plateau stop stays a stop). Nothing was loaded or changed. Keep its max_steps, and append a phase "
            f"instead (`--phases.{last + 1}.max_steps N` with its settings, or a longer `phases:` list)."
        )
    finished = last if grows else last + 1  # phases below this index keep what they trained with
    edited = [
        change for change in altering
        if (index := phase_of_key(change.key)) is not None and index < finished
        and not (change.key == f"phases.{last}.max_steps" and change.new == trained)  # the length it trained
    ]  # fmt: skip
    lengths = [
        f"  phase {index}: max_steps {_length(recorded, index)} -> {_length(now, index)} (from `training.max_steps`)"
        for index in range(last)
        if recorded is not None and _length(recorded, index) != _length(now, index)
        and not any(change.key == f"phases.{index}.max_steps" for change in edited)
    ]  # fmt: skip
    if edited or lengths:
        listed = "\n".join([f"  {change.describe()}" for change in edited] + lengths)
        raise ChangedRecipeError(
            f"--resume: these settings are of phases of {run_dir}/ that already trained, so they cannot take "
            f"effect:\n{listed}\nNothing was loaded or changed. Keep the trained phases as recorded. "
            f"{_what_extends(last, phase.name, trained)}"
        )


def _length(flat: dict[str, Any], index: int) -> Any:
    """Phase `index`'s `max_steps` as a flattened recipe sets it: its own, else `training.max_steps`."""
    return flat.get(f"phases.{index}.max_steps", flat.get("training.max_steps"))


def _what_extends(last: int, name: str, trained: int) -> str:
    return (
        f"A finished run can be extended with more steps in its last phase (`--phases.{last}.max_steps N`, N > "
        f"{trained}, for phase {last} '{name}') or with phases appended after it (`--phases.{last + 1}.max_steps N` "
        "and its settings, or a longer `phases:` list in the recipe), passing --resume --allow-changes."
    )


def _no_last_checkpoint(state: FolderState, altering: list[Change]) -> str:
    from ..trainer.output_guard import describe_checkpoint

    latest = describe_checkpoint(state) if state.latest_checkpoint is not None else "none"
    listed = ":" + "".join(f"\n  {change.describe()}" for change in altering) if altering else " in its phases"
    return (
        f"--resume: {state.describe()}, and the recipe differs from the one it trained with{listed}"
        f"\nThe run kept no complete checkpoint of its last step (latest: {latest}), and a finished run is continued "
        "only from there (its weights, optimizer state and random state). Nothing was loaded or changed. Start a new "
        f"run from its final model instead (`--model.name_or_path {state.path / FINAL_DIR_NAME} --training.output_dir "
        "NEW_FOLDER`). A run that saves checkpoints (`save_strategy: steps`, which also saves every phase's last step) "
        "can be extended."
    )


def _free_name(run_dir: Path, name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... when a file or folder of that name exists (nothing is ever overwritten)."""
    candidate, number = name, 1
    while os.path.lexists(run_dir / candidate):
        number += 1
        candidate = f"{name}-{number}"
    return candidate

