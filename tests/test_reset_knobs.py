"""One part of a LoRA hard reset alone, with beta > 0 (the prolonged study's knob arms, issue 38).

TRL's LoRA reference is the adapter-disabled model. A reset that renews the adapter but keeps the reference
(`reset_reference=False`) freezes the old delta for the policy's forward only; a reset that keeps the adapter but
moves the reference (`reset_adapter=False`, `reset_reference=True`) gives the reference a copy of the live delta.
Each must leave the other forward bit for bit where it was, survive a resume, and stay out of merged saves and the
rollout engine's policy where it is the reference's.
"""

import pytest
import torch
from _prorl_helpers import Recorder, lora, prompts_dataset, tiny_args, tiny_model
from safetensors.torch import load_file
from test_trainer_reset import lora_b_norm, logits, parity

from prorl_trl import PhaseConfig, ProRLTrainer
from prorl_trl.reset import POLICY, REFERENCE, frozen_layers, load_frozen_, lora_layers
from prorl_trl.rollout.lora_decode import frozen_factors


def build(tmp_path, **overrides):
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, **{"max_steps": 2, "beta": 0.05, **overrides})
    return ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[Recorder(), parity], args=args,
                        train_dataset=prompts_dataset(), peft_config=lora())  # fmt: skip


def forwards(model):
    """(policy logits, reference logits): TRL's reference with LoRA + beta > 0 is the adapter-disabled model."""
    policy = logits(model)
    with model.disable_adapter():
        return policy, logits(model)


def adapter_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def merged_logits(path):
    """Logits of a merged save, read into the tiny model (whose head has a bias that Qwen2's config does not name)."""
    model, _ = tiny_model()
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return logits(model)


def test_fresh_adapter_alone_keeps_the_reference_and_the_optimizer(tmp_path):
    """The "adapter" knob: reset_reference=False, reset_optimizer=False. The old delta is frozen for the policy only:
    the policy's and the reference's outputs are both bitwise unchanged, and they stay apart."""
    trainer = build(tmp_path, reset_reference=False, reset_optimizer=False)
    trainer.train()
    model = trainer.model
    policy, reference = forwards(model)
    moments = {id(p): s["exp_avg"].clone() for p, s in trainer.optimizer.state.items()}
    assert (policy - reference).abs().max() > 1e-4 and moments

    trainer.hard_reset(reason="test")

    assert lora_b_norm(model) == 0.0  # a fresh adapter
    after_policy, after_reference = forwards(model)
    assert torch.equal(after_policy, policy) and torch.equal(after_reference, reference)
    kinds = {frozen.acts_in for _, _, frozen in frozen_layers(model)}
    assert kinds == {POLICY}
    assert {id(p): s["exp_avg"] for p, s in trainer.optimizer.state.items()}.keys() == moments.keys()
    assert all(torch.equal(trainer.optimizer.state[p]["exp_avg"], moments[id(p)]) for p in trainer.optimizer.state)
    # what a resume reads back: the part and the forwards it acts in
    saved = load_file(str(tmp_path / "run" / "frozen" / "reset-1.safetensors"))
    assert {int(v.item()) for k, v in saved.items() if k.endswith(".acts_in")} == {1}
    fresh, _ = tiny_model()
    from peft import get_peft_model

    fresh = get_peft_model(fresh, lora())
    assert load_frozen_(fresh, saved) == len(frozen_layers(model))
    fresh_policy, fresh_reference = forwards(fresh)  # a fresh adapter (B = 0) over the same base and parts
    assert torch.equal(fresh_policy, policy) and torch.equal(fresh_reference, reference)
    # the merged save is the policy (the part folded in), not the reference
    assert (merged_logits(tmp_path / "run" / "merged" / "reset-1") - policy).abs().max().item() < 1e-4


def test_fresh_adapter_alone_across_phases_trains_on_without_moving_the_reference(tmp_path):
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)]
    trainer = build(tmp_path, max_steps=-1, phases=phases, reset_reference=False, reset_optimizer=False,
                    save_merged_on_reset=False)  # fmt: skip
    _, reference = forwards(trainer.model)
    trainer.train()
    assert trainer.prorl_resets == 2 and trainer.prorl_adapter_resets == 2
    policy, after = forwards(trainer.model)
    assert torch.equal(after, reference)  # the base: no reset moved it
    assert (policy - reference).abs().max() > 1e-4  # two frozen parts (or one joined) and the live adapter act
    assert {frozen.acts_in for _, _, frozen in frozen_layers(trainer.model)} == {POLICY}


