"""What a resume from a given checkpoint is compared with (review of 2026-11-29), through the functions `prorl-trl
train` calls in that order (`resume_changes` before anything loads, `write_run_recipe` once the resume is accepted),
on run folders laid out as a run writes them (`recipe.yaml`, `data_files.json`, `resume_history.yaml`, checkpoints
committed by their `prorl_state.json`). No model is loaded: each test takes well under a second.

* The local data files are compared with what they held at the checkpoint's global step, as recipe keys are: a
  resume from an older checkpoint, after a later resume accepted new bytes, is not compared with those new bytes.
* A setting of a phase that a reset on demand (`prorl-trl reset --to-phase N`) jumped over is refused: that phase
  never trains. So is a new length of a phase its checkpoint ended otherwise than at its length (a reset on demand).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from prorl_trl.data.fingerprint import file_fingerprint
from prorl_trl.recipe.changes import (
    DATA_FILES_NAME,
    RESUME_HISTORY_NAME,
    ChangedRecipeError,
    resume_changes,
    write_run_recipe,
)

RECIPE = {
    "training": {"learning_rate": 1e-4},
    "phases": [{"name": "first", "max_steps": 4}, {"name": "middle", "max_steps": 2},
               {"name": "last", "max_steps": 2, "temperature": 1.0}],
}


def commit(run: Path, phase: int, step: int, offset: int = 0, **state: Any) -> Path:
    """A checkpoint of phase `phase` at its step `step` (global step `offset + step`), committed as the trainer
    commits one (`prorl_state.json`, the fields a resume reads)."""
    checkpoint = run / f"phase-{phase}" / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    record = {"phase_index": phase, "phase_global_step": step, "global_step_offset": offset,
              "global_step": offset + step, "resets": phase, "phase_complete": False, "phase_end_reason": "max_steps",
              **state}  # fmt: skip
    (checkpoint / "prorl_state.json").write_text(json.dumps(record))
    return checkpoint


def held(train: Path) -> dict[str, dict[str, str]]:
    """What `split_fingerprints` gives for a recipe whose train split is the local file `train`."""
    return {"train": {"file": str(train), "fingerprint": file_fingerprint(train)}}


def start(run: Path, data_now: dict[str, dict[str, str]] | None = None, recipe: dict = RECIPE) -> None:
    run.mkdir(parents=True, exist_ok=True)
    write_run_recipe(run, yaml.safe_dump(recipe), None, [], data_now)


def resume(run: Path, checkpoint: Path, data_now=None, allow_changes=False, recipe: dict = RECIPE) -> list:
    """A resume as `prorl-trl train --resume CHECKPOINT` makes it: compared (exit 2 on refusal), then recorded."""
    changes = resume_changes(str(checkpoint), run, recipe, allow_changes, data_now)
    write_run_recipe(run, yaml.safe_dump(recipe), str(checkpoint), changes, data_now)
    return changes


def files_of(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}


def refusal(run: Path, checkpoint: Path, **kwargs: Any) -> str:
    """The message of a refused resume, which leaves the run folder as it was."""
    before = files_of(run)
    with pytest.raises(ChangedRecipeError) as refused:
        resume(run, checkpoint, **kwargs)
    assert files_of(run) == before
    return " ".join(refused.value.render().split())


# ---------------------------------------------------------------------------------------------- data files by step
@pytest.fixture
def changed_data_at_step_4(tmp_path):
    """A run started on data A, checkpoints at global steps 2 and 4 (phase 0's last); the train file rewritten (B)
    and the run resumed from step 4 with --allow-changes: `resume_history.yaml` records the change at step 4, and
    `data_files.json` holds B (the bytes of the last resume that accepted a change, as before the fix)."""
    train, run = tmp_path / "data" / "train.jsonl", tmp_path / "run"
    train.parent.mkdir()
    train.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n')
    data_a = held(train)
    start(run, data_a)
    two, four = commit(run, 0, 2), commit(run, 0, 4, phase_complete=True)
    train.write_text('{"question": "2+2", "answer": "4"}\n{"question": "1+1", "answer": "2"}\n')  # same size
    data_b = held(train)
    [change] = resume(run, four, data_b, allow_changes=True)
    assert change.key == f"data file (train) {train}" and (change.old, change.new) == (
        data_a["train"]["fingerprint"], data_b["train"]["fingerprint"])  # fmt: skip
    assert yaml.safe_load((run / RESUME_HISTORY_NAME).read_text())[0]["global_step"] == 4
    assert json.loads((run / DATA_FILES_NAME).read_text()) == data_b
    return run, train, two, four, data_a["train"]["fingerprint"], data_b["train"]["fingerprint"], data_a, data_b


def test_an_older_checkpoint_is_compared_with_what_the_data_held_at_its_step(changed_data_at_step_4):
    """Checkpoint 2 trained on A. Resumed with B it is the change again (refused, naming the file, old -> new);
    resumed with A it is none. Before the fix it was compared with the latest record (B): the change to B passed
    silently, and A was refused as a change."""
    run, train, two, four, a, b, data_a, data_b = changed_data_at_step_4
    told = refusal(run, two, data_now=data_b)
    assert f"data file (train) {train}: {a} -> {b}" in told and "up to global step 2" in told
    assert "--allow-changes" in told
    assert resume(run, two, data_a) == []  # A, as checkpoint 2 trained: nothing to confirm
    # that resume abandoned the path of the change at step 4: a checkpoint written after it trained on A as well
    three = commit(run, 0, 3)
    assert resume(run, three, data_a) == []
    assert f"{a} -> {b}" in refusal(run, three, data_now=data_b)


def test_the_checkpoint_of_the_change_and_later_ones_are_compared_with_the_new_bytes(changed_data_at_step_4):
    run, train, two, four, a, b, data_a, data_b = changed_data_at_step_4
    assert resume(run, four, data_b) == []
    later = commit(run, 1, 1, offset=4)
    assert resume(run, later, data_b) == []
    assert f"{b} -> {a}" in refusal(run, later, data_now=data_a)  # back to A after the change: a change


def test_a_change_accepted_at_an_older_checkpoint_is_recorded_at_its_step(changed_data_at_step_4):
    """Checkpoint 2 resumed with B and --allow-changes: recorded at step 2 as A -> B (before the fix: not seen at
    all, nothing recorded), and the path from there is compared with B."""
    run, train, two, four, a, b, data_a, data_b = changed_data_at_step_4
    [change] = resume(run, two, data_b, allow_changes=True)
    assert (change.old, change.new) == (a, b)
    last = yaml.safe_load((run / RESUME_HISTORY_NAME).read_text())[-1]
    assert last["global_step"] == 2 and [c["key"] for c in last["changes"]] == [f"data file (train) {train}"]
    three = commit(run, 0, 3)
    assert resume(run, three, data_b) == []


def test_run_folders_without_data_changes_in_their_history_compare_with_data_files_json(tmp_path):
    """Folders whose records say nothing by step about the data (no history; history entries without a data change,
    or without a `global_step`: plain TRL checkpoints) compare every checkpoint with `data_files.json`, as before; a
    folder without `data_files.json` (runs from before it was written, hub data) compares no data file."""
    train, run = tmp_path / "train.jsonl", tmp_path / "run"
    train.write_text("a\n")
    data_a = held(train)
    start(run, data_a)
    two, four = commit(run, 0, 2), commit(run, 0, 4)
    train.write_text("b\n")
    data_b = held(train)
    assert f"data file (train) {train}" in refusal(run, two, data_now=data_b)
    history = [{"time": "t", "checkpoint": None, "command": "c", "changes": [
        {"key": "training.seed", "new": 3, "alters_training": True}]}]  # fmt: skip
    (run / RESUME_HISTORY_NAME).write_text(yaml.safe_dump(history))  # an entry without a global step
    recipe = {**RECIPE, "training": {**RECIPE["training"], "seed": 3}}
    assert f"data file (train) {train}" in refusal(run, four, data_now=data_b, recipe=recipe)
    assert resume(run, two, data_a, recipe=recipe) == []
    (run / DATA_FILES_NAME).unlink()
    assert resume(run, four, data_b, recipe=recipe) == []  # nothing recorded to compare with


# ------------------------------------------------------------------------------------- phases a reset skipped
JUMP = {"step": 2, "phase_step": 2, "from_phase": 0, "from_phase_name": "first", "to_phase": 2, "to_phase_name": "last",
        "reason": "stalled", "steps_not_trained": 2, "skipped_phases": [1], "request_id": "r1", "requested_at": None}


def with_phase(index: int, **settings: Any) -> dict:
    recipe = copy.deepcopy(RECIPE)
    recipe["phases"][index].update(settings)
    return recipe


@pytest.fixture
def jumped(tmp_path):
    """A run whose phase 0 was ended at its step 2 by `prorl-trl reset --to-phase 2`: the checkpoint of that step
    records the jump (phase 1 skipped); the run went on in phase 2 (its checkpoint at global step 3)."""
    run = tmp_path / "run"
    start(run)
    at_reset = commit(run, 0, 2, phase_complete=True, phase_end_reason="reset on demand (stalled)",
                      on_demand_resets=[JUMP])  # fmt: skip
    after = commit(run, 2, 1, offset=2, on_demand_resets=[JUMP])
    return run, at_reset, after


def test_a_setting_of_a_phase_a_reset_on_demand_skipped_is_refused(jumped):
    """From the checkpoint of the reset, the run goes on in phase 2: phase 1 never trains, and phase 2 sets its own
    temperature, so a new phase-1 temperature would be recorded and have no effect. Refused even with
    --allow-changes, saying why and what to do; before the fix it was accepted (and recorded in resume_history.yaml).
    (Where phase 2 inherits the setting, the change took effect there while the record named phase 1: refused too,
    pointing at `--phases.2.<key>`; tests/test_reset_on_demand.py shows it through the CLI.)"""
    run, at_reset, _ = jumped
    told = refusal(run, at_reset, recipe=with_phase(1, temperature=1.7), allow_changes=True)
    assert "phases.1.temperature: (not set) -> 1.7" in told
    assert "resumes into phase 2" in told and "phase 1 never trains" in told
    assert "the reset on demand at global step 2 (`prorl-trl reset --to-phase 2`) ended phase 0" in told
    assert "Nothing was loaded or changed" in told and "Drop those overrides" in told
    assert "before global step 2" in told  # how to train phase 1 after all: a checkpoint before the reset
    assert "`--phases.2.<key> VALUE`" in told  # how to change what the phase that trains next uses
    assert not (run / RESUME_HISTORY_NAME).exists()


def test_a_setting_of_the_phase_a_reset_on_demand_jumped_to_or_a_later_one_is_accepted(jumped):
    run, at_reset, _ = jumped
    changes = resume(run, at_reset, recipe=with_phase(2, temperature=1.7), allow_changes=True)
    assert [change.describe() for change in changes] == ["phases.2.temperature: 1.0 -> 1.7"]


def test_a_checkpoint_after_the_jump_names_the_skipped_phase_as_skipped(jumped):
    """Already refused before the fix (phase 1 is below the checkpoint's phase), as a phase that was 'finished'."""
    run, _, after = jumped
    told = refusal(run, after, recipe=with_phase(1, temperature=1.7), allow_changes=True)
    assert "phases.1.temperature: (not set) -> 1.7" in told and "skipped" in told


def test_a_new_length_of_the_phase_a_reset_on_demand_ended_is_refused(jumped):
    """The phase ended by the reset stays ended whatever its `max_steps` (`resumed_phase_complete`): a longer or a
    shorter length would be recorded and have no effect. Before the fix the own phase's length was let through."""
    run, at_reset, _ = jumped
    for length in (6, 1):
        told = refusal(run, at_reset, recipe=with_phase(0, max_steps=length), allow_changes=True)
        assert f"phases.0.max_steps: 4 -> {length}" in told and "phase 0 has no step left" in told
