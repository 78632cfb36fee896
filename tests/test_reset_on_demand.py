"""Reset on demand (`prorl-trl reset OUTPUT_DIR`): a running job ends its phase at the next step end, hard-resets
and starts the next phase (or the one named), exactly once, across a kill and resume, and at one step on every rank.

The runs go through tests/_kill_launcher.py (the real CLI), which writes the request file at an exact step
(`PRORL_TEST_REQUEST_AT`) as the verb would. Three phases of 4, 2 and 2 steps on the tiny model; a request at phase 0's
step 2 jumps to phase 2 (phase 1 skipped): 4 steps in all. Cost: one module run, a 3-run kill/resume chain with the
verb, one 2-process run (~1.5 min on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import free_port
from test_resume_cli import LAUNCHER, assert_same_weights, cli, history, snapshot

THREE_PHASES = ["--phases", "[{name: first, max_steps: 4}, {name: middle, max_steps: 2},"
                " {name: last, max_steps: 2, lora_r: 2, lora_alpha: 4}]", "--validation.eval_steps", "4"]  # fmt: skip
JUMP = '{"request_id": "stalled-1", "to_phase": 2, "reason": "stalled"}'
REQUESTS = '0:1={"to_phase": 7, "reason": "typo"}|0:2=' + JUMP  # a refused request, then one acted on


def verb(capsys, *words: str) -> tuple[int, str, str]:
    """`prorl-trl reset WORDS` through the CLI's `main`, in this process (it has torch and TRL imported already)."""
    from prorl_trl.cli import main

    capsys.readouterr()
    status = main(["reset", *words])
    captured = capsys.readouterr()
    return status, captured.out, " ".join(captured.err.split())


def console(result: subprocess.CompletedProcess) -> str:
    """What the run printed (announcements go to stderr, the report to stdout), line breaks as spaces."""
    return " ".join((result.stdout + result.stderr).split())


def summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def jumped(tiny_dir, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("jumped") / "run"
    result = cli(out, tiny_dir, shared_data, *THREE_PHASES, env={"PRORL_TEST_REQUEST_AT": REQUESTS})
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_a_request_ends_the_phase_at_the_next_step_and_starts_the_named_phase_after_a_reset(jumped):
    out, result = jumped
    from prorl_trl.plots import on_demand_resets, phase_boundaries

    log = history(out)
    assert [entry["prorl/global_step"] for entry in log if "loss" in entry] == [1, 2, 3, 4]
    assert [entry["prorl/phase"] for entry in log if "loss" in entry] == [0, 0, 2, 2]  # phase 1 skipped
    marked = [entry for entry in log if "prorl/reset_on_demand" in entry]
    assert [(e["step"], e["prorl/reset_on_demand"], e["prorl/phase"]) for e in marked] == [(2, 2, 0)]
    assert on_demand_resets(log) == [2.0] and 2.0 in phase_boundaries(log)  # the plots mark it
    printed = console(result)
    assert "Reset on demand at global step 2 (stalled): phase 0 'first' ends after 2 steps, its remaining 2 steps are " \
           "not trained; skipped phases 1 'middle' (2 steps); then hard reset and phase 2 'last' with its own " \
           "max_steps=2; the run now trains 4 steps in all (the recipe plans 8)." in printed
    assert "ProRL phase 'middle' skipped" in printed and "ProRL hard reset #1 at global step 2" in printed
    assert "reset on demand at global step 2: phase 0 -> 2 (2 planned steps not trained): stalled" in printed  # report
    resets = summary(out)["on_demand_resets"]
    assert [{k: r[k] for k in ("step", "from_phase", "to_phase", "reason", "steps_not_trained")} for r in resets] == [
        {"step": 2, "from_phase": 0, "to_phase": 2, "reason": "stalled", "steps_not_trained": 2}
    ]
    final = json.loads((out / "final" / "prorl_state.json").read_text())
    assert final["global_step"] == 4 and final["resets"] == 1
    state = json.loads((out / "phase-0" / "checkpoint-2" / "prorl_state.json").read_text())  # what a resume rebuilds
    assert state["phase_complete"] and state["on_demand_resets"][0]["request_id"] == "stalled-1"


def test_the_request_is_consumed_once_and_a_bad_one_is_refused_with_a_warning(jumped):
    out, result = jumped
    assert not (out / "prorl_reset_request.json").exists()
    filed = sorted(path.name for path in (out / "prorl_reset_requests").iterdir())
    assert filed == ["handled-step-2.json", "refused-step-1.json"]
    assert json.loads((out / "prorl_reset_requests" / "handled-step-2.json").read_text())["request_id"] == "stalled-1"
    warning = console(result)
    assert "Reset on demand refused at global step 1: prorl_reset_request.json to_phase=7 is no phase of the run" in warning
    assert "Training goes on in phase 0 'first'" in warning


def test_the_verb_refuses_what_the_folder_shows_is_wrong(jumped, tmp_path, capsys):
    out, _ = jumped
    status, _, error = verb(capsys, str(out))
    assert status == 2 and "holds a finished run" in error and "nothing was written" in error
    status, _, error = verb(capsys, str(tmp_path))
    assert status == 2 and "holds no prorl-trl run" in error
    assert not (out / "prorl_reset_request.json").exists() and not (tmp_path / "prorl_reset_request.json").exists()


def test_a_request_written_while_the_job_is_down_acts_at_its_first_step_and_survives_a_kill(
    jumped, tiny_dir, shared_data, tmp_path, capsys
):
    """Killed before step 2; the verb writes the request (a bad phase is refused first); the resume acts at its first
    step end (step 2), is killed right after phase 0's last checkpoint; a resume that changes the skipped phase 1 is
    refused; the next resume skips phase 1 and ends on the uninterrupted run's weights and log."""
    reference, _ = jumped
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *THREE_PHASES, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    status, _, error = verb(capsys, str(out), "--to-phase", "9")
    assert status == 2 and "to_phase=9 is no phase of the run (phases: 0 'first', 1 'middle', 2 'last')" in error
    assert not (out / "prorl_reset_request.json").exists()
    status, printed, error = verb(capsys, str(out), "--to-phase", "2", "--reason", "stalled")
    assert status == 0 and (out / "prorl_reset_request.json").is_file(), error
    assert "starts phase 2 'last'" in " ".join(printed.split())
    killed = cli(out, tiny_dir, shared_data, *THREE_PHASES, "--resume", env={"PRORL_TEST_KILL_AT": "on_train_end:0:2"})
    assert killed.returncode == -9 and "Reset on demand at global step 2" in console(killed), killed.stderr[-2000:]
    assert (out / "prorl_reset_requests" / "handled-step-2.json").is_file()
    # A setting of the phase the jump skipped would never take effect: refused, even with --allow-changes, before
    # anything loads or is written (before 2026-11-29 it was recorded in resume_history.yaml and ignored).
    before = snapshot(out)
    refused = cli(out, tiny_dir, shared_data, *THREE_PHASES, "--phases.1.temperature", "1.7", "--resume",
                  "--allow-changes")  # fmt: skip
    assert refused.returncode == 2 and "phase 1 never trains" in console(refused), refused.stderr[-2000:]
    assert "phases.1.temperature: (not set) -> 1.7" in console(refused) and "Traceback" not in refused.stderr
    assert snapshot(out) == before
    done = cli(out, tiny_dir, shared_data, *THREE_PHASES, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Reset on demand at global step" not in console(done)  # acted on once
    assert_same_weights(out, reference)
    assert history(out) == history(reference)
    ids = ("request_id", "requested_at")
    assert [{k: v for k, v in r.items() if k not in ids} for r in summary(out)["on_demand_resets"]] == [
        {k: v for k, v in r.items() if k not in ids} for r in summary(reference)["on_demand_resets"]
    ]


def test_two_processes_end_the_phase_at_the_same_step_with_the_same_weights(tiny_dir, shared_data, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo): only rank 0 reads the request, both end phase 0 after step 2."""
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/multi_node.yaml",
                  "--num_machines", "1", "--num_processes", "2", "--main_process_port", str(free_port()),
                  *LAUNCHER[1:]]  # fmt: skip
    env = {"PRORL_TEST_REQUEST_AT": '0:2={"reason": "two ranks"}', "PRORL_TEST_RANKS_TO": str(tmp_path)}
    result = cli(tmp_path / "run", tiny_dir, shared_data, "--phases.0.max_steps", "4", "--phases.1.max_steps", "2",
                 "--training.use_cpu", "true", env=env, launcher=accelerate)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert console(result).count("Reset on demand at global step 2 (two ranks)") == 1  # the main process announces
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    for rank in ranks:
        assert (rank["global_step"], rank["resets"], rank["phase"]) == (4, 1, 1)
        assert [(r["step"], r["from_phase"], r["to_phase"]) for r in rank["on_demand"]] == [(2, 0, 1)]


def test_the_request_file_is_checked_and_filed_as_read(tmp_path):
    from prorl_trl.trainer.on_demand import REQUEST_NAME, check_target, file_request, parse_request, write_reset_request

    written = write_reset_request(tmp_path, 2, "why")
    text = (tmp_path / REQUEST_NAME).read_text()
    assert parse_request(text) == written
    for bad, says in (("[1]", "not a JSON object"), ('{"to_phase": "2"}', "must be a phase index"),
                      ('{"phase": 1}', "unknown keys"), ("{", "is not JSON")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            parse_request(bad)
    assert parse_request("{}")["request_id"] == parse_request("{}")["request_id"]  # written by hand: id from the text
    assert check_target(None, 0, ["a", "b"]) == 1
    with pytest.raises(ValueError, match="is the run's last phase"):
        check_target(None, 1, ["a", "b"])
    with pytest.raises(ValueError, match="not after the running phase 1 'b'"):
        check_target(0, 1, ["a", "b", "c"])
    record = file_request(tmp_path, text, "handled", 5)
    assert record.name == "handled-step-5.json" and record.read_text() == text and not (tmp_path / REQUEST_NAME).exists()
    newer = write_reset_request(tmp_path, None, "newer")  # written after `text` was read: it stays for the next step
    record = file_request(tmp_path, text, "handled", 5)
    assert record.name == "handled-step-5-2.json" and record.read_text() == text
    assert parse_request((tmp_path / REQUEST_NAME).read_text()) == newer
    (tmp_path / REQUEST_NAME).write_bytes(b"x" * 100_000)  # too large to be a request: refused and moved whole
    from prorl_trl.trainer.on_demand import _read_request_text

    record = file_request(tmp_path, _read_request_text(tmp_path), "refused", 6)
    assert record.stat().st_size == 100_000 and not (tmp_path / REQUEST_NAME).exists()
