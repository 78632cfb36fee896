"""Resume: interrupted in phase 2 after a hard reset, resumed, it ends on the same weights as an uninterrupted run."""

import json

import pytest
import torch
from _prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model
from safetensors.torch import load_file
from transformers import TrainerCallback

from prorl_trl import PhaseConfig, ProRLTrainer


def parity(completion_ids, **kwargs):
    return [float(ids[0] % 2) for ids in completion_ids]


class Interrupt(Exception):
    pass


class StopAt(TrainerCallback):
    """Simulates a crash just before the optimizer step `global_step + 1` (after the checkpoint of `global_step`)."""

    def __init__(self, global_step):
        self.global_step, self.trainer = global_step, None

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer.prorl_global_step == self.global_step:
            raise Interrupt
        return control


def run(out_dir, callbacks=(), resume=None, **overrides):
    model, tokenizer = tiny_model()
    phases = [PhaseConfig(max_steps=2), PhaseConfig(max_steps=3, temperature=0.8, lora_r=overrides.pop("lora_r", 2))]
    args = tiny_args(out_dir, phases=phases, save_strategy="steps", save_steps=1, **overrides)
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[parity], args=args, train_dataset=prompts_dataset(),
        peft_config=lora(), callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_resume_in_phase_two_matches_uninterrupted_run(tmp_path):
    reference = run(tmp_path / "a")
    with pytest.raises(Interrupt):
        run(tmp_path / "b", callbacks=[StopAt(3)])
    checkpoint = tmp_path / "b" / "run" / "phase-1" / "checkpoint-1"
    state = json.loads((checkpoint / "prorl_state.json").read_text())
    assert state["phase_index"] == 1 and state["resets"] == 1 and state["global_step"] == 3
    assert state["merged_base"].endswith("merged/reset-1")

    resumed = run(tmp_path / "b", resume=True)
    assert resumed.prorl_resets == 1 and resumed.prorl_global_step == 5
    assert resumed.temperature == 0.8 and resumed.model.peft_config["default"].r == 2
    want = load_file(tmp_path / "a" / "run" / "final" / "model.safetensors")
    got = load_file(tmp_path / "b" / "run" / "final" / "model.safetensors")
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-6
    initial = tiny_model()[0].state_dict()
    assert (want["model.layers.0.self_attn.q_proj.weight"] - initial["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-4
    steps = [e["prorl/global_step"] for e in resumed.prorl_log_history if "loss" in e]
    assert steps == [1, 2, 3, 4, 5]
    assert [e["loss"] for e in resumed.prorl_log_history if "loss" in e] == pytest.approx(
        [e["loss"] for e in reference.prorl_log_history if "loss" in e], abs=1e-6
    )


def test_resume_after_a_reset_that_kept_the_adapter_matches_uninterrupted_run(tmp_path):
    """reset_adapter=False (the prolonged study's "opt" arm): the reset froze nothing and saved no merged base, and
    the checkpoint after it still resumes, since the adapter it kept is in the checkpoint itself."""
    settings = {"lora_r": 4, "reset_adapter": False, "save_merged_on_reset": False}
    run(tmp_path / "a", **settings)
    with pytest.raises(Interrupt):
        run(tmp_path / "b", callbacks=[StopAt(3)], **settings)
    state = json.loads((tmp_path / "b" / "run" / "phase-1" / "checkpoint-1" / "prorl_state.json").read_text())
    assert state["resets"] == 1 and state["adapter_resets"] == 0 and not state["frozen_factors"]
    resumed = run(tmp_path / "b", resume=True, **settings)
    assert resumed.prorl_resets == 1 and resumed.prorl_global_step == 5
    want = load_file(tmp_path / "a" / "run" / "final" / "model.safetensors")
    got = load_file(tmp_path / "b" / "run" / "final" / "model.safetensors")
    assert want.keys() == got.keys() and max((want[k] - got[k]).abs().max().item() for k in want) < 1e-6


def test_resume_needs_a_prorl_checkpoint(tmp_path):
    model, tokenizer = tiny_model()
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[parity], args=tiny_args(tmp_path, max_steps=1),
        train_dataset=prompts_dataset(), peft_config=lora(),
    )
    with pytest.raises(ValueError, match="No checkpoint to resume from"):
        trainer.train(resume_from_checkpoint=True)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="prorl_state.json"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "ckpt"))
    assert torch.is_tensor(trainer.reward_weights)
