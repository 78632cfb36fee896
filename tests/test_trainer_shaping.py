"""Overlong penalty (phase-aware), dynamic sampling (drop + refill) and minibatch early stop in ProRLTrainer."""

import math

import numpy as np
import pytest
import torch
import yaml
from _prorl_helpers import TINY_ARGS, Recorder, lora, prompts_dataset, tiny_args, tiny_model
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from prorl_trl import PhaseConfig, ProRLTrainer
from prorl_trl.cli import main
from prorl_trl.config import resolve_phases
from prorl_trl.trainer.checks import check_before_init
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


# ---------------------------------------------------------------------------------------------------------------------
# The DAPO shaping against TRL's reward aggregation (review of 2026-11-29): which `multi_objective_aggregation` /
# `scale_rewards` give what DAPO and verl compute, and which are refused (`checks.check_reward_shaping`).


def verl_overlong_penalty(length, max_completion_length, overlong_buffer, factor):
    """verl's DAPO reward manager, written out: `min(-(length - (L_max - B)) / B * factor, 0)`, added to the score."""
    return min(-(length - (max_completion_length - overlong_buffer)) / overlong_buffer * factor, 0.0)


class EndsWithEos:
    """A correctness stand-in: 1.0 for a completion that stopped by itself (ends with EOS), else 0.0. Keeps what it
    saw and returned, in TRL's batch order."""

    __name__ = "ends_with_eos"

    def __init__(self, eos_token_id):
        self.eos_token_id, self.lengths, self.values = eos_token_id, [], []

    def __call__(self, completion_ids, **kwargs):
        values = [float(len(ids) > 0 and ids[-1] == self.eos_token_id) for ids in completion_ids]
        self.lengths += [len(ids) for ids in completion_ids]
        self.values += values
        return values


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_overlong_penalty_enters_the_score_before_the_advantage_as_in_verl(tmp_path, scale_rewards):
    """verl (DAPO recipe): score = correctness + penalty, then the advantage of the score. With TRL's default
    `sum_then_normalize` the penalty is one more column summed (weight 1) before the advantage, so every
    `scale_rewards` is that formula on the verl score: 'group' is verl's GRPO (TRL's epsilon 1e-4, verl's 1e-6),
    'none' verl's `norm_adv_by_std_in_grpo=False` (Dr. GRPO), 'batch' the std of every score of the generation batch
    (TRL gathers all processes' rewards first, so the same on every rank)."""
    model, tokenizer = tiny_model()
    correctness_reward = EndsWithEos(tokenizer.eos_token_id)
    args = tiny_args(tmp_path, max_steps=1, per_device_train_batch_size=8, overlong_buffer=4,
                     overlong_penalty_factor=0.5, scale_rewards=scale_rewards)  # fmt: skip
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[correctness_reward], args=args,
                           train_dataset=prompts_dataset(), peft_config=lora())  # fmt: skip
    trainer.train()
    penalty = torch.tensor([verl_overlong_penalty(n, 8, 4, 0.5) for n in correctness_reward.lengths])
    score = (torch.tensor(correctness_reward.values) + penalty).view(-1, 4)  # one row per group
    centred = score - score.mean(dim=1, keepdim=True)
    std = {"group": score.std(dim=1, keepdim=True), "batch": score.std(), "none": None}[scale_rewards]
    expected = (centred if std is None else centred / (std + 1e-4)).flatten()
    torch.testing.assert_close(torch.tensor(list(trainer._logs["advantages"])), expected, atol=1e-5, rtol=1e-5)
    assert (penalty < 0).any() and (penalty == 0).any(), "the run must have lengths on both sides of L_max - B"
    assert (penalty.view(-1, 4).std(dim=1) > 0).any(), "and a group in which the penalty varies"


