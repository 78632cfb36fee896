"""Overlong penalty (phase-aware), dynamic sampling (drop + refill) and minibatch early stop in ProRLTrainer."""

import math

import pytest
import torch
from _prorl_helpers import Recorder, lora, prompts_dataset, tiny_args, tiny_model
from transformers import TrainerCallback

from prorl_trl import PhaseConfig, ProRLTrainer
from prorl_trl.trainer.dynamic_sampling import dynamic_sampling_step, select_rows, uniform_groups
from prorl_trl.trainer.overlong import OverlongPenalty, overlong_penalty


def test_overlong_formula_matches_dapo_worked_values():
    # reward-formulas.md §2: L_max 20480, buffer 4096.
    values = [overlong_penalty(n, 20480, 4096) for n in (16384, 16385, 18432, 20480)]
    assert values == pytest.approx([0.0, -1 / 4096, -0.5, -1.0])
    assert overlong_penalty(100, 20480, 0) == 0.0
    assert OverlongPenalty(8, 4, factor=0.5)(completion_ids=[[1] * 6]) == [-0.25]


def test_overlong_penalty_follows_each_phase_cap(tmp_path):
    model, tokenizer = tiny_model()
    recorder = Recorder()
    phases = [
        PhaseConfig(max_steps=2, max_completion_length=8, overlong_buffer=3),
        PhaseConfig(max_steps=2, max_completion_length=5, overlong_buffer=2, overlong_penalty_factor=0.5, reward_weights=[2.0]),
    ]
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[recorder], args=tiny_args(tmp_path, phases=phases),
        train_dataset=prompts_dataset(), peft_config=lora(),
    )
    recorder.trainer = trainer
    assert trainer.reward_func_names == ["recorder", "overlong_penalty"]
    trainer.train()
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    logged = [e["rewards/overlong_penalty/mean"] for e in trainer.prorl_log_history if "loss" in e]
    settings = [(8, 3, 1.0)] * 2 + [(5, 2, 0.5)] * 2
    values = []
    for call, (cap, buffer, factor), got in zip(recorder.calls, settings, logged, strict=True):
        expected = [overlong_penalty(n, cap, buffer, factor) for n in call["lengths"]]
        values += expected
        assert got == pytest.approx(sum(expected) / len(expected))
    assert any(-1.0 < v < 0.0 for v in values), "some completions should end inside the buffer"


def none_for_every_other(completions, **kwargs):
    """None (unscorable) for every other completion of the batch, a number by length for the rest."""
    return [None if i % 2 == 0 else float(len(str(c)) % 3) for i, c in enumerate(completions)]


def test_a_completion_no_reward_scored_stays_unscored_beside_the_overlong_penalty(tmp_path):
    """TRL skips a completion (advantage 0) only when every reward column is None/NaN; the penalty column is a number
    for every completion, so unscorable groups were trained on their lengths alone (review of 2026-11-29). The
    penalty is now NaN where every other reward is, and TRL's own mask gives those completions advantage 0."""
    model, tokenizer = tiny_model()
    args = tiny_args(tmp_path, max_steps=1, max_completion_length=8, overlong_buffer=4)
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[none_for_every_other], args=args,
                           train_dataset=prompts_dataset(), peft_config=lora())  # fmt: skip
    probe = BufferProbe()
    probe.bind(trainer)
    trainer.add_callback(probe)
    trainer.train()
    rewards = trainer._last_rewards_per_func
    unscored = torch.isnan(rewards[:, 0])
    assert unscored.any() and (~unscored).any()
    assert torch.isnan(rewards[unscored, 1]).all() and not torch.isnan(rewards[~unscored, 1]).any()
    advantages = probe.advantages[0]  # one process: every row, shuffled by TRL; the unscored ones are exactly 0
    assert len(advantages) == len(unscored) and int((advantages == 0).sum()) >= int(unscored.sum())


def correctness(prompts, completion_ids, kind, **kwargs):
    """1/0 by the prompt's `kind`: easy = all right, hard = all wrong, mixed = alternating inside the group."""
    return [1.0 if k == "easy" else 0.0 if k == "hard" else float(i % 2) for i, k in enumerate(kind)]


class BufferProbe(TrainerCallback):
    def __init__(self):
        self.trainer, self.advantages, self.items = None, [], []

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        batch = self.trainer._buffered_inputs[0]
        self.advantages.append(batch["advantages"].clone())
        self.items.append((int(batch["num_items_in_batch"]), int(batch["completion_mask"].sum())))
        return control


def test_dynamic_sampling_drops_uniform_groups_and_refills(tmp_path):
    model, tokenizer = tiny_model()
    kinds = ["easy", "hard", "mixed"] * 8
    probe = BufferProbe()
    args = tiny_args(
        tmp_path, max_steps=3, per_device_train_batch_size=8, dynamic_sampling=True, dynamic_sampling_max_rounds=8
    )
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[correctness], args=args,
        train_dataset=prompts_dataset(len(kinds), kind=kinds), peft_config=lora(), callbacks=[probe],
    )
    trainer.train()
    for advantages in probe.advantages:
        assert advantages.numel() == 8 and (advantages.abs() > 0.5).all(), advantages
    for items, mask_sum in probe.items:
        assert items == mask_sum, "the dapo token normaliser must count the kept rows"
    steps = [e for e in trainer.prorl_log_history if "loss" in e]
    assert all(e["prorl/dropped_groups"] > 0 for e in steps)
    assert max(e["prorl/sampling_rounds"] for e in steps) > 1
    assert all(e["prorl/informative_groups"] == 1.0 for e in steps)


