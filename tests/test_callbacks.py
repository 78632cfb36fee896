"""Plateau rule (phase end and reset trigger) and the sampling schedule callback, on real tiny runs."""

import pytest
from _prorl_helpers import Recorder, lora, prompts_dataset, tiny_args, tiny_model
from transformers import TrainerCallback

from prorl_trl import HardResetCallback, PhaseConfig, ProRLTrainer, SamplingScheduleCallback
from prorl_trl.trainer.callbacks import PlateauTracker


def constant(completions, **kwargs):
    return [0.5] * len(completions)


def test_plateau_tracker_modes_and_min_delta():
    tracker = PlateauTracker(patience=2, min_delta=0.1)
    assert [tracker.update(v) for v in (0.5, 0.55, 0.65, 0.7, 0.74)] == [False, False, False, False, True]
    tracker = PlateauTracker(patience=1, mode="min")
    assert [tracker.update(v) for v in (1.0, 0.5, 0.6)] == [False, False, True]
    tracker.restart_patience()
    assert tracker.best == 0.5 and tracker.bad_evaluations == 0
    assert PlateauTracker(patience=1).update(float("nan")) is False


def test_one_more_problem_solved_is_an_improvement_of_its_size_at_every_level():
    """A gain of exactly `min_delta` counts, up to float rounding: (k + 1)/100 - k/100 is 0.00999... for 20 of the
    99 levels, and a strict comparison let those gains run a plateau down."""
    for k in range(99):
        tracker = PlateauTracker(patience=1, min_delta=0.01)
        assert [tracker.update(k / 100), tracker.update((k + 1) / 100)] == [False, False], k
        assert tracker.best == (k + 1) / 100
    tracker = PlateauTracker(patience=1, min_delta=0.01)
    assert [tracker.update(v) for v in (0.5, 0.505)] == [False, True]  # half the step is no gain
    equal = PlateauTracker(patience=1)  # min_delta 0: an equal value is no gain
    assert [equal.update(v) for v in (0.5, 0.5)] == [False, True]


def test_a_nan_of_any_scalar_type_is_skipped_not_made_the_best():
    import numpy as np
    import torch

    for nan in (np.float32("nan"), torch.tensor(float("nan"))):
        tracker = PlateauTracker(patience=2)
        assert [tracker.update(v) for v in (nan, 0.5, 0.6, 0.7)] == [False, False, False, False]
        assert tracker.best == pytest.approx(0.7)


def build(tmp_path, reward_funcs, callbacks=None, **overrides):
    model, tokenizer = tiny_model()
    return ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=reward_funcs, args=tiny_args(tmp_path, **overrides),
        train_dataset=prompts_dataset(), eval_dataset=prompts_dataset(2), peft_config=lora(), callbacks=callbacks,
    )


def test_constant_reward_ends_a_plateau_phase_early(tmp_path):
    trainer = build(
        tmp_path, [constant], eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8,
        phases=[PhaseConfig(max_steps=8, plateau_patience=2), PhaseConfig(max_steps=1)],
    )
    trainer.train()
    history = trainer.prorl_log_history
    evals = [e for e in history if "eval_reward" in e and e["prorl/phase"] == 0]
    assert [e["eval_reward"] for e in evals] == [0.5, 0.5, 0.5]  # TRL's evaluate() logs eval_reward
    phase0_steps = [e["prorl/global_step"] for e in history if "loss" in e and e["prorl/phase"] == 0]
    assert phase0_steps == [1, 2, 3], "best at eval 1, then 2 evaluations without improvement"
    assert [e["prorl/global_step"] for e in history if "loss" in e and e["prorl/phase"] == 1] == [4]
    assert trainer.prorl_resets == 1


class ConstantValidation(TrainerCallback):
    """Stands in for the ValidationCallback: logs a validation metric through the bound trainer every step."""

    def __init__(self):
        self.trainer = None

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        should_log = control.should_log  # on_log clears it; keep this step's training log (as ValidationCallback)
        self.trainer.log({"eval_pass@1": 0.25})
        control.should_log = should_log
        return control


def test_hard_reset_on_plateau_of_a_callback_metric(tmp_path):
    trainer = build(
        tmp_path, [constant], callbacks=[ConstantValidation(), HardResetCallback(on_plateau=2)], max_steps=6,
        plateau_metric="eval_pass@1", save_merged_on_reset=False,
    )
    trainer.train()
    steps = [e for e in trainer.prorl_log_history if "loss" in e]
    # evals at steps 1..6: best at 1, plateau after 3 -> reset at the start of 4; patience restarts -> again after 5.
    assert [e["prorl/resets"] for e in steps] == [0, 0, 0, 1, 1, 2]
    assert trainer.prorl_resets == 2