def test_reference_reset_alone_copies_the_live_delta_into_the_reference(tmp_path):
    """The "ref" knob: reset_adapter=False, reset_optimizer=False, reset_reference=True. The policy (adapter,
    outputs, optimizer) is untouched and the reference becomes it bit for bit; a later reset replaces the copy."""
    trainer = build(tmp_path, reset_adapter=False, reset_optimizer=False, save_merged_on_reset=True)
    trainer.train()
    model = trainer.model
    adapter = adapter_of(model)
    policy, reference = forwards(model)
    state_before = len(trainer.optimizer.state)
    assert (policy - reference).abs().max() > 1e-4 and state_before

    trainer.hard_reset(reason="test")

    after_policy, after_reference = forwards(model)
    assert torch.equal(after_policy, policy) and torch.equal(after_reference, policy)
    assert all(torch.equal(p, adapter[name]) for name, p in model.named_parameters() if "lora_" in name)
    assert len(trainer.optimizer.state) == state_before and trainer.prorl_adapter_resets == 0
    layers = frozen_layers(model)
    assert layers and {frozen.acts_in for _, _, frozen in layers} == {REFERENCE}
    rank = sum(frozen.rank for _, _, frozen in layers)
    for name, base, frozen in layers:  # the rollout engine generates with the policy: it leaves the copy out
        (wrapper,) = [layer for n, layer in lora_layers(model) if base is layer.get_base_layer()]
        assert frozen_factors(wrapper) == []
    merged = merged_logits(tmp_path / "run" / "merged" / "reset-1")
    assert (merged - policy).abs().max().item() < 1e-4  # the policy once: the copy is not added again

    with torch.no_grad():  # the adapter moves on; the next reference reset copies the new delta, replacing the old
        for _, layer in lora_layers(model):
            layer.lora_B["default"].weight.mul_(1.5)
    moved, _ = forwards(model)
    trainer.hard_reset(reason="test")
    again_policy, again_reference = forwards(model)
    assert torch.equal(again_policy, moved) and torch.equal(again_reference, moved)
    assert sum(frozen.rank for _, _, frozen in frozen_layers(model)) == rank  # replaced, not stacked
    saved = load_file(str(tmp_path / "run" / "frozen" / "reset-2.safetensors"))
    assert {int(v.item()) for k, v in saved.items() if k.endswith(".acts_in")} == {2}


def test_reference_reset_alone_resumes_with_its_copy(tmp_path):
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=2)]
    common = dict(max_steps=-1, phases=phases, reset_adapter=False, reset_optimizer=False, save_merged_on_reset=False,
                  save_strategy="steps", save_steps=1)  # fmt: skip
    trainer = build(tmp_path, **common)
    trainer.train()
    policy, reference = forwards(trainer.model)
    assert trainer.prorl_resets == 1 and (policy - reference).abs().max() > 0  # one step since the copy
    resumed = build(tmp_path, **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.prorl_resets == 1
    assert {frozen.acts_in for _, _, frozen in frozen_layers(resumed.model)} == {REFERENCE}
    assert torch.equal(forwards(resumed.model)[1], reference)


def test_one_forward_resets_that_cannot_hold_are_refused(tmp_path, monkeypatch):
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)]
    with pytest.raises(ValueError, match="needs lora_reset_mode='frozen'"):
        build(tmp_path, max_steps=-1, phases=phases, reset_reference=False, lora_reset_mode="merge")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    for knobs in ({"reset_reference": False}, {"reset_adapter": False}):
        with pytest.raises(ValueError, match="not under DeepSpeed ZeRO or FSDP"):
            build(tmp_path, max_steps=-1, phases=phases, **knobs)


def test_a_resume_with_other_reset_parts_is_refused_before_training(tmp_path):
    """A checkpoint whose frozen parts act in the policy's forward only (reset_reference=False) resumed with
    reset_reference=True: its reference is not what the settings say, and the next reset could not join the parts."""
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)]
    common = dict(max_steps=-1, phases=phases, reset_optimizer=False, save_merged_on_reset=False,
                  save_strategy="steps", save_steps=1)  # fmt: skip
    build(tmp_path, reset_reference=False, **common).train()
    changed = build(tmp_path, reset_reference=True, **common)
    with pytest.raises(ValueError, match="act in the policy forward"):
        changed.train(resume_from_checkpoint=True)


def test_reference_reset_alone_with_trls_ref_adapter_makes_the_reference_the_policy(tmp_path):
    """A PeftModel passed in with beta > 0: TRL's reference is its "ref" adapter (a copy of the adapter at the start),
    not the adapter-disabled base. The reference reset must still make the reference the current policy."""
    from peft import get_peft_model
    from trl.trainer.utils import use_adapter

    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, max_steps=2, beta=0.05, reset_adapter=False, reset_optimizer=False,
                     save_merged_on_reset=False)  # fmt: skip
    trainer = ProRLTrainer(model=get_peft_model(model, lora()), processing_class=tokenizer,
                           reward_funcs=[Recorder(), parity], args=args, train_dataset=prompts_dataset())  # fmt: skip
    peft_model = trainer.model
    assert "ref" in peft_model.peft_config
    trainer.train()

    def reference():
        with use_adapter(peft_model, adapter_name="ref"):  # as TRL computes the reference's log-probs
            return logits(peft_model)

    policy = logits(peft_model)
    assert (policy - reference()).abs().max() > 1e-4
    trainer.hard_reset(reason="test")
    assert torch.equal(logits(peft_model), policy) and torch.equal(reference(), policy)