def fake_output(rows, prompt_width, completion_width, offset):
    return {
        "prompt_ids": torch.arange(rows * prompt_width).view(rows, prompt_width) + offset,
        "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
        "completion_ids": torch.arange(rows * completion_width).view(rows, completion_width) + offset,
        "completion_mask": torch.ones(rows, completion_width, dtype=torch.long),
        "advantages": torch.arange(rows, dtype=torch.float) + offset,
        "num_items_in_batch": torch.tensor(0),
    }


def test_dynamic_sampling_step_on_two_ranks_and_fallback():
    # Two ranks x one group of 2 per round. Round 0: rank 0 uniform, rank 1 mixed. Round 1: rank 0 mixed.
    rounds = iter([(fake_output(2, 4, 5, 100), torch.tensor([1.0, 0.0, 1.0, 1.0]))])
    combined, stats = dynamic_sampling_step(
        fake_output(2, 3, 2, 0), torch.tensor([1.0, 1.0, 0.0, 1.0]), lambda: next(rounds),
        num_generations=2, process_index=0, num_processes=2, max_extra_rounds=3, pad_token_id=-1,
    )
    assert combined["advantages"].tolist() == [100.0, 101.0], "rank 0 takes the refill round's group"
    assert combined["prompt_ids"].shape == (2, 4) and combined["completion_ids"].shape == (2, 5)
    assert stats == {"prorl/dropped_groups": 0.5, "prorl/sampling_rounds": 2.0, "prorl/informative_groups": 1.0}
    # No extra round allowed: rank 0 keeps its uniform group (advantage 0 in TRL), the batch keeps its size.
    combined, stats = dynamic_sampling_step(
        fake_output(2, 3, 2, 0), torch.tensor([1.0, 1.0, 0.0, 1.0]), lambda: pytest.fail("no refill allowed"),
        num_generations=2, process_index=0, num_processes=2, max_extra_rounds=0, pad_token_id=-1,
    )
    assert combined["advantages"].tolist() == [0.0, 1.0] and stats["prorl/informative_groups"] == 0.5


def test_select_rows_repads_each_side():
    a, b = fake_output(1, 2, 3, 0), fake_output(1, 4, 1, 10)
    combined = select_rows([a, b], [(0, 0), (1, 0)], pad_token_id=-1)
    assert combined["prompt_ids"].tolist() == [[-1, -1, 0, 1], [10, 11, 12, 13]]  # left padded
    assert combined["completion_ids"].tolist() == [[0, 1, 2], [10, -1, -1]]  # right padded
    assert combined["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="pixel_values"):
        select_rows([{**a, "pixel_values": torch.zeros(1)}], [(0, 0)], pad_token_id=-1)


def test_uniform_groups_ignores_unscored():
    nan = math.nan
    assert uniform_groups(torch.tensor([1.0, nan, 1.0, nan, nan, nan, 0.0, 1.0, nan]), 3).tolist() == [True, True, False]


def test_early_stop_zeroes_an_off_policy_microbatch(tmp_path):
    model, tokenizer = tiny_model()
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[correctness],
        args=tiny_args(tmp_path, max_steps=1, early_stop_importance_ratio=5.0), train_dataset=prompts_dataset(),
        peft_config=lora(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the HF loop before each step's micro-batches
    prompt_ids = torch.arange(3, 11).view(2, 4).repeat(2, 1)
    completion_ids = torch.arange(20, 44).view(4, 6)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
        "advantages": torch.ones(4),
        "num_items_in_batch": torch.tensor(24),
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.ones(4, 10, dtype=torch.long), 6
        )
    on_policy = trainer.compute_loss(trainer.model, {**inputs, "old_per_token_logps": logps})
    assert on_policy.item() == pytest.approx(-1.0, abs=1e-4) and trainer._early_stopped == 0
    off_policy = trainer.compute_loss(trainer.model, {**inputs, "old_per_token_logps": logps - 3.0})  # ratio e^3 > 5
    assert off_policy.item() == 0.0 and trainer._early_stopped == 1
    off_policy.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert all(g is not None and g.abs().sum() == 0 for g in grads), "zeroed, but still part of the graph (DDP)"
    assert trainer._metrics["train"]["prorl/importance_ratio"][-1] == pytest.approx(math.exp(3.0), rel=1e-4)
    trainer.log({"loss": 0.0})  # the count is logged under DESIGN.md's name, then starts again
    assert trainer.prorl_log_history[-1]["prorl/early_stopped_microbatches"] == 1 and trainer._early_stopped == 0
