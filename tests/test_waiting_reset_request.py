"""A reset on demand still waiting in the run folder at a resume (`prorl-trl reset` written while the job was down,
acted on at the resumed job's first step end, so in no checkpoint yet) against the resume's recipe changes, through
the functions `prorl-trl train --resume` calls (`resume_changes`, then `write_run_recipe`), as
tests/test_resume_by_step.py does for a recorded reset. No model is loaded: each test takes well under a second.

* A setting of a phase the waiting request will skip, or a new length of the phase it will end, is refused (even
  with --allow-changes, nothing written), naming the request and how to withdraw it: before, it was accepted and
  recorded, and the request then made it void at the first step end.
* A waiting request this resume's own change makes unfit (its phase removed, or no longer after the phase the run
  resumes into) is refused the same way. One that is unfit anyway (hand-written, or a resume that already starts the
  phase it names) is left to the job, which files it as refused with a warning, as for a running job: an unchanged
  resume (a requeued job) is never blocked by a request file.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_resume_by_step import RECIPE, commit, refusal, resume, start, with_phase

from prorl_trl.recipe.changes import RESUME_HISTORY_NAME, ChangedRecipeError, resume_changes
from prorl_trl.trainer.on_demand import REQUEST_NAME, write_reset_request


def phases_set(*settings: dict[str, Any]) -> dict:
    """The test recipe with `settings[i]` set on phase i."""
    recipe = copy.deepcopy(RECIPE)
    for phase, more in zip(recipe["phases"], settings):
        phase.update(more)
    return recipe


def described(changes: list) -> list[str]:
    return [change.describe() for change in changes]


@pytest.fixture
def waiting(tmp_path):
    """A run of phases 'first' (4 steps), 'middle' (2), 'last' (2) stopped at its checkpoint of phase 0's step 2;
    then `prorl-trl reset RUN --to-phase 2 --reason stalled`: the resumed job ends phase 0 at global step 3 and
    skips phase 1."""
    run = tmp_path / "run"
    start(run)
    checkpoint = commit(run, 0, 2)
    request = write_reset_request(run, 2, "stalled")
    return run, checkpoint, request


def test_a_setting_of_a_phase_the_waiting_request_skips_is_refused(waiting):
    """Before the fix: accepted with --allow-changes and recorded in resume_history.yaml, then phase 1 was skipped at
    the first step end. (Inherited by phase 2, the value would have reached phase 2 under phase 1's name.)"""
    run, checkpoint, request = waiting
    told = refusal(run, checkpoint, recipe=with_phase(1, temperature=1.7), allow_changes=True)
    assert "phases.1.temperature: (not set) -> 1.7" in told
    assert f"a reset on demand is waiting in {run / REQUEST_NAME} (id {request['request_id']}, to_phase 2" in told
    assert "ends phase 0 at global step 3 and skips phase 1 before starting phase 2" in told
    assert "Nothing was loaded or changed" in told and "Drop those overrides" in told
    assert f"delete {run / REQUEST_NAME}" in told and "`--phases.2.<key> VALUE`" in told
    assert (run / REQUEST_NAME).is_file() and not (run / RESUME_HISTORY_NAME).exists()


def test_a_new_length_of_the_phase_the_waiting_request_ends_is_refused(waiting):
    """Longer, or ending at the step the request ends it anyway: the request ends phase 0 after global step 3
    whatever its length. A length that ends phase 0 at the checkpoint (2) applies: the run then resumes into phase 1,
    the request ends phase 1 after its first step, and phase 1's length is the one refused."""
    run, checkpoint, _ = waiting
    for length in (6, 3):
        told = refusal(run, checkpoint, recipe=with_phase(0, max_steps=length), allow_changes=True)
        assert f"phases.0.max_steps: 4 -> {length}" in told and "ends phase 0 at global step 3" in told
    told = refusal(run, checkpoint, recipe=phases_set({"max_steps": 2}, {"max_steps": 5}), allow_changes=True)
    assert "phases.1.max_steps: 2 -> 5" in told and "ends phase 1 at global step 3" in told
    changes = resume(run, checkpoint, recipe=with_phase(0, max_steps=2), allow_changes=True)
    assert described(changes) == ["phases.0.max_steps: 4 -> 2"]


def test_settings_the_waiting_request_leaves_in_effect_are_accepted(waiting):
    """The phase it starts and later ones, the phase it ends (one step of it trains) except its length, `training`;
    and the same change without a waiting request."""
    run, checkpoint, _ = waiting
    both = phases_set({"temperature": 0.9}, {}, {"temperature": 1.7})
    changes = resume(run, checkpoint, recipe=both, allow_changes=True)
    assert described(changes) == ["phases.0.temperature: (not set) -> 0.9", "phases.2.temperature: 1.0 -> 1.7"]
    (run / REQUEST_NAME).unlink()  # withdrawn: phase 1 trains, so its settings apply
    changes = resume(run, checkpoint, recipe=with_phase(1, temperature=1.7), allow_changes=True)
    assert "phases.1.temperature: (not set) -> 1.7" in described(changes)


def test_a_waiting_request_without_to_phase_ends_the_phase_and_skips_none(waiting):
    run, checkpoint, _ = waiting
    write_reset_request(run, None, "")  # replaces the waiting one
    told = refusal(run, checkpoint, recipe=with_phase(0, max_steps=6), allow_changes=True)
    assert "to_phase next" in told and "ends phase 0 at global step 3 before starting phase 1" in told
    changes = resume(run, checkpoint, recipe=with_phase(1, temperature=1.7), allow_changes=True)
    assert described(changes) == ["phases.1.temperature: (not set) -> 1.7"]


def test_a_request_the_checkpoint_already_acted_on_is_not_waiting(tmp_path):
    """Killed between the checkpoint of the reset and the request's filing: the job only files it (its id is
    recorded), so it ends nothing and phase 1's length applies."""
    run = tmp_path / "run"
    start(run)
    request = write_reset_request(run, None, "")
    record = {"step": 2, "from_phase": 0, "to_phase": 1, "request_id": request["request_id"]}
    checkpoint = commit(run, 1, 1, offset=2, on_demand_resets=[record])
    changes = resume(run, checkpoint, recipe=with_phase(1, max_steps=5), allow_changes=True)
    assert described(changes) == ["phases.1.max_steps: 2 -> 5"]


def test_a_waiting_request_this_resumes_change_makes_unfit_is_refused(waiting):
    """Phase 2 removed: the job would refuse the request at its first step end (filed with a warning) and train on
    in phase 0, which the request asked to end. Refused before anything is written; before the fix, accepted."""
    run, checkpoint, request = waiting
    two_phases = copy.deepcopy(RECIPE)
    two_phases["phases"].pop()
    told = refusal(run, checkpoint, recipe=two_phases, allow_changes=True)
    assert f"a reset on demand is waiting in {run / REQUEST_NAME} (id {request['request_id']}, to_phase 2" in told
    assert "to_phase=2 is no phase of the run (phases: 0 'first', 1 'middle')" in told
    assert "this resume's changes" in told and f"delete {run / REQUEST_NAME}" in told
    assert "Nothing was loaded or changed" in told


def test_a_waiting_request_unfit_anyway_is_left_to_the_job(waiting):
    """Hand-written with a phase the run never had, or naming the phase a resume from a phase's last checkpoint
    starts anyway, or not a request at all: the job files it as refused with a warning; the resume goes on."""
    run, _, _ = waiting
    last = commit(run, 0, 4, phase_complete=True)
    for text in ('{"to_phase": 7}', '{"to_phase": 1}', "not json"):
        (run / REQUEST_NAME).write_text(text)
        resume_changes(str(last), run, with_phase(1, temperature=1.7), True)  # not refused
    (run / REQUEST_NAME).write_text(json.dumps({"to_phase": 7}))
    two_phases = copy.deepcopy(RECIPE)
    two_phases["phases"].pop()
    assert "phases.2.name: last -> (not set)" in described(resume_changes(str(last), run, two_phases, True))


def test_a_waiting_request_is_read_from_the_folder_the_job_writes(waiting, tmp_path):
    """A checkpoint continued into a new output folder: the job reads the request of its own folder."""
    run, checkpoint, _ = waiting
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert len(resume_changes(str(checkpoint), other, with_phase(1, temperature=1.7), True)) == 1
    write_reset_request(other, 2, "")
    with pytest.raises(ChangedRecipeError, match="waiting in"):
        resume_changes(str(checkpoint), other, with_phase(1, temperature=1.7), True)
