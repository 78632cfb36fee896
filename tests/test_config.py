"""ProRLConfig / PhaseConfig / resolve_phases: carry-over rules and fail-fast errors (no model needed)."""

import pytest
from peft import LoraConfig

from prorl_trl.config import PhaseConfig, ProRLConfig, resolve_phases

BASE = dict(use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4, num_generations=4)


def config(tmp_path, **overrides):
    return ProRLConfig(output_dir=str(tmp_path), **{**BASE, **overrides})


def test_single_phase_default_uses_max_steps(tmp_path):
    (phase,) = resolve_phases(config(tmp_path, max_steps=7, temperature=0.9))
    assert (phase.name, phase.max_steps, phase.temperature, phase.hard_reset) == ("main", 7, 0.9, False)


def test_a_single_phase_without_max_steps_takes_its_length_from_epochs(tmp_path):
    # HF's convention (max_steps=-1: from num_train_epochs), so one phase trains exactly as long as GRPOTrainer.
    (phase,) = resolve_phases(config(tmp_path, num_train_epochs=3))
    assert (phase.max_steps, phase.length) == (-1, "3ep")
    (phase,) = resolve_phases(config(tmp_path, num_train_epochs=3, phases=[PhaseConfig(temperature=0.9)]))
    assert phase.max_steps == -1 and phase.temperature == 0.9
    (phase,) = resolve_phases(config(tmp_path, max_steps=5, phases=[PhaseConfig(name="only")]))
    assert (phase.max_steps, phase.length) == (5, "5")


def test_a_multi_phase_run_needs_every_phase_length_at_init(tmp_path):
    args = config(tmp_path, max_steps=5, phases=[PhaseConfig(max_steps=2), PhaseConfig(name="second", top_p=0.9)])
    with pytest.raises(ValueError, match=r"phase 1 \(second\): max_steps is required in a multi-phase run"):
        resolve_phases(args)
    with pytest.raises(ValueError, match="max_steps must be >= 1, got -1"):  # -1 is only the unset single phase
        resolve_phases(config(tmp_path, phases=[PhaseConfig(max_steps=-1)]))


def test_fields_carry_over_from_previous_phase(tmp_path):
    args = config(
        tmp_path,
        temperature=1.1,
        max_completion_length=16,
        phases=[
            {"max_steps": 2, "top_p": 0.9},
            PhaseConfig(max_steps=3, temperature=1.2, num_generations=2),
            PhaseConfig(max_steps=1, name="last", hard_reset=False, lora_r=8),
        ],
    )
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    first, second, third = resolve_phases(args, peft)
    assert (first.temperature, first.top_p, first.max_completion_length) == (1.1, 0.9, 16)
    assert (second.temperature, second.top_p) == (1.2, 0.9)
    assert (first.lora_r, first.lora_alpha, first.lora_target_modules) == (4, 8, ["q_proj", "v_proj"])
    assert third.lora_r == 8 and third.lora_alpha == 8 and third.name == "last"
    # Prompts per generation batch are kept when the group size changes (4 completions = 1 prompt x 4 -> 1 x 2 ...)
    assert first.generation_batch_size == 4
    assert second.generation_batch_size == 4, "1 prompt x 2 rounded up to one micro-batch of 4 (2 prompts)"
    assert third.generation_batch_size == 4
    assert [p.hard_reset for p in (first, second, third)] == [False, True, False]
    assert first.lora_shape != third.lora_shape


def test_generation_batch_must_hold_whole_groups_and_micro_batches(tmp_path):
    args = config(tmp_path, phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, num_generations=3, generation_batch_size=8)])
    with pytest.raises(ValueError, match="phase 1.*not divisible by num_generations 3"):
        resolve_phases(args)


def test_group_size_change_rounds_up_to_whole_micro_batches(tmp_path):
    args = config(tmp_path, phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, num_generations=3)])
    assert [p.generation_batch_size for p in resolve_phases(args)] == [4, 12]