def test_every_hard_reset_gives_the_plateau_trigger_its_patience_again(tmp_path):
    """The phase boundary's reset (as every reset) restarts the callback's patience: the evaluations without a gain
    counted before it no longer bring a second reset one evaluation after it."""
    trainer = build(
        tmp_path, [constant], callbacks=[ConstantValidation(), HardResetCallback(on_plateau=2)],
        plateau_metric="eval_pass@1", save_merged_on_reset=False,
        phases=[PhaseConfig(max_steps=2), PhaseConfig(max_steps=3)],
    )  # fmt: skip
    trainer.train()
    steps = [e for e in trainer.prorl_log_history if "loss" in e]
    # evals after steps 1-5: best at 1, one without a gain at 2, the boundary's reset; then 3 and 4 without a gain
    # (a plateau after 4: its reset at the start of 5)
    assert [e["prorl/resets"] for e in steps] == [0, 0, 1, 1, 2]


def test_a_schedule_changes_sampling_only_where_a_generation_starts(tmp_path):
    """With one generation for 2 optimizer steps, the second step trains on completions sampled at the first one's
    temperature; the loss must use that temperature too (else its log-probs disagree with the old ones)."""
    recorder = Recorder()
    losses = []

    class LossTemperature(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            losses.append(trainer.temperature)

    ramp = SamplingScheduleCallback(lambda step: {"temperature": 1.0 + 0.5 * step})
    trainer = build(tmp_path, [recorder], callbacks=[ramp, LossTemperature()], max_steps=4, steps_per_generation=2)
    recorder.trainer = trainer
    trainer.train()
    assert [c["temperature"] for c in recorder.calls] == [1.0, 2.0]  # generations at steps 0 and 2
    assert losses == [1.0, 1.0, 2.0, 2.0]
    assert all(c["logp_error"] < 1e-5 for c in recorder.calls)


def test_hard_reset_callback_needs_a_trigger_and_patience(tmp_path):
    with pytest.raises(ValueError, match="every_steps"):
        HardResetCallback()
    with pytest.raises(ValueError, match="plateau_patience"):
        build(tmp_path, [constant], callbacks=[HardResetCallback(on_plateau=True)], max_steps=1)


def test_temperature_ramp_reaches_generation_and_loss(tmp_path):
    recorder = Recorder()
    ramp = SamplingScheduleCallback.linear("temperature", start=1.0, end=0.5, num_steps=2)
    cap = SamplingScheduleCallback(lambda step: {"max_completion_length": 8 - 2 * step})
    trainer = build(tmp_path, [recorder], callbacks=[ramp, cap], max_steps=3, overlong_buffer=2)
    recorder.trainer = trainer
    trainer.train()
    assert [c["temperature"] for c in recorder.calls] == pytest.approx([1.0, 0.75, 0.5])
    assert [c["max_new_tokens"] for c in recorder.calls] == [8, 6, 4]
    assert all(max(c["lengths"]) <= c["max_new_tokens"] for c in recorder.calls)
    assert all(c["logp_error"] < 1e-5 for c in recorder.calls), "the loss uses the scheduled temperature"
    assert trainer.overlong_penalty.max_completion_length == 4
    with pytest.raises(ValueError, match="Unknown sampling settings"):
        trainer.apply_sampling(temprature=1.0)
    with pytest.raises(ValueError, match="the overlong buffer is 2 tokens"):  # every completion would be penalised
        trainer.apply_sampling(max_completion_length=2, temperature=0.9)
    assert (trainer.max_completion_length, trainer.temperature) == (4, 0.5)  # refused before anything changed


def test_validation_callback_plateau_ends_the_phase(tmp_path):
    from prorl_trl import ValidationCallback

    validation = ValidationCallback(prompts_dataset(2), reward_func=constant, eval_steps=1, num_generations=2, max_completion_length=4)
    trainer = build(
        tmp_path, [constant], callbacks=[validation], plateau_metric="eval_pass@1",
        phases=[PhaseConfig(max_steps=6, plateau_patience=1), PhaseConfig(max_steps=1)],
    )
    trainer.train()
    assert validation.trainer is trainer, "ProRLTrainer binds callbacks that have bind()"
    history = trainer.prorl_log_history
    assert [e["prorl/global_step"] for e in history if "loss" in e] == [1, 2, 3], "phase 0 stops after 2 evaluations"
    assert any("eval_pass@1" in e for e in history)
