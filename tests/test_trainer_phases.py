"""ProRLTrainer phases: each phase's group size, cap, sampling, LoRA shape and loss temperature are the ones used."""

import json

import pytest
import torch
from _prorl_helpers import Recorder, lora, loss_vs_manual_logps, prompts_dataset, tiny_args, tiny_model
from transformers import AutoModelForCausalLM

from prorl_trl import PhaseConfig, ProRLTrainer
from prorl_trl.config import ProRLConfig

PHASES = [
    dict(name="warm", max_steps=2, temperature=1.0, top_p=1.0),
    dict(
        name="narrow",
        max_steps=2,
        num_generations=2,
        generation_batch_size=4,
        max_completion_length=4,
        temperature=0.7,
        top_p=0.9,
        lora_r=2,
        lora_target_modules=["q_proj", "v_proj", "o_proj"],
    ),
    dict(name="wide", max_steps=2, num_generations=4, generation_batch_size=4, max_completion_length=6, temperature=1.3, top_p=0.8, lora_r=8),
]


@pytest.fixture(scope="module")
def three_phase_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("phases")
    model, tokenizer = tiny_model()
    recorder = Recorder()
    args = tiny_args(tmp_path, phases=[PhaseConfig(**p) for p in PHASES])
    trainer = ProRLTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[recorder],
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora(4),
    )
    recorder.trainer = trainer
    output = trainer.train()
    return trainer, recorder, output, tmp_path / "run"


def calls_of(recorder, phase):
    return [c for c in recorder.calls if c["phase"] == phase]


def test_each_phase_generates_with_its_settings(three_phase_run):
    _, recorder, _, _ = three_phase_run
    expected = [
        dict(group=4, cap=8, temperature=1.0, top_p=1.0, r=4, targets=["q_proj", "v_proj"]),
        dict(group=2, cap=4, temperature=0.7, top_p=0.9, r=2, targets=["o_proj", "q_proj", "v_proj"]),
        dict(group=4, cap=6, temperature=1.3, top_p=0.8, r=8, targets=["o_proj", "q_proj", "v_proj"]),
    ]
    for phase, want in enumerate(expected):
        calls = calls_of(recorder, phase)
        assert len(calls) == 2, f"phase {phase}: one generation per step expected"
        lengths = [n for c in calls for n in c["lengths"]]
        assert max(lengths) == want["cap"], f"phase {phase}: lengths {lengths} vs cap {want['cap']}"
        for call in calls:
            assert set(call["group_sizes"]) == {want["group"]}
            assert call["max_new_tokens"] == want["cap"]
            assert call["temperature"] == pytest.approx(want["temperature"])
            assert call["top_p"] == pytest.approx(want["top_p"])
            assert call["lora_r"] == want["r"] and call["lora_targets"] == want["targets"]
            # The loss's log-probs use this phase's temperature (TRL bakes it into the fused head at init).
            assert call["logp_error"] < 1e-5


def test_phases_do_not_replay_the_same_prompts(three_phase_run):
    _, recorder, _, _ = three_phase_run
    first = [calls_of(recorder, phase)[0]["prompts"] for phase in range(3)]
    assert first[0] != first[1] and first[0] != first[2], "reseed_phases shifts TRL's sampler seed per phase"


def test_fused_head_follows_the_last_phase_temperature(three_phase_run):
    trainer = three_phase_run[0]
    assert loss_vs_manual_logps(trainer, 1.3) < 1e-5
    assert loss_vs_manual_logps(trainer, 1.0) > 1e-3  # the init temperature is really gone


def test_prorl_logs_and_history(three_phase_run):
    trainer, _, output, out_dir = three_phase_run
    steps = [e for e in trainer.prorl_log_history if "loss" in e]
    assert [e["prorl/global_step"] for e in steps] == [1, 2, 3, 4, 5, 6]
    assert [e["prorl/phase"] for e in steps] == [0, 0, 1, 1, 2, 2]
    assert [e["prorl/resets"] for e in steps] == [0, 0, 1, 1, 2, 2]
    assert output.global_step == 6 and trainer.prorl_resets == 2
    saved = json.loads((out_dir / "prorl_log_history.json").read_text())
    assert [e["prorl/global_step"] for e in saved if "loss" in e] == [1, 2, 3, 4, 5, 6]
    # `step` is the run's continuous step (issue 30: it restarted each phase); HF's per-phase step is kept apart.
    assert [e["step"] for e in saved if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert [e["prorl/phase_step"] for e in saved if "loss" in e] == [1, 2, 1, 2, 1, 2]
    assert all(e["step"] == e["prorl/global_step"] for e in saved)
    assert "rewards/recorder/mean" in steps[0]
    assert [e["prorl/global_step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]


def test_merged_saves_and_final_model(three_phase_run):
    trainer, _, _, out_dir = three_phase_run
    assert (out_dir / "merged" / "reset-1" / "config.json").is_file()
    assert (out_dir / "merged" / "reset-2" / "config.json").is_file()
    final = AutoModelForCausalLM.from_pretrained(out_dir / "final")
    assert (out_dir / "final" / "tokenizer_config.json").is_file()
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        live = trainer.model(input_ids=ids).logits
        # tiny_model() adds an EOS bias to lm_head that Qwen2's config cannot express; add it back.
        loaded = final(input_ids=ids).logits + trainer.model.get_base_model().lm_head.bias
    assert (live - loaded).abs().max().item() < 1e-5


def test_phase_errors_fail_before_model_loading(tmp_path):
    args = tiny_args(tmp_path, beta=0.0, phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, beta=0.1)])
    with pytest.raises(ValueError, match="beta"):
        ProRLTrainer(model="no/such-model", reward_funcs=[Recorder()], args=args, train_dataset=prompts_dataset())
    # generation_kwargs may set a sampling key only when no phase changes it (TRL applies it over the phase value).
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, temperature=0.7)]
    args = tiny_args(tmp_path, generation_kwargs={"temperature": 0.5}, phases=phases)
    with pytest.raises(ValueError, match=r"generation_kwargs sets \['temperature'\], which a phase changes"):
        ProRLTrainer(model="no/such-model", reward_funcs=[Recorder()], args=args, train_dataset=prompts_dataset())


def test_needs_prorl_config(tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="ProRLConfig"):
        ProRLTrainer(model="x", reward_funcs=[Recorder()], args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))


def test_caller_config_is_not_mutated(tmp_path):
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, overlong_buffer=2, phases=[PhaseConfig(max_steps=1, max_completion_length=6)])
    ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[Recorder()], args=args, train_dataset=prompts_dataset())
    assert args.reward_weights is None and isinstance(args, ProRLConfig)


def test_phases_keep_the_weight_of_rewards_trl_appends(tmp_path):
    # TRL appends an environment's `get_reward` after the user's rewards with weight 1 (guarded in
    # test_trainer_internals); a phase sets the user's weights and must keep that one (and the overlong penalty's).
    model, tokenizer = tiny_model()
    phases = [PhaseConfig(max_steps=1, reward_weights=[2.0]), PhaseConfig(max_steps=1, reward_weights=[3.0])]
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[Recorder()], train_dataset=prompts_dataset(),
                           args=tiny_args(tmp_path, overlong_buffer=2, phases=phases))
    trainer.reward_funcs.append(lambda environments, **kwargs: [None] * len(environments))  # as TRL's env path does
    trainer.reward_weights = torch.cat([trainer.reward_weights, torch.ones(1)])
    trainer._apply_phase(trainer.phases[1])
    assert trainer.reward_weights.tolist() == [3.0, 1.0, 1.0]