@pytest.mark.parametrize(
    "phase, message",
    [
        (PhaseConfig(max_steps=0), "max_steps must be >= 1"),
        (PhaseConfig(max_steps=1, num_generations=1), "num_generations must be >= 2"),
        (PhaseConfig(max_steps=1, temperature=0.0), "temperature must be > 0"),
        (PhaseConfig(max_steps=1, top_p=1.5), "top_p"),
        (PhaseConfig(max_steps=1, overlong_buffer=16, max_completion_length=16), "overlong_buffer"),
        (PhaseConfig(max_steps=1, overlong_buffer=4, overlong_penalty_factor=-1.0), "overlong_penalty_factor must"),
        (PhaseConfig(max_steps=1, lora_r=8), "no peft_config"),
    ],
)
def test_bad_phase_names_phase_and_field(tmp_path, phase, message):
    with pytest.raises(ValueError, match=message):
        resolve_phases(config(tmp_path, phases=[phase]))


def test_config_level_errors(tmp_path):
    with pytest.raises(ValueError, match="phases"):
        config(tmp_path, phases=[])
    with pytest.raises(ValueError, match="plateau_mode"):
        config(tmp_path, plateau_mode="up")
    with pytest.raises(ValueError, match="overlong_buffer"):
        config(tmp_path, overlong_buffer=-1)
    with pytest.raises(TypeError):
        config(tmp_path, phases=[{"max_steps": 1, "temprature": 1.0}])


def test_every_field_has_help():
    import dataclasses

    for cls in (ProRLConfig, PhaseConfig):
        own = [f for f in dataclasses.fields(cls) if f.name in cls.__annotations__]
        assert own and all(f.metadata.get("help") for f in own), cls


def test_trls_own_parsers_read_prorl_config_with_phases_from_a_config_file(tmp_path):
    """Scripts built on TRL's `TrlParser` (and HF's `HfArgumentParser`) take ProRLConfig as they take GRPOConfig:
    every field from the command line, `phases` from the YAML config file, `resume_from_checkpoint` as text."""
    from transformers import HfArgumentParser
    from trl import ModelConfig, TrlParser

    from prorl_trl.config import PhaseConfig, ProRLConfig, resolve_phases

    (args,) = HfArgumentParser(ProRLConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--resume_from_checkpoint", "latest",
         "--lora_reset_mode", "merge"]  # fmt: skip
    )
    assert args.resume_from_checkpoint is True and args.lora_reset_mode == "merge"
    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nmax_steps: 2\nphases:\n"
        "  - {name: first, max_steps: 2}\n  - {name: second, max_steps: 3, temperature: 1.2, num_generations: 4}\n"
    )
    args, _ = TrlParser((ProRLConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(config), "--learning_rate", "3e-5", "--resume_from_checkpoint", "runs/x/phase-0/checkpoint-2"]
    )
    assert all(isinstance(phase, PhaseConfig) for phase in args.phases) and args.learning_rate == 3e-5
    assert [(p.name, p.max_steps, p.temperature, p.num_generations) for p in resolve_phases(args)] == [
        ("first", 2, 1.0, 8), ("second", 3, 1.2, 4)
    ]
    assert args.resume_from_checkpoint == "runs/x/phase-0/checkpoint-2"
    with pytest.raises(SystemExit):  # the field's `choices` reach argparse
        HfArgumentParser(ProRLConfig).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--lora_reset_mode", "x"])
    with pytest.raises(ValueError, match="lora_reset_mode must be one of"):
        ProRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, lora_reset_mode="x")


def test_checkpoints_without_optimizer_state_are_refused(tmp_path):
    """save_only_model checkpoints lack the optimizer, scheduler and RNG files, and HF resumes from them without a
    word (a fresh Adam, the schedule from its start): refused while checkpoints are written, allowed without them."""
    with pytest.raises(ValueError, match="save_only_model: true writes checkpoints without the optimizer"):
        ProRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, save_only_model=True, save_strategy="steps")
    assert ProRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, save_only_model=True, save_strategy="no")
