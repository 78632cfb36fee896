"""`prorl-trl reset OUTPUT_DIR` without --to-phase: the phase the verb says ends is the one the job ends, or the job
refuses the request; it never carries it one phase further.

Before the fix the request held `to_phase: null`, read by the job as "end the phase I am in now". The verb answered
from the folder (the latest checkpoint's phase) and said "the next phase"; a job that read the request after it had
gone on to the following phase (the request written at a phase's last step, or a run stopped at a phase's last
checkpoint and resumed into the next) ended that phase and started the one after it: one phase further than the
request was written for. The verb now records the phase the folder shows the job in (`written_in_phase`; after a
phase's last checkpoint, the next phase) and names the target; a job in another phase files the request as refused.
A request without `written_in_phase` (an older version's, or hand-written) keeps `to_phase: null`'s old meaning.

CLI runs go through tests/_kill_launcher.py (the real CLI; `PRORL_TEST_REQUEST_AT` writes a request file at an exact
step, as a request in flight arrives); the verb runs in this process. Three phases of 3, 2 and 1 steps on the tiny
model, from one run stopped before its step 2 (checkpoint of step 1, phase 0), copied for each test: one or two CLI
processes per test. The other tests use run folders laid out as a run writes them (tests/test_resume_by_step.py) and
load no model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_reset_on_demand import console, summary, verb
from test_resume_by_step import RECIPE, commit, refusal, resume, start, with_phase
from test_resume_cli import cli, history

from prorl_trl.trainer.on_demand import RECORDS_FOLDER, REQUEST_NAME, parse_request, waiting_request

PHASES = ["--phases", "[{name: first, max_steps: 3}, {name: middle, max_steps: 2},"
          " {name: last, max_steps: 1, lora_r: 2, lora_alpha: 4}]", "--validation.eval_steps", "100"]  # fmt: skip
NAMES = ["first", "middle", "last"]


@pytest.fixture(scope="module")
def stopped(tiny_dir, shared_data, tmp_path_factory):
    """The run killed before its step 2: its latest checkpoint is phase 0's step 1 (a checkpoint every step)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    killed = cli(out, tiny_dir, shared_data, *PHASES, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    return out


