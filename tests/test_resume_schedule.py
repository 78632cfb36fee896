"""A resume that changes the resumed phase's length (issue 37), through `prorl-trl train` as users run it.

The tiny recipe of tests/test_resume_cli.py with a linear decay, phase 0 of 2 steps and phase 1 of 3, killed before
phase 1's third step (phase-1/checkpoint-2 committed, global step 4), is resumed with `--allow-changes` and
* `--phases.1.max_steps 1`: fewer steps than the phase trained, refused with exit 2, nothing in the folder changed;
* `--phases.1.max_steps 2` (a copy): the checkpoint is the phase's new end, the run finishes without another step;
* `--phases.1.max_steps 5`: the phase trains 5 steps, and from the resumed step on the logged rates are, bit for bit,
  those of a run that had 5 steps in phase 1 from the start. The checkpoint's scheduler state holds the 3-step decay;
  kept, the first resumed step trained at 1/3 of the rate and the next one at 2/5: up in the middle of the decay.
Five CLI processes. The other schedule settings (type, warmup) follow the same rule: one trainer-API test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from test_resume import token_hash_reward
from test_resume_cli import cli, snapshot
from transformers import TrainerCallback

from prorl_trl.config import ProRLConfig
from prorl_trl.tiny import build_tiny
from prorl_trl.trainer import ProRLTrainer
from prorl_trl.trainer.state import PhaseLengthError, resumed_phase_complete

LINEAR = ["--training.lr_scheduler_type", "linear", "--validation.eval_steps", "100", "--phases.0.max_steps", "2"]
KILLED_AT_PHASE_1_STEP_3 = {"PRORL_TEST_KILL_AT": "on_step_begin:1:3"}  # phase-1/checkpoint-2 is committed


def rates(folder: Path) -> dict[int, float]:
    entries = json.loads((folder / "run_summary.json").read_text())["log_history"]
    return {entry["prorl/global_step"]: entry["learning_rate"] for entry in entries if "learning_rate" in entry}


def phase_steps(folder: Path, phase: int) -> list[int]:
    entries = json.loads((folder / "run_summary.json").read_text())["log_history"]
    return [e["prorl/phase_step"] for e in entries if e.get("prorl/phase") == phase and "loss" in e]


def test_a_changed_phase_length_trains_that_many_steps_at_a_fresh_runs_rates(tiny_dir, shared_data, tmp_path):
    fresh = tmp_path / "fresh"
    done = cli(fresh, tiny_dir, shared_data, *LINEAR, "--phases.1.max_steps", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *LINEAR, "--phases.1.max_steps", "3", env=KILLED_AT_PHASE_1_STEP_3)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "phase-1" / "checkpoint-2" / "prorl_state.json").is_file()

    before = snapshot(out)
    shorter = cli(out, tiny_dir, shared_data, *LINEAR, "--phases.1.max_steps", "1", "--resume", "--allow-changes")
    assert shorter.returncode == 2, shorter.stderr[-3000:]
    assert "has trained 2 steps of phase 1" in shorter.stderr and "--phases.1.max_steps 2" in shorter.stderr
    assert "Traceback" not in shorter.stderr and snapshot(out) == before

    ended = tmp_path / "ended"
    shutil.copytree(out, ended)
    result = cli(ended, tiny_dir, shared_data, *LINEAR, "--phases.1.max_steps", "2", "--resume", "--allow-changes")
    assert result.returncode == 0, result.stderr[-3000:]
    assert phase_steps(ended, 1) == [1, 2] and not (ended / "phase-1" / "checkpoint-3").exists()
    assert json.loads((ended / "final" / "prorl_state.json").read_text())["global_step"] == 4

    result = cli(out, tiny_dir, shared_data, *LINEAR, "--phases.1.max_steps", "5", "--resume", "--allow-changes")
    assert result.returncode == 0, result.stderr[-3000:]
    assert phase_steps(out, 1) == [1, 2, 3, 4, 5]
    assert json.loads((out / "final" / "prorl_state.json").read_text())["global_step"] == 7
    want, got = rates(fresh), rates(out)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6, 7]
    assert got[4] != want[4]  # phase 1's second step trained on the 3-step decay, before the change
    assert all(got[step] == want[step] for step in (5, 6, 7)), (got, want)
    assert got[4] > got[5] > got[6] > got[7]  # decays through the resume: never back up


class StopBefore(TrainerCallback):
    """Raises at the start of phase 0's step `step` (checkpoint `step - 1` is committed)."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise StopHere


class StopHere(Exception):
    pass


def one_phase_trainer(output_dir, callbacks=(), **schedule):
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        learning_rate=5e-2, logging_steps=1, save_strategy="steps", save_steps=1, report_to=[], bf16=False,
        use_cpu=True, disable_tqdm=True, seed=0, phases=[{"max_steps": 4}], **schedule,
    )  # fmt: skip
    return ProRLTrainer(
        model=model, reward_funcs=token_hash_reward, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": [f"Q {i}: {i}+{i + 3}=" for i in range(32)]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        callbacks=list(callbacks),
    )  # fmt: skip


def test_a_changed_schedule_type_and_warmup_hold_from_the_resumed_step(tmp_path):
    """The same rule for the other schedule settings (trainer API, one process): a run with a linear decay stopped
    after its second step, resumed with `lr_scheduler_type: cosine` and `warmup_steps: 1`, logs from the resumed step
    on the rates of a run that had those from the start."""
    new = {"lr_scheduler_type": "cosine", "warmup_steps": 1}
    fresh = one_phase_trainer(tmp_path / "fresh", **new)
    fresh.train()
    with pytest.raises(StopHere):
        one_phase_trainer(tmp_path / "run", [StopBefore(3)], lr_scheduler_type="linear").train()
    resumed = one_phase_trainer(tmp_path / "run", **new)
    resumed.train(resume_from_checkpoint=True)

    def rates(trainer):
        return {e["prorl/global_step"]: e["learning_rate"] for e in trainer.prorl_log_history if "learning_rate" in e}

    want, got = rates(fresh), rates(resumed)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert got[2] != want[2] and (got[3], got[4]) == (want[3], want[4]), (got, want)


def test_where_a_resumed_phase_ends_follows_this_runs_length():
    """`resumed_phase_complete` (pure): measured against the phase length asked now; a plateau stop, and checkpoints
    that recorded no end reason (older ones, plain TRL), keep the recorded answer; past the new end is refused."""
    phase, at = SimpleNamespace(max_steps=3, index=1, name="second"), Path("phase-1/checkpoint-4")
    by_length = {"phase_end_reason": "max_steps"}
    assert not resumed_phase_complete({**by_length, "phase_global_step": 2, "phase_complete": True}, phase, at)
    assert resumed_phase_complete({**by_length, "phase_global_step": 3, "phase_complete": False}, phase, at)
    assert resumed_phase_complete({"phase_end_reason": "plateau", "phase_global_step": 2}, phase, at)
    assert resumed_phase_complete({"phase_global_step": 2, "phase_complete": True}, phase, at)
    with pytest.raises(PhaseLengthError, match="has trained 4 steps of phase 1 .* `--phases.1.max_steps 4` or more"):
        resumed_phase_complete({**by_length, "phase_global_step": 4}, phase, at)
