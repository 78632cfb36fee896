"""What a changed `--resume` compares with and records, through `prorl-trl train` as users run it (review of
2026-11-30): the recipe a checkpoint is compared with is the one recorded up to its global step; a change to a phase
that has no step left after the resume is refused; a resume refused by the trainer records nothing; an epoch-based
phase made shorter than it trained is refused.

The tiny two-phase recipe of tests/test_resume_cli.py (phases of 3 and 3 steps, a checkpoint every step), killed
before phase 0's third step (checkpoints 1 and 2), then resumed with `--training.learning_rate 5e-4
--allow-changes` and killed again at once (`resume_history.yaml` records the change at global step 2): one module
fixture, copied by each test that writes to it. Kills at `on_step_begin` come before the resumed step trains, so a
resume that is accepted costs a model load and no step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import _cli_fork
import pytest
import yaml
from test_resume_cli import LAUNCHER, RECIPE, REPO, SHAPE, cli, snapshot

NEW_LR = ("--training.learning_rate", "5e-4")
NO_VALIDATION = ("--validation.eval_steps", "100")


def kill_at(point: str) -> dict[str, str]:
    return {"PRORL_TEST_KILL_AT": point}


def history_of(out: Path) -> list[dict]:
    return yaml.safe_load((out / "resume_history.yaml").read_text())


@pytest.fixture(scope="module")
def changed_at_step_2(tiny_dir, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("changed") / "run"
    killed = cli(out, tiny_dir, shared_data, *NO_VALIDATION, env=kill_at("on_step_begin:0:3"))
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = cli(out, tiny_dir, shared_data, *NO_VALIDATION, *NEW_LR, "--resume", "--allow-changes",
                  env=kill_at("on_step_begin:0:3"))  # fmt: skip
    assert resumed.returncode == -9, resumed.stderr[-3000:]
    [entry] = history_of(out)
    assert entry["global_step"] == 2 and [change["key"] for change in entry["changes"]] == ["training.learning_rate"]
    return out


@pytest.fixture
def run(changed_at_step_2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(changed_at_step_2, out)
    return out


def test_an_earlier_checkpoint_is_compared_with_the_recipe_recorded_up_to_its_step(run, tiny_dir, shared_data):
    """Checkpoint-1 trained before the change recorded at step 2: resuming it with the new rate is a change (refused
    without --allow-changes, then recorded at global step 1), and with the original rate it is none. Before the fix
    the change at step 2 applied to every checkpoint: the new rate passed silently and step 2 trained at it."""
    first = str(run / "phase-0" / "checkpoint-1")
    before = snapshot(run)
    refused = cli(run, tiny_dir, shared_data, *NO_VALIDATION, *NEW_LR, "--resume", first)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "training.learning_rate: 0.0001 -> 0.0005" in refused.stderr and "--allow-changes" in refused.stderr
    assert "up to global step 1" in refused.stderr and snapshot(run) == before

    back = cli(run, tiny_dir, shared_data, *NO_VALIDATION, "--resume", first, env=kill_at("on_step_begin:0:2"))
    assert back.returncode == -9, back.stderr[-3000:]
    assert "training.learning_rate" not in back.stdout  # (the copied folder notes only its new output_dir)
    # the abandoned change is closed by an entry of the resume from step 1, with no change to training (the copied
    # folder's new output_dir is logged)
    [(step, changes)] = [(entry["global_step"], entry["changes"]) for entry in history_of(run)][1:]
    assert step == 1 and [change["key"] for change in changes if change["alters_training"]] == []
    assert not (run / "phase-0" / "checkpoint-2" / "prorl_state.json").exists()  # un-committed, as before

    again = cli(run, tiny_dir, shared_data, *NO_VALIDATION, *NEW_LR, "--resume", "--allow-changes",
                env=kill_at("on_step_begin:0:2"))  # fmt: skip
    assert again.returncode == -9, again.stderr[-3000:]
    last = history_of(run)[-1]
    assert last["global_step"] == 1 and last["checkpoint"].endswith("phase-0/checkpoint-1")
    assert last["changes"] == [{"key": "training.learning_rate", "old": 0.0001, "new": 0.0005, "alters_training": True}]


def test_a_phase_setting_is_refused_when_the_same_resume_ends_that_phase_at_the_checkpoint(
    changed_at_step_2, tiny_dir, shared_data
):
    """Checkpoint-2 is inside phase 0 (3 steps): `--phases.0.max_steps 2` ends the phase there, so no step of it
    would use a new phase-0 temperature. Refused (exit 2, nothing changed) as from the phase's last checkpoint; the
    shorter length alone is what a resume can do (`validate --resume` says so without doing it)."""
    out, before = changed_at_step_2, snapshot(changed_at_step_2)
    shorter = ("--resume", "--allow-changes", *NO_VALIDATION, *NEW_LR, "--phases.0.max_steps", "2")
    refused = cli(out, tiny_dir, shared_data, *shorter, "--phases.0.temperature", "1.7")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "phase 0 has no step left to train" in refused.stderr
    assert "phases.0.temperature: (not set) -> 1.7" in refused.stderr
    assert "phases.0.max_steps" not in refused.stderr and "Traceback" not in refused.stderr
    assert snapshot(out) == before

    command = [*LAUNCHER, "validate", RECIPE, "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out),
               *SHAPE, *shorter]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data)}
    checked = _cli_fork.run(command, cwd=REPO, env=environment, timeout=300)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert snapshot(out) == before


def test_a_resume_the_trainer_refuses_records_nothing(run, tiny_dir, shared_data):
    """The run's log history is damaged: the trainer refuses the resume (exit 2) after the CLI's checks passed. The
    resume history is not appended (before the fix its records were written first, and a finished run's final/
    renamed: tests/test_resume_cli.py covers that case)."""
    history = run / "prorl_log_history.json"
    history.write_bytes(history.read_bytes()[:300])
    before = snapshot(run)
    refused = cli(run, tiny_dir, shared_data, *NO_VALIDATION, "--resume", "--allow-changes",
                  "--training.learning_rate", "7e-4")  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "prorl_log_history.json" in refused.stderr and "Traceback" not in refused.stderr
    assert len(history_of(run)) == 1 and (run / "phase-0" / "checkpoint-2" / "prorl_state.json").is_file()
    changed = {name for name in snapshot(run).keys() | before.keys() if snapshot(run).get(name) != before.get(name)}
    assert changed <= {".prorl_manifest.json"}, changed


def test_an_epoch_phase_made_shorter_than_it_trained_is_refused(tiny_dir, shared_data, tmp_path):
    """A one-phase recipe of `num_train_epochs: 2` killed at its last step; resumed with one epoch, the phase would
    be shorter than the steps it trained: refused (exit 2), the length measured as HF's `train()` derives it from
    the epochs. Before the fix the recorded answer was kept and the run ended at the trained step."""
    recipe = yaml.safe_load(Path(__file__).with_name("recipes").joinpath("tiny_gsm8k.yaml").read_text())
    del recipe["phases"]
    recipe["training"].update(num_train_epochs=2, save_strategy="steps", save_steps=1)
    recipe["rewards"], recipe["validation"]["eval_steps"] = ["token_hash"], 100
    recipe["data"]["source"] = str(shared_data / "gsm8k")
    recipe["data"]["max_train_samples"] = 4
    path = tmp_path / "epochs.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"

    def train(*extra: str, env: dict | None = None):
        command = [*LAUNCHER, "train", str(path), "--model.name_or_path", str(tiny_dir),
                   "--training.output_dir", str(out), *extra]  # fmt: skip
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data), **(env or {})}
        return _cli_fork.run(command, cwd=REPO, env=environment, timeout=300)

    killed = train(env=kill_at("on_step_begin:0:4"))  # 2 steps an epoch: checkpoint-3 is the last committed
    assert killed.returncode == -9, killed.stderr[-3000:]
    state = json.loads((out / "phase-0" / "checkpoint-3" / "prorl_state.json").read_text())
    assert state["phase_global_step"] == 3 and not state["phase_complete"]
    before = snapshot(out)
    refused = train("--resume", "--allow-changes", "--training.num_train_epochs", "1")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "has trained 3 steps of phase 0" in refused.stderr and "2 steps long" in refused.stderr
    assert "--training.num_train_epochs 2" in refused.stderr and "Traceback" not in refused.stderr
    assert not (out / "resume_history.yaml").exists()
    changed = {name for name in snapshot(out).keys() | before.keys() if snapshot(out).get(name) != before.get(name)}
    assert changed <= {".prorl_manifest.json"}, changed
