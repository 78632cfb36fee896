"""ProRLTrainer.hard_reset: function-preserving, fresh adapter/optimizer, reference moved, merged weights saved."""

import logging

import pytest
import torch
from _prorl_helpers import Recorder, lora, prompts_dataset, tiny_args, tiny_model
from transformers import TrainerCallback

from prorl_trl import HardResetCallback, PhaseConfig, ProRLTrainer
from prorl_trl.reset import lora_layers

IDS = torch.arange(3, 23).unsqueeze(0)


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def parity(completion_ids, **kwargs):
    """A reward with variance inside groups even when every completion hits the cap."""
    return [float(ids[0] % 2) for ids in completion_ids]


def build(tmp_path, model=None, tokenizer=None, peft=True, callbacks=None, **overrides):
    if model is None:
        model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, **{"max_steps": 2, **overrides})
    recorder = Recorder()
    trainer = ProRLTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[recorder, parity],
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora() if peft else None,
        callbacks=callbacks,
    )
    recorder.trainer = trainer
    return trainer


def lora_b_norm(model):
    return sum(layer.lora_B["default"].weight.abs().sum().item() for _, layer in lora_layers(model))


def test_hard_reset_preserves_outputs_and_resets_adapter_optimizer_reference(tmp_path):
    trainer = build(tmp_path, beta=0.05)
    trainer.train()
    model = trainer.model
    assert lora_b_norm(model) > 0, "training should have moved lora_B"
    assert len(trainer.optimizer.state) > 0
    before = logits(model)
    with model.disable_adapter():
        reference_before = logits(model)
    assert (before - reference_before).abs().max() > 1e-4

    trainer.hard_reset(reason="test")

    assert (logits(model) - before).abs().max().item() < 1e-5
    assert lora_b_norm(model) == 0.0
    assert len(trainer.optimizer.state) == 0
    with model.disable_adapter():  # TRL's reference with LoRA + beta > 0 is the adapter-disabled base
        assert (logits(model) - before).abs().max().item() < 1e-5
    assert trainer.prorl_resets == 1
    assert (tmp_path / "run" / "merged" / "reset-1" / "model.safetensors").is_file()
    assert trainer.prorl_merged_path.endswith("reset-1")


def test_phase_boundary_reset_logs_the_share_of_the_delta_the_merge_rounded_away(tmp_path):
    trainer = build(
        tmp_path, max_steps=-1, phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)], lora_reset_mode="merge"
    )
    trainer.train()
    logged = [e["prorl/merge_delta_lost"] for e in trainer.prorl_log_history if "prorl/merge_delta_lost" in e]
    assert trainer.prorl_resets == 1
    assert logged == [trainer.prorl_merge_delta_lost], "one entry, with the first step after the reset"
    assert logged[0] == 0.0  # a float32 base keeps the whole delta


def test_reset_warns_when_a_bf16_base_rounds_the_delta_away(tmp_path, caplog):
    model, tokenizer = tiny_model()
    trainer = build(tmp_path, model=model.to(torch.bfloat16), tokenizer=tokenizer, lora_reset_mode="merge")
    with torch.no_grad():  # a delta far under half a bf16 step of the weights, as a few steps at a small lr leave
        for _, layer in lora_layers(trainer.model):
            layer.lora_B["default"].weight.fill_(1e-7)
    with caplog.at_level(logging.WARNING, logger="prorl_trl"):
        trainer.hard_reset(reason="test")
    assert trainer.prorl_merge_delta_lost > 0.9
    assert "rounded away" in caplog.text and "bfloat16 base weights" in caplog.text
    assert "lora_reset_mode: frozen" in caplog.text  # the remedy named is the exact reset, not a float32 base


