"""The rollout engine inside `ProRLTrainer` (CPU, graphs off): same completions as TRL's transformers branch, a full
training step through it, and the fallbacks (CPU without `allow_cpu`, unsupported settings). About 10 s."""

from __future__ import annotations

import logging

import torch
from _prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model
from trl import GRPOTrainer

from prorl_trl import ProRLTrainer
from prorl_trl.rollout.trl_generation import attach_rollout_engine


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def build(tmp_path, eos_bias: float = 3.0, **overrides):
    model, tokenizer = tiny_model(eos_bias)
    return ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[zero_reward], train_dataset=prompts_dataset(),
        args=tiny_args(tmp_path, max_steps=1, rollout_engine=True, **overrides), peft_config=lora(),
    )  # fmt: skip


def test_cpu_falls_back_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="prorl_trl"):
        trainer = build(tmp_path)
    assert trainer.rollout_engine is None
    assert "rollout_engine: not used (the model is on cpu, not CUDA)" in caplog.text


def test_engine_completions_equal_trls_and_a_step_trains(tmp_path):
    """top_k=1 makes both paths deterministic: the engine's completion id lists (EOS kept, nothing after it, left
    padding of prompts of different lengths) equal TRL's `generate` branch's, row for row."""
    trainer = build(tmp_path, eos_bias=0.4, top_k=1, max_completion_length=12)  # greedy lengths 1..12
    trainer.rollout_engine = attach_rollout_engine(trainer, allow_cpu=True)
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer(f"Q{i}: {'x' * i}+{i}=")["input_ids"] for i in range(8)]
    trainer.model.train()
    ours, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 4)
    theirs, _ = GRPOTrainer._generate_single_turn(trainer, prompt_ids, None, {}, 4)
    assert logprobs is None and ours == theirs
    lengths = [len(ids) for ids in ours]
    assert len(set(lengths)) > 1 and any(ids[-1] == tokenizer.eos_token_id for ids in ours)
    assert trainer.rollout_engine.stats.generations == 1
    trainer.args.top_k = trainer.top_k = 0  # sampling, through the engine, for a whole optimizer step
    trainer.generation_config.top_k = trainer.generation_kwargs["top_k"] = 0
    trainer.train()
    assert trainer.rollout_engine.stats.generations >= 2
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)  # after the phase-start entry
    assert logged["completions/max_length"] <= 12 and torch.isfinite(torch.tensor(logged["loss"]))


def test_unsupported_setting_falls_back_to_generate(tmp_path, caplog):
    trainer = build(tmp_path, repetition_penalty=1.2)
    trainer.rollout_engine = attach_rollout_engine(trainer, allow_cpu=True)
    prompt_ids = [[5, 6, 7], [8, 9]]
    with caplog.at_level(logging.WARNING, logger="prorl_trl"):
        completions, _ = trainer._generate_single_turn(prompt_ids, None, {}, 2)
    assert "falling back to generate (settings the rollout engine does not implement: repetition_penalty=1.2)" in caplog.text
    assert len(completions) == 2 and trainer.rollout_engine.stats.generations == 0