def test_trl_normalize_then_sum_makes_the_overlong_penalty_a_per_group_z_score(tmp_path):
    """Why overlong_buffer refuses `multi_objective_aggregation='normalize_then_sum'`: TRL 1.16 standardises every
    reward column inside its group before the weighted sum, so the penalty column becomes `(p - mean) / (std + 1e-4)`
    per group. Its size is gone: `overlong_penalty_factor` 0.1 and 1.0 train the same advantages (verl's differ), and a
    completion one token into the buffer counts as much as a wrong answer. TRL's own GRPOTrainer, our penalty as a
    plain reward."""
    runs = {}
    for factor in (0.1, 1.0):
        model, tokenizer = tiny_model()
        correctness_reward = EndsWithEos(tokenizer.eos_token_id)
        args = GRPOConfig(output_dir=str(tmp_path / f"run-{factor}"), **{**TINY_ARGS, "per_device_train_batch_size": 8},
                          max_steps=1, multi_objective_aggregation="normalize_then_sum")  # fmt: skip
        penalty = OverlongPenalty(max_completion_length=8, overlong_buffer=4, factor=factor)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[correctness_reward, penalty],
                              args=args, train_dataset=prompts_dataset(), peft_config=lora())  # fmt: skip
        trainer.train()
        penalties = torch.tensor([verl_overlong_penalty(n, 8, 4, factor) for n in correctness_reward.lengths])
        score = (torch.tensor(correctness_reward.values) + penalties).view(-1, 4)
        verl = ((score - score.mean(dim=1, keepdim=True)) / (score.std(dim=1, keepdim=True) + 1e-4)).flatten()
        runs[factor] = (correctness_reward.lengths, torch.tensor(list(trainer._logs["advantages"])), verl, penalties)
    (lengths, trl_small, verl_small, penalties), (lengths_large, trl_large, verl_large, _) = runs[0.1], runs[1.0]
    assert lengths == lengths_large, "same seed, same completions"
    assert (penalties.view(-1, 4).std(dim=1) > 0).any(), "a group in which the penalty varies"
    torch.testing.assert_close(trl_small, trl_large, atol=0.02, rtol=0.02)  # the factor is normalised away
    assert (verl_small - verl_large).abs().max() > 0.1  # verl's advantages depend on it


DROPPED_GROUP_CASES = {  # (setting applied to the trainer, whether the trained advantages are verl's)
    "group": ({}, True),
    "none": ({"scale_rewards": "none"}, True),
    "batch": ({"scale_rewards": "batch"}, False),
    "normalize_then_sum": ({"multi_objective_aggregation": "normalize_then_sum"}, False),
}


@pytest.mark.parametrize("case", sorted(DROPPED_GROUP_CASES))
def test_dynamic_sampling_keeps_verls_advantages_only_with_per_group_statistics(tmp_path, case):
    """verl's DAPO trainer filters the groups first and computes advantages on the kept batch. Dynamic sampling here
    keeps TRL's advantages of each generation round, which equals that when every statistic is per group ('group',
    'none'). With 'batch' (std over the round) or normalize_then_sum (mean and std of the summed z-scores over the
    round) the round's statistics include the groups that are dropped, and differ from round to round: a kept group's
    advantages depend on its neighbours. Those two are refused (`checks.check_reward_shaping`); here they are set on a
    built trainer to show what the refusal prevents."""
    setting, verl_like = DROPPED_GROUP_CASES[case]
    model, tokenizer = tiny_model()
    kinds = ["easy", "hard", "mixed"] * 8
    probe = BufferProbe()
    args = tiny_args(tmp_path, max_steps=1, per_device_train_batch_size=8, dynamic_sampling=True,
                     dynamic_sampling_max_rounds=8, **({} if not verl_like else setting))  # fmt: skip
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[correctness], args=args,
                           train_dataset=prompts_dataset(len(kinds), kind=kinds), peft_config=lora(),
                           callbacks=[probe])  # fmt: skip
    for name, value in setting.items():  # TRL reads these attributes at every scoring
        setattr(trainer, name, value)
    trainer.train()
    assert [e["prorl/informative_groups"] for e in trainer.prorl_log_history if "loss" in e] == [1.0]
    score = torch.tensor([0.0, 1.0, 0.0, 1.0] * 2)  # every trained group is a "mixed" one
    centred = (score.view(-1, 4) - score.view(-1, 4).mean(dim=1, keepdim=True)).flatten()
    if case == "group":
        expected = centred / (score.view(-1, 4).std(dim=1).repeat_interleave(4) + 1e-4)
    elif case == "none":
        expected = centred
    else:  # over the trained batch: its std ('batch'); the z-scores' batch standardisation (normalize_then_sum)
        z = centred / (score.view(-1, 4).std(dim=1).repeat_interleave(4) + 1e-4)
        expected = centred / (score.std() + 1e-4) if case == "batch" else (z - z.mean()) / (z.std() + 1e-4)
    trained = probe.advantages[0]  # shuffled by TRL: compare as multisets
    matches = torch.allclose(trained.sort().values, expected.sort().values, atol=1e-5)
    assert matches == verl_like, (case, trained, expected)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(overlong_buffer=4, multi_objective_aggregation="normalize_then_sum"), "overlong_penalty_factor has no"),
        (dict(phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, overlong_buffer=4)],
              multi_objective_aggregation="normalize_then_sum"), "phase 1"),  # fmt: skip
        (dict(dynamic_sampling=True, scale_rewards="batch"), "dynamic_sampling with scale_rewards='batch'"),
        (dict(dynamic_sampling=True, multi_objective_aggregation="normalize_then_sum"),
         "dynamic_sampling with multi_objective_aggregation='normalize_then_sum'"),  # fmt: skip
    ],
)
def test_dapo_shaping_with_batch_or_per_reward_normalisation_is_refused_before_loading(tmp_path, settings, message):
    """Refused in `check_before_init`: the model name below does not exist, so an accepted config would fail to load."""
    args = tiny_args(tmp_path, **settings)
    with pytest.raises(ValueError, match=message):
        ProRLTrainer(model="no-such-org/no-such-model", reward_funcs=[correctness], args=args,
                     train_dataset=prompts_dataset(kind=["easy"] * 32))  # fmt: skip
    # the same run with TRL's defaults (sum_then_normalize, group) passes the check
    defaults = {k: v for k, v in settings.items() if k not in ("scale_rewards", "multi_objective_aggregation")}
    fine = tiny_args(tmp_path, **defaults)
    check_before_init(fine, resolve_phases(fine), "no-such-org/no-such-model", None, [correctness], [])


