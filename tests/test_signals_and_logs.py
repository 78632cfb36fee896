"""Signals and logs of `prorl-trl train` (issue 28): a SIGTERM during start-up stops with a message, an interrupt says
what stopped it, and an interrupted-then-resumed run logs exactly what the uninterrupted run logs, `train_loss` of the
resumed phase included.

Runs the real CLI through `tests/_kill_launcher.py` on tests/recipes/tiny_gsm8k.yaml (two phases of 3 + 1 steps, a
checkpoint every step, validation every 2 steps). Cost: four CLI processes of ~7 s each on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import _cli_fork
import pytest

from prorl_trl.trainer.interrupt import StartupInterrupted, stop_on_signals

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, str(REPO / "tests" / "_kill_launcher.py")]
RECIPE = str(REPO / "tests" / "recipes" / "tiny_gsm8k.yaml")
SHAPE = [
    "--rewards", "[token_hash]", "--training.save_strategy", "steps", "--training.save_steps", "1",
    "--phases.0.max_steps", "3", "--phases.1.max_steps", "1", "--validation.eval_steps", "2",
]  # fmt: skip
# Wall-clock figures of one process: the only fields allowed to differ between two runs of the same steps.
TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


def command(out: Path, tiny_dir: Path, *extra: str) -> list[str]:
    return LAUNCHER + ["train", RECIPE, "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out),
                       *SHAPE, *extra]  # fmt: skip


def environment(shared_data: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data), **extra}


def cli(out: Path, tiny_dir: Path, shared_data: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    return _cli_fork.run(command(out, tiny_dir, *extra), cwd=REPO, env=environment(shared_data, **env), timeout=300)


def log_history(out: Path) -> list[dict]:
    """The whole run's log (`run_summary.json`), timing fields left out and the run folder's name replaced."""
    entries = json.loads((out / "run_summary.json").read_text())["log_history"]
    return [
        {key: value.replace(str(out), "RUN") if isinstance(value, str) else value
         for key, value in entry.items() if key not in TIMING}
        for entry in entries
    ]  # fmt: skip


def test_a_signal_during_a_writing_start_up_step_stops_right_after_it():
    """`SignalStop.deferred` (e.g. `--overwrite` deleting the old outputs): the step finishes, then the start-up stops;
    a request still pending when the trainer would be attached stops there too. The old handler comes back after."""
    before = signal.getsignal(signal.SIGTERM)
    finished = False
    with stop_on_signals() as signals:
        with pytest.raises(StartupInterrupted) as stopped, signals.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            finished = True
        assert finished and stopped.value.reason == "SIGTERM"
        with pytest.raises(StartupInterrupted):
            signals.attach(trainer=None)
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_during_start_up_stops_before_training_with_a_message(tiny_dir, shared_data, tmp_path):
    """The recipe table is printed before the model, data and trainer are loaded: a SIGTERM right after it lands in
    the start-up, which used to end with exit -15 and no word."""
    out = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        process = subprocess.Popen(
            command(out, tiny_dir), stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
            env=environment(shared_data),
        )  # fmt: skip
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("recipe:"):
                process.send_signal(signal.SIGTERM)
                break
        rest, _ = process.communicate(timeout=300)
        stderr.seek(0)
        errors = stderr.read()
    stdout = "".join(lines) + rest
    assert process.returncode == 143, (stdout[-2000:], errors[-3000:])
    assert "stopped by SIGTERM during start-up, before the first training step: nothing was trained" in stdout
    again = stdout.split("start it again with:\n")[1].strip().splitlines()[0]
    assert "train" in again and str(out) in again and "--resume" not in again and "--overwrite" not in again
    assert "Traceback" not in errors, errors[-3000:]
    assert "ProRL phase" not in errors  # no phase started
    assert not (out / "recipe.yaml").exists() and not list(out.glob("phase-*"))


def test_sigterm_mid_phase_then_resume_logs_what_the_uninterrupted_run_logs(tiny_dir, shared_data, tmp_path):
    """SIGTERM before step 2 of phase 1: the step finishes, is checkpointed, the phase is reported stopped by SIGTERM
    (not "ended after 2 steps (max_steps)"), and HF's end-of-call summary is not logged. `--resume` then ends on the
    uninterrupted run's log, entry for entry: the resumed phase's `train_loss` averages all 3 of its steps, not the
    one after the resume, and no extra summary entry sits at the interrupted step."""
    reference, out = tmp_path / "reference", tmp_path / "run"
    done = cli(reference, tiny_dir, shared_data)
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = cli(out, tiny_dir, shared_data, PRORL_TEST_TERM_SELF_AT="on_step_begin:0:2")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "stopped by SIGTERM at global step 2" in stopped.stdout
    assert "ProRL phase 'first' stopped by SIGTERM after 2 of 3 steps." in stopped.stderr
    assert "ended after" not in stopped.stderr and "Traceback" not in stopped.stderr
    saved = json.loads((out / "prorl_log_history.json").read_text())
    assert [entry for entry in saved if "train_runtime" in entry] == []
    assert "phase_loss_sum" in json.loads((out / "phase-0" / "checkpoint-2" / "prorl_state.json").read_text())

    resumed = cli(out, tiny_dir, shared_data, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "ProRL phase 'first' ended after 3 steps (max_steps)." in resumed.stderr
    want, got = log_history(reference), log_history(out)
    summaries = [entry for entry in want if "train_loss" in entry]
    assert [entry["prorl/phase"] for entry in summaries] == [0, 1]  # one summary per phase
    phase_0_losses = [entry["loss"] for entry in want if "loss" in entry and entry["prorl/phase"] == 0]
    assert len(phase_0_losses) == 3 and abs(summaries[0]["train_loss"] - sum(phase_0_losses) / 3) < 1e-6
    assert got == want
