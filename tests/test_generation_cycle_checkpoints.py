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


def even_prompts_uniform(prompts, completions, **kwargs):
    """Correctness that is uniform for even-numbered prompts (their groups are dropped and refilled) and varies with
    the completion's length for odd ones."""
    return [1.0 if int(str(p).split(":")[0].lstrip("Q")) % 2 == 0 else float(len(str(c)) % 2)
            for p, c in zip(prompts, completions)]  # fmt: skip


def test_dynamic_sampling_resumes_its_refill_stream_where_it_stood(tmp_path):
    """The refill prompts of dynamic sampling come from a stream of their own, which checkpoints did not hold: a
    resumed run drew the phase's first refill prompts again and trained on other prompts than the uninterrupted
    run (review, 2026-11-29). The checkpoint now records how far the stream had gone."""

    def trainer(out, callbacks=()):
        torch.manual_seed(0)
        model, tokenizer = tiny_model()
        args = tiny_args(out, save_strategy="steps", save_steps=1, seed=0, max_steps=4, dynamic_sampling=True)
        return ProRLTrainer(model=model, reward_funcs=[even_prompts_uniform], args=args, callbacks=list(callbacks),
                            train_dataset=prompts_dataset(), processing_class=tokenizer, peft_config=lora())  # fmt: skip

    whole = trainer(tmp_path / "whole")
    whole.train()
    drawn = whole.refill_position()
    assert drawn is not None and drawn[1] >= 2, drawn  # refills happened, before and after the stop below
    stopped = trainer(tmp_path / "cut", [StopRequestAt(2)])
    with pytest.raises(RunInterrupted):
        stopped.train()
    assert 0 < stopped.refill_position()[1] < drawn[1]
    resumed = trainer(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.refill_position() == drawn
    expected, got = weights(whole), weights(resumed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


class ResetRecorder(ProRLTrainer):
    """Records where each hard reset runs: its global step and whether TRL generates anew after it."""

    def hard_reset(self, *args, **kwargs):
        self.resets_at = [*getattr(self, "resets_at", []), (self.prorl_global_step, self.at_generation_boundary())]
        return super().hard_reset(*args, **kwargs)


def test_a_reset_inside_a_generation_cycle_waits_for_its_end(tmp_path):
    """One generation serves two optimizer steps (`num_iterations=2`); the buffered second micro-batch holds
    reference log-probs computed before a reset in between, so the KL term of that step used the old reference
    (review of 2026-11-29). A reset due inside the cycle (every step here) now waits for the cycle's end."""
    from prorl_trl import HardResetCallback

    torch.manual_seed(0)
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, seed=0, num_iterations=2, max_steps=6)
    trainer = ResetRecorder(model=model, reward_funcs=[length_reward], args=args, train_dataset=prompts_dataset(),
                            processing_class=tokenizer, peft_config=lora(),
                            callbacks=[HardResetCallback(every_steps=1)])  # fmt: skip
    trainer.train()
    assert trainer.resets_at == [(2, True), (4, True)]  # steps 1, 3 and 5 end inside a cycle; step 6 ends the run
