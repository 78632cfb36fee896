"""Resuming a ProRL run after a hard reset reproduces the uninterrupted run (deterministic CPU, tiny model).

Run A trains 2 phases (hard reset between them) without interruption. Run B is the same run killed while it saves
checkpoint 3 of phase 2 (after checkpoint 2 was complete), so checkpoint-3 is on disk but unfinished. Run C is a new
trainer (new model object) that resumes B with `train(resume_from_checkpoint=True)`: it must pick checkpoint 2 of
phase 2, restore the frozen LoRA factors of reset 1 and the adapter/optimizer/scheduler/RNG of the checkpoint, and end
with the weights of run A.
"""

import json

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from prorl_trl.config import ProRLConfig
from prorl_trl.reset import frozen_state_dict, merged_state_dict
from prorl_trl.reset.checkpoint import PRORL_STATE_NAME, latest_checkpoint
from prorl_trl.tiny import build_tiny
from prorl_trl.trainer import ProRLTrainer


class Interrupted(Exception):
    pass


class CrashDuringSave(TrainerCallback):
    """Raises inside `on_save` of (phase 1, step 3): HF has written the checkpoint files, ProRL's state not yet."""

    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref

    def on_save(self, args, state, control, **kwargs):
        if self.trainer_ref[0].current_phase.index == 1 and state.global_step == 3:
            raise Interrupted


def token_hash_reward(completion_ids, **kwargs):
    """Deterministic, varies inside every group, so every step has a gradient."""
    return [(sum(ids) % 13) / 13 for ids in completion_ids]


def make_trainer(output_dir, callbacks=()):
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        phases=[{"max_steps": 2}, {"max_steps": 4, "temperature": 0.8, "lora_r": 8}],
    )
    return ProRLTrainer(
        model=model,
        reward_funcs=token_hash_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Q {i}: {i}+{i + 3}=" for i in range(32)]}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], task_type="CAUSAL_LM"),
        callbacks=list(callbacks),
    )


def weights(trainer):
    """Every parameter and the frozen LoRA factors of earlier resets: the whole policy."""
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()} | frozen_state_dict(trainer.model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    uninterrupted = make_trainer(root / "a")
    uninterrupted.train()

    ref = [None]
    crashing = make_trainer(root / "b", callbacks=[CrashDuringSave(ref)])
    ref[0] = crashing
    with pytest.raises(Interrupted):
        crashing.train()

    unfinished = root / "b" / "phase-1" / "checkpoint-3"
    crash_state = {"dir": unfinished.is_dir(), "committed": (unfinished / PRORL_STATE_NAME).exists()}
    resumed = make_trainer(root / "b")
    chosen = latest_checkpoint(root / "b")
    resumed.train(resume_from_checkpoint=True)
    return {"a": uninterrupted, "c": resumed, "chosen": chosen, "root": root, "crash": crash_state}


def test_interrupted_save_leaves_previous_checkpoint_in_use(runs):
    b = runs["root"] / "b" / "phase-1"
    assert runs["crash"] == {"dir": True, "committed": False}  # HF wrote checkpoint-3, ProRL never marked it done
    assert runs["chosen"] == b / "checkpoint-2"
    state = json.loads((runs["chosen"] / PRORL_STATE_NAME).read_text())
    assert state["phase_index"] == 1 and state["resets"] == 1 and state["merged_base"].endswith("reset-1")
    assert state["frozen_factors"] == "frozen/reset-1.safetensors" and state["lora_reset_mode"] == "frozen"


def test_resumed_run_ends_with_the_uninterrupted_weights(runs):
    a, c = runs["a"], runs["c"]
    assert c.prorl_resets == a.prorl_resets == 1
    assert c.prorl_global_step == a.prorl_global_step == 6
    assert c.model.peft_config["default"].r == 8
    wa, wc = weights(a), weights(c)
    assert wa.keys() == wc.keys()
    max_diff = max((wa[k] - wc[k]).abs().max().item() for k in wa)
    assert max_diff < 1e-6, max_diff
    assert any(".prorl_frozen." in k for k in wa)  # reset 1 kept phase 1's delta as frozen factors
    # and training did move the policy after the resume point (the comparison is not vacuous)
    start, end = merged_state_dict(make_trainer(runs["root"] / "unused").model), merged_state_dict(a.model)
    assert max((end[k] - v).abs().max().item() for k, v in start.items()) > 1e-4