def test_validate_refuses_a_recipe_with_overlong_buffer_and_normalize_then_sum(capsys, tmp_path):
    recipe = {
        "model": {"name_or_path": "Qwen/Qwen2-0.5B"},
        "data": {"builder": "gsm8k", "prompt_format": "plain"},
        "rewards": [{"name": "boxed_answer"}],
        "training": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
                     "max_completion_length": 64, "max_steps": 2, "overlong_buffer": 16,
                     "multi_objective_aggregation": "normalize_then_sum"},  # fmt: skip
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    code = main(["validate", str(path), "--no-machine-checks"])
    err = capsys.readouterr().err
    assert code == 2 and "normalize_then_sum" in err and "sum_then_normalize" in err and "Traceback" not in err, err


def test_uniform_groups_is_verls_nonzero_std():
    """verl's DAPO filter keeps a group when `np.std(metric_values) > 0`: any two different values. The old
    `torch.isclose` test (relative 1e-5) called [100, 100, 100, 99.9995] uniform, a group TRL gives advantages of
    0.35 and -1.08; on a 0..1 scale it dropped differences of up to 1e-5. Values that a Python reward returns
    equal are equal float32 numbers in TRL's reward table, so exact equality keeps no uniform group."""
    groups = [
        [1.0, -1.0, -1.0, -1.0], [-1.0] * 4, [1.0] * 4, [0.0, 0.0, 1.0, 0.0], [-0.25, -0.25, -0.25, -0.25],
        [1.0, 0.75, 1.0, 1.0], [100.0, 100.0, 100.0, 99.9995], [1.0, 1.0, 1.0, 1.0 - 1e-6], [0.0, 0.0, 0.0, 5e-9],
        [0.1 + 0.2, 0.3, 0.3, 0.3],  # differ as Python floats, equal once TRL stores them in float32
    ]
    got = uniform_groups(torch.tensor(groups, dtype=torch.float32).flatten(), 4).tolist()
    verl = [not np.std(np.asarray(g, dtype=np.float32)) > 0 for g in groups]
    assert got == verl == [False, True, True, False, True, False, False, False, False, True]
    large = torch.tensor(groups[6])  # TRL's group advantage of it: far from 0
    assert ((large - large.mean()) / (large.std() + 1e-4)).abs().min() > 0.3
