"""Checkpoints only where a generation's optimizer steps end (2026-11-29).

TRL generates once per `steps_per_generation * num_iterations` micro-batches and keeps the rest in a buffer that a
checkpoint does not hold. A checkpoint inside such a cycle resumed with a fresh generation and stayed out of step
with the uninterrupted run (one batch trained three times). Stops and `save_steps` saves now wait for the cycle's end.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from prorl_trl.reset import frozen_state_dict
from prorl_trl.reset.checkpoint import complete_checkpoints
from prorl_trl.trainer import ProRLTrainer, RunInterrupted
from tests._prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model


def length_reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


class StopRequestAt(TrainerCallback):
    """`request_stop` at the end of one global step (callbacks given to the trainer run before its own)."""

    def __init__(self, step: int):
        self.step, self.trainer = step, None

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.prorl_global_step == self.step:
            self.trainer.request_stop("test")


def trainer_for(out, callbacks=()) -> ProRLTrainer:
    torch.manual_seed(0)
    model, tokenizer = tiny_model()
    args = tiny_args(out, save_strategy="steps", save_steps=1, num_iterations=2, seed=0,
                     phases=[{"max_steps": 2}, {"max_steps": 4}])  # fmt: skip
    return ProRLTrainer(model=model, reward_funcs=[length_reward], args=args, train_dataset=prompts_dataset(),
                        processing_class=tokenizer, peft_config=lora(), callbacks=list(callbacks))  # fmt: skip


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()} | frozen_state_dict(trainer.model)


def test_a_stop_inside_a_generation_cycle_waits_for_its_end_and_resumes_exactly(tmp_path):
    whole = trainer_for(tmp_path / "whole")
    whole.train()
    stopped = trainer_for(tmp_path / "cut", [StopRequestAt(3)])  # global step 3: phase 1's first step, mid-cycle
    with pytest.raises(RunInterrupted):
        stopped.train()
    assert stopped.prorl_global_step == 4  # waited one step for the cycle's end
    run = tmp_path / "cut" / "run"
    steps = [(state["phase_index"], int(path.name.split("-")[1])) for path, state in complete_checkpoints(run)]
    assert steps == [(0, 2), (1, 2)]  # save_steps=1, but only at the ends of cycles of 2 steps
    resumed = trainer_for(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=True)
    expected, got = weights(whole), weights(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_a_resume_inside_a_phase_refuses_another_lora_shape_for_it(tmp_path):
    """Loading the checkpoint's adapter into another rank, alpha or target list changed the policy it holds without a
    word (an `--allow-changes` override of the running phase); a LoRA shape changes at a hard reset only."""
    from prorl_trl.reset.provenance import RunFilesError

    stopped = trainer_for(tmp_path, [StopRequestAt(4)])  # phase 1 at its step 2 of 4
    with pytest.raises(RunInterrupted):
        stopped.train()
    for change, message in (({"lora_r": 8}, "first differing weight"), ({"lora_alpha": 32}, "lora_alpha 8 -> 32")):
        model, tokenizer = tiny_model()
        args = tiny_args(tmp_path, save_strategy="steps", save_steps=1, num_iterations=2, seed=0,
                         phases=[{"max_steps": 2}, {"max_steps": 4, **change}])  # fmt: skip
        trainer = ProRLTrainer(model=model, reward_funcs=[length_reward], args=args, train_dataset=prompts_dataset(),
                               processing_class=tokenizer, peft_config=lora())  # fmt: skip
        with pytest.raises(RunFilesError, match=f"inside phase 1 .*{message}"):
            trainer.train(resume_from_checkpoint=True)


def test_a_refused_adapter_shape_leaves_the_later_checkpoints_committed(tmp_path):
    """The shape check runs before the checkpoints after the resumed one are superseded: a refused resume changes
    nothing in the run folder."""
    from prorl_trl.reset.provenance import RunFilesError

    trainer_for(tmp_path).train()
    run = tmp_path / "run"
    later = run / "phase-1" / "checkpoint-4" / "prorl_state.json"
    assert later.is_file()
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, save_strategy="steps", save_steps=1, num_iterations=2, seed=0,
                     phases=[{"max_steps": 2}, {"max_steps": 4, "lora_r": 8}])  # fmt: skip
    trainer = ProRLTrainer(model=model, reward_funcs=[length_reward], args=args, train_dataset=prompts_dataset(),
                           processing_class=tokenizer, peft_config=lora())  # fmt: skip
    with pytest.raises(RunFilesError, match="inside phase 1"):
        trainer.train(resume_from_checkpoint=str(run / "phase-1" / "checkpoint-2"))
    assert later.is_file()