def copied(stopped: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    return out


def phases_trained(out: Path) -> list[tuple[int, int]]:
    """(global step, phase) of every step the run trained."""
    return [(entry["prorl/global_step"], entry["prorl/phase"]) for entry in history(out) if "loss" in entry]


def said(printed: str) -> tuple[int, int]:
    """The phases the verb said the job ends and starts."""
    match = re.search(r"the job ends phase (\d+) '\w+' at its next step end .*?, hard-resets and starts phase (\d+)",
                      printed)  # fmt: skip
    assert match is not None, printed
    return int(match[1]), int(match[2])


# ------------------------------------------------------------------------------------------- the job, through the CLI
def test_a_request_without_to_phase_read_a_phase_later_is_refused_not_carried_one_phase_further(
    stopped, tiny_dir, shared_data, tmp_path, capsys
):
    """The verb reads the folder while the job is in phase 0; the job reads the request only at the end of phase 1's
    first step (global step 4), having gone on past phase 0's end first (as when the verb read the folder just before
    phase 0's last checkpoint). Before the fix it ended phase 1 there and jumped to phase 2, one phase further than
    the request was written for (phase 1's second step never trained). Now the request is filed as refused with the
    reason, and every phase trains to its length."""
    out = copied(stopped, tmp_path)
    status, _, error = verb(capsys, str(out), "--reason", "stalled")
    assert status == 0, error
    text = (out / REQUEST_NAME).read_text()
    (out / REQUEST_NAME).unlink()  # in flight: the job sees it at the start of phase 1's first step
    resumed = cli(out, tiny_dir, shared_data, *PHASES, "--resume", env={"PRORL_TEST_REQUEST_AT": f"1:1={text}"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert phases_trained(out) == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 2)]  # no phase cut short or skipped
    printed = console(resumed)
    assert "Reset on demand at global step" not in printed
    assert (
        "Reset on demand refused at global step 4: prorl_reset_request.json written_in_phase=0 is not the phase the "
        "job is in, 1 'middle' (phase 0 is over): written by `prorl-trl reset` without --to-phase to end phase 0 "
        "'first' and start phase 1 'middle', the request does not end another phase. Training goes on in phase 1 "
        "'middle'"
    ) in printed
    assert not summary(out).get("on_demand_resets")
    filed = sorted(path.name for path in (out / RECORDS_FOLDER).iterdir())
    assert filed == ["refused-step-4.json"] and not (out / REQUEST_NAME).exists()
    assert (out / RECORDS_FOLDER / filed[0]).read_text() == text


def test_without_to_phase_the_job_ends_the_phase_the_verb_names(stopped, tiny_dir, shared_data, tmp_path, capsys):
    """The normal case: the job is in the phase its latest checkpoint shows (phase 0, step 1). The verb names the
    phases (before the fix: "starts the next phase") and the resumed job does exactly that at its first step end."""
    out = copied(stopped, tmp_path)
    status, printed, error = verb(capsys, str(out), "--reason", "stalled")
    printed = " ".join(printed.split())
    assert status == 0, error
    assert ("the job ends phase 0 'first' at its next step end (the latest checkpoint is in phase 0), hard-resets and "
            "starts phase 1 'middle'. A job that has left phase 0 when it reads the request refuses it") in printed
    request = json.loads((out / REQUEST_NAME).read_text())
    assert {key: request[key] for key in ("to_phase", "to_phase_given", "written_in_phase")} == {
        "to_phase": 1, "to_phase_given": False, "written_in_phase": 0}  # fmt: skip
    resumed = cli(out, tiny_dir, shared_data, *PHASES, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("Reset on demand at global step 2 (stalled): phase 0 'first' ends after 2 steps, its remaining 1 steps are "
            "not trained; then hard reset and phase 1 'middle'") in console(resumed)
    [record] = summary(out)["on_demand_resets"]
    assert (record["from_phase"], record["to_phase"]) == said(printed) == (0, 1)
    assert phases_trained(out) == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]


def test_at_a_phases_last_checkpoint_the_verb_names_the_phase_the_job_is_in_and_the_job_ends_that_one(
    stopped, tiny_dir, shared_data, tmp_path, capsys
):
    """The job stopped right after phase 0's last checkpoint: it resumes into phase 1. Before the fix the verb said
    "starts the next phase" from a folder whose latest checkpoint is in phase 0 (so phase 1), and the job ended phase
    1 and started phase 2. Now the verb says phase 1 ends and phase 2 starts, and the job does that."""
    out = copied(stopped, tmp_path)
    killed = cli(out, tiny_dir, shared_data, *PHASES, "--resume", env={"PRORL_TEST_KILL_AT": "on_train_end:0:3"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    status, printed, error = verb(capsys, str(out))
    printed = " ".join(printed.split())
    assert status == 0, error
    assert ("the job ends phase 1 'middle' at its next step end (the latest checkpoint ends phase 0: the job is in "
            "phase 1 or resumes into it), hard-resets and starts phase 2 'last'.") in printed
    resumed = cli(out, tiny_dir, shared_data, *PHASES, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("Reset on demand at global step 4: phase 1 'middle' ends after 1 steps, its remaining 1 steps are not "
            "trained; then hard reset and phase 2 'last'") in console(resumed)
    [record] = summary(out)["on_demand_resets"]
    assert (record["from_phase"], record["to_phase"]) == said(printed) == (1, 2)


def test_a_request_of_the_old_format_read_a_phase_later_still_ends_the_phase_the_job_is_in(
    stopped, tiny_dir, shared_data, tmp_path
):
    """The same moment as the refused request above, with a request file of the old format (no `written_in_phase`,
    `to_phase: null`: from an older version, or by hand): its meaning is unchanged, the phase the job is in when it
    reads it ends (phase 1, at global step 4) and the next one starts."""
    out = copied(stopped, tmp_path)
    old = '{"request_id": "old-1", "to_phase": null, "reason": "old format"}'
    resumed = cli(out, tiny_dir, shared_data, *PHASES, "--resume", env={"PRORL_TEST_REQUEST_AT": f"1:1={old}"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("Reset on demand at global step 4 (old format): phase 1 'middle' ends after 1 steps, its remaining 1 steps "
            "are not trained; then hard reset and phase 2 'last'") in console(resumed)
    assert phases_trained(out) == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 2)]
    assert sorted(path.name for path in (out / RECORDS_FOLDER).iterdir()) == ["handled-step-4.json"]


# ----------------------------------------------------------------------------------- the request and --resume, no model
def test_the_request_records_its_phase_and_a_job_in_another_phase_refuses_it(tmp_path):
    """`request_target` (what the job and `--resume` check): a request written without --to-phase in phase 1 leads to
    phase 2 only from phase 1; one naming its phase acts from any phase before it; fields that contradict each other
    are refused when read."""
    from prorl_trl.trainer.on_demand import request_target, write_reset_request

    written = write_reset_request(tmp_path, None, "why", written_in_phase=1)
    request = parse_request((tmp_path / REQUEST_NAME).read_text())
    assert request == written and (request["to_phase"], request["to_phase_given"]) == (2, False)
    assert request_target(request, 1, NAMES) == 2
    with pytest.raises(ValueError, match=r"not the phase the job is in, 2 'last' \(phase 1 is over\)"):
        request_target(request, 2, NAMES)
    with pytest.raises(ValueError, match=r"job is in, 0 'first' \(an earlier one: resumed from an earlier checkpoint"):
        request_target(request, 0, NAMES)
    named = parse_request(json.dumps({"to_phase": 2, "written_in_phase": 0}))
    assert named["to_phase_given"] and request_target(named, 1, NAMES) == 2
    for bad, says in (({"to_phase": 1, "to_phase_given": False, "written_in_phase": 1}, "the next phase is 2"),
                      ({"to_phase_given": False}, "without written_in_phase"),
                      ({"to_phase": None, "to_phase_given": True, "written_in_phase": 0}, "names no phase"),
                      ({"written_in_phase": -1}, "must be a phase index"),
                      ({"to_phase_given": "no", "written_in_phase": 0}, "must be true or false")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            parse_request(json.dumps(bad))
    old = parse_request('{"to_phase": null}')  # an older version's request: the phase after the job's, any phase
    assert [request_target(old, phase, NAMES) for phase in (0, 1)] == [1, 2]


def test_an_old_format_request_is_read_as_before(tmp_path):
    """No `written_in_phase`: read with exactly the fields it had, and waiting at a resume as before; what it leads
    to, the phase after the one the job is in whichever that is, is checked above (`request_target`) and through the
    CLI (`test_a_request_of_the_old_format_...`; at a resume: tests/test_waiting_reset_request.py)."""
    (tmp_path / REQUEST_NAME).write_text('{"request_id": "old-1", "to_phase": null, "reason": "r"}')
    request = parse_request((tmp_path / REQUEST_NAME).read_text())
    assert request == {"request_id": "old-1", "to_phase": None, "reason": "r", "requested_at": None}
    assert waiting_request(tmp_path, []) == request


def test_a_resume_that_ends_the_requests_phase_at_its_checkpoint_is_refused(tmp_path, capsys):
    """The job down at phase 0's step 2 (of 4); `prorl-trl reset` says phase 0 ends and phase 1 starts. A resume whose
    `phases.0.max_steps: 2` ends phase 0 at that checkpoint goes into phase 1: before the fix it was accepted and the
    job then ended phase 1 and jumped to phase 2. Now the resume is refused, as for a request that a change makes
    unfit; without the change it is accepted (the request then does what the verb said)."""
    run = tmp_path / "run"
    start(run)
    checkpoint = commit(run, 0, 2)
    status, printed, error = verb(capsys, str(run))
    assert status == 0, error
    told = refusal(run, checkpoint, recipe=with_phase(0, max_steps=2), allow_changes=True)
    assert ("with this resume's changes written_in_phase=0 is not the phase the job is in, 1 'middle' (phase 0 is "
            "over): written by `prorl-trl reset` without --to-phase to end phase 0 'first' and start phase 1 "
            "'middle', the request does not end another phase (the run resumes into phase 1)") in told
    assert f"delete {run / REQUEST_NAME}" in told
    assert "to_phase 1 (the next phase: written in phase 0)" in told
    assert said(" ".join(printed.split())) == (0, 1)
    assert resume(run, checkpoint, recipe=RECIPE) == []


def test_a_run_that_saves_no_checkpoints_gets_a_request_for_the_phase_the_job_is_in(tmp_path, capsys):
    """`save_strategy: no`: the folder never shows the job's phase (no checkpoint), so the verb records none and says
    so; the request keeps `to_phase: null`'s meaning (a request recorded against phase 0 would be refused by a job
    in any later phase)."""
    from prorl_trl.trainer.manifest import record_outputs

    run = tmp_path / "run"
    start(run, recipe={**RECIPE, "training": {**RECIPE["training"], "save_strategy": "no"}})
    record_outputs(run, ["phase-0/"])  # as the job records its outputs when it starts
    (run / "phase-0").mkdir()
    status, printed, error = verb(capsys, str(run), "--reason", "stalled")
    assert status == 0, error
    assert ("the job ends the phase it is in at its next step end, hard-resets and starts the phase after it (the run "
            "saves no checkpoint at its phases' ends, training.save_strategy 'no', so this folder does not show which "
            "phase the job is in)") in " ".join(printed.split())
    request = json.loads((run / REQUEST_NAME).read_text())
    assert request["to_phase"] is None and "written_in_phase" not in request