def test_full_finetuning_reset_copies_policy_into_reference(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    trainer = build(tmp_path, model=str(tiny_dir), tokenizer=AutoTokenizer.from_pretrained(tiny_dir), peft=False, beta=0.05)
    trainer.train()
    policy, ref = dict(trainer.model.named_parameters()), dict(trainer.ref_model.named_parameters())
    assert max((policy[n] - ref[n]).abs().max().item() for n in policy) > 0
    trainer.hard_reset()
    assert all(torch.equal(policy[n], ref[n]) for n in policy)
    assert len(trainer.optimizer.state) == 0


def test_reset_reference_false_keeps_full_finetuning_reference(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    trainer = build(
        tmp_path, model=str(tiny_dir), tokenizer=AutoTokenizer.from_pretrained(tiny_dir), peft=False, beta=0.05,
        reset_reference=False, reset_optimizer=False,
    )
    trainer.train()
    ref_before = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.hard_reset()
    assert all(torch.equal(ref_before[n], p) for n, p in trainer.ref_model.named_parameters())
    assert len(trainer.optimizer.state) > 0, "reset_optimizer=False (ProRL v2) keeps the moments"


def test_reset_adapter_false_keeps_the_adapter_and_reference_and_restarts_only_the_optimizer(tmp_path):
    """The prolonged study's "opt" arm: a reset that restarts the optimizer and warm-up alone. The live adapter's
    weights, the policy and the KL reference (the adapter-disabled model) are bitwise unchanged; nothing is frozen."""
    trainer = build(tmp_path, beta=0.05, reset_adapter=False, reset_reference=False, save_merged_on_reset=False)
    trainer.train()
    model = trainer.model
    adapter = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    before = logits(model)
    with model.disable_adapter():
        reference = logits(model)
    assert lora_b_norm(model) > 0 and (before - reference).abs().max() > 1e-4 and len(trainer.optimizer.state) > 0

    trainer.hard_reset(reason="test")

    assert all(torch.equal(p, adapter[name]) for name, p in model.named_parameters() if "lora_" in name)
    assert torch.equal(logits(model), before)
    with model.disable_adapter():
        assert torch.equal(logits(model), reference)
    assert len(trainer.optimizer.state) == 0 and trainer.prorl_resets == 1
    assert not (tmp_path / "run" / "frozen").exists()


def test_reset_adapter_false_across_a_phase_boundary_keeps_training_the_same_adapter(tmp_path):
    phases = [PhaseConfig(max_steps=2), PhaseConfig(max_steps=1)]
    trainer = build(tmp_path, phases=phases, beta=0.05, reset_adapter=False, reset_reference=False,
                    save_merged_on_reset=False)  # fmt: skip
    trainer.train()
    assert trainer.prorl_resets == 1
    assert adam_steps(trainer) == 1  # the optimizer restarted at the boundary, on the same Parameters
    assert lora_b_norm(trainer.model) > 0 and not (tmp_path / "run" / "frozen").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"reset_adapter": False, "phases": [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, lora_r=8)]},
         "the phases give it different shapes"),
        ({"reset_adapter": False, "peft": False}, "reset_adapter=False applies to LoRA runs only"),
    ],
    ids=["shape-change", "full-finetuning"],
)
def test_reset_adapter_false_settings_that_cannot_hold_are_refused(tmp_path, tiny_dir, overrides, message):
    from transformers import AutoTokenizer

    overrides = {"phases": [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)], **overrides}
    if not overrides.pop("peft", True):
        overrides.update(model=str(tiny_dir), tokenizer=AutoTokenizer.from_pretrained(tiny_dir), peft=False)
    with pytest.raises(ValueError, match=message):
        build(tmp_path, max_steps=-1, **overrides)


class Probe(TrainerCallback):
    """Runs after HardResetCallback (registered later): records the state right after each step's reset check."""

    def __init__(self):
        self.trainer = None
        self.records = []

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        self.records.append(
            dict(
                step=t.prorl_global_step,
                resets=t.prorl_resets,
                optimizer_state=len(t.optimizer.state),
                lora_b=lora_b_norm(t.model),
                lr=t.lr_scheduler.get_last_lr()[0],
            )
        )
        return control


def test_hard_reset_callback_every_steps_inside_a_phase(tmp_path):
    probe = Probe()
    trainer = build(tmp_path, max_steps=3, callbacks=[HardResetCallback(every_steps=2), probe], save_merged_on_reset=False)
    trainer.train()
    by_step = {r["step"]: r for r in probe.records}
    assert by_step[1]["resets"] == 0 and by_step[1]["optimizer_state"] > 0
    assert by_step[2]["resets"] == 1
    assert by_step[2]["optimizer_state"] == 0 and by_step[2]["lora_b"] == 0.0
    assert by_step[2]["lr"] == pytest.approx(1e-2), "a fresh LR schedule restarts from the phase's learning rate"
    assert by_step[3]["optimizer_state"] > 0, "training goes on with the fresh adapter"
    assert [e["prorl/resets"] for e in trainer.prorl_log_history if "loss" in e] == [0, 1, 1]
    assert not (tmp_path / "run" / "merged").exists()


def adam_steps(trainer):
    steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert len(steps) == 1
    return steps.pop()


@pytest.mark.parametrize(
    "phase_reset, reset_optimizer, expected_steps, expected_resets",
    [(True, True, 1, 1), (True, False, 3, 1), (False, True, 3, 0)],
    ids=["v1-reset", "v2-keep-moments", "no-reset-boundary"],
)
def test_optimizer_across_a_phase_boundary(tmp_path, phase_reset, reset_optimizer, expected_steps, expected_resets):
    phases = [PhaseConfig(max_steps=2), PhaseConfig(max_steps=1, hard_reset=phase_reset, learning_rate=5e-3)]
    trainer = build(tmp_path, phases=phases, reset_optimizer=reset_optimizer, save_merged_on_reset=False)
    trainer.train()
    assert adam_steps(trainer) == expected_steps
    assert trainer.prorl_resets == expected_resets
    assert all(group["initial_lr"] == pytest.approx(5e-3) for group in trainer.optimizer.param_groups)
