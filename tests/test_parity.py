"""A one-phase ProRLTrainer is GRPOTrainer: the same log history, step for step, and bit-identical final weights.

Each case trains a real `GRPOTrainer` and a one-phase `ProRLTrainer` with the same settings from the same tiny model
and seed, then compares every logged entry (training steps, evaluations, the final summary) except the `prorl/*`
keys and wall-clock timings, the returned `TrainOutput`, and every parameter of the policy (and of the reference
model when TRL keeps one) with max |delta| = 0 in fp32. Cases combine orthogonal GRPOConfig settings so the matrix
covers each of them once: epochs vs max_steps, every loss type, num_iterations, steps_per_generation /
generation_batch_size, gradient accumulation, scale_rewards, beta 0 and > 0 (LoRA and full fine-tuning),
sync_ref_model, evaluation, user optimizers, generation_kwargs, conversational prompts and weighted rewards.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers.training_args
from _prorl_helpers import TINY_ARGS, Recorder, lora, prompts_dataset, tiny_model
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2ForSequenceClassification, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from prorl_trl import HardResetCallback, PhaseConfig, ProRLConfig, ProRLTrainer, SamplingScheduleCallback
from prorl_trl.trainer.state import find_checkpoint, resume_state

# Wall-clock measurements: the only logged values allowed to differ between two identical runs.
TIMING_KEYS = {
    "step_time",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
}


def length_reward(completion_ids, **kwargs):
    return [len(ids) / 8 for ids in completion_ids]


def first_token_parity(completion_ids, **kwargs):
    return [float(ids[0] % 2) for ids in completion_ids]


def ends_with_eos(completion_ids, **kwargs):
    return [1.0 if ids and ids[-1] == 1 else 0.0 for ids in completion_ids]  # id 1 = <|im_end|> (tiny tokenizer)


def odd_rows_unscored(completion_ids, **kwargs):
    """None for every other completion: TRL skips those rows in this function's statistics."""
    return [None if index % 2 else float(len(ids)) for index, ids in enumerate(completion_ids)]


def chat_dataset(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i}+{i}?"}] for i in range(n)]})


def sgd_and_constant(model):
    """A user-built optimizer and scheduler (the issue's reproducer: lr must stay 0.05 at every step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@dataclass
class Case:
    config: dict[str, Any]
    peft: bool = False
    from_path: bool = False  # full fine-tuning with beta > 0: TRL reloads the reference from the model's path
    train_size: int = 16
    eval_size: int = 0
    iterable: bool = False
    conversational: bool = False
    reward_model: bool = False  # adds a tiny sequence-classification reward model, loaded by TRL from its path
    rewards: tuple[Callable, ...] = (length_reward, first_token_parity)
    optimizers: Callable | None = None  # model -> (optimizer, scheduler)
    setup: Callable | None = None  # trainer -> None, before train()
    # What proves the case exercised its setting, read from GRPOTrainer's log: keys every training step logs, the
    # number of training steps and evaluations, and the learning rate of each step.
    step_keys: tuple[str, ...] = ()
    num_steps: int | None = None
    num_evaluations: int = 0
    learning_rates: list[float] | None = None


def steps_of(history):
    return [entry for entry in history if "loss" in entry]


CASES = {
    "epochs+eval+grad_accum+lora": Case(
        dict(num_train_epochs=2, gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
             per_device_eval_batch_size=4),
        peft=True, train_size=4, eval_size=4,
        num_steps=4, num_evaluations=2,  # 4 prompts x 2 epochs / 2 prompts per step, an evaluation every 2 steps
    ),
    "grpo+num_iterations+steps_per_generation+scale_batch+delta": Case(
        dict(loss_type="grpo", num_iterations=2, steps_per_generation=2, max_steps=4, scale_rewards="batch", delta=1.5),
        peft=True,
    ),
    "bnpo+scale_none+mask_truncated+entropy_quantile": Case(
        dict(loss_type="bnpo", scale_rewards="none", mask_truncated_completions=True, top_entropy_quantile=0.5,
             max_steps=3),
    ),
    "dr_grpo+kl_lora+clip_higher": Case(
        dict(loss_type="dr_grpo", beta=0.05, epsilon_high=0.28, max_steps=3),
        peft=True, step_keys=("kl",),
    ),
    "cispo+kl_full_finetuning+sync_ref_model": Case(
        dict(loss_type="cispo", epsilon_high=5.0, beta=0.05, sync_ref_model=True, ref_model_sync_steps=1,
             ref_model_mixup_alpha=0.5, max_steps=3),
        from_path=True, step_keys=("kl", "cispo_clip_ratio"),
    ),
    "sapo+conversational+generation_kwargs": Case(
        # TRL's own test_train_with_generation_kwargs settings (refused by ProRLTrainer before this issue).
        dict(loss_type="sapo", generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1},
             max_steps=3),
        conversational=True,
    ),
    "luspo+three_weighted_rewards+gdpo": Case(
        dict(loss_type="luspo", importance_sampling_level="sequence", reward_weights=[2.0, 0.5, -1.0],
             multi_objective_aggregation="normalize_then_sum", max_steps=3),
        rewards=(length_reward, first_token_parity, ends_with_eos),
    ),
    "vespo+generation_batch_size+grad_accum": Case(
        dict(loss_type="vespo", generation_batch_size=8, gradient_accumulation_steps=2, max_steps=2),
        peft=True,
    ),
    "dapo+user_optimizer_and_scheduler": Case(
        dict(max_steps=3),
        optimizers=sgd_and_constant,
        learning_rates=[0.05] * 3,
    ),
    "dapo+entropy_bonus+off_policy_mask+logging_every_2": Case(
        dict(use_adaptive_entropy=True, off_policy_mask_threshold=0.5, num_iterations=2, logging_steps=2, max_steps=4),
        peft=True, step_keys=("entropy_coef", "policy_loss"), num_steps=2,  # 4 steps, logged every 2
    ),
    "dapo+iterable_dataset+no_shuffle": Case(dict(shuffle_dataset=False, max_steps=3), iterable=True),
    "grpo+reward_model+unscored_rows": Case(
        dict(loss_type="grpo", max_steps=3), reward_model=True, rewards=(odd_rows_unscored,), peft=True,
        step_keys=("rewards/tiny-reward/mean", "rewards/odd_rows_unscored/mean"),
    ),
    "dapo+optimizer_cls_and_kwargs+cosine_warmup+weighted": Case(
        dict(max_steps=3, lr_scheduler_type="cosine", warmup_steps=1, reward_weights=[0.5, 3.0]),
        peft=True,
        setup=lambda trainer: setattr(trainer, "optimizer_cls_and_kwargs", (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})),
    ),
}


def comparable(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries without `prorl/*` keys and wall times; ProRL's phase-start entry (only `prorl/*`, `step` and
    `epoch`) has no GRPOTrainer counterpart and is left out."""
    kept = [{k: v for k, v in entry.items() if not k.startswith("prorl/") and k not in TIMING_KEYS} for entry in history]
    return [entry for entry in kept if set(entry) - {"step", "epoch"}]


def same_value(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def assert_same_history(grpo: list[dict[str, Any]], prorl: list[dict[str, Any]]) -> None:
    assert len(grpo) == len(prorl), (len(grpo), len(prorl))
    for index, (want, got) in enumerate(zip(grpo, prorl)):
        assert want.keys() == got.keys(), (index, want.keys() ^ got.keys())
        differing = {k: (want[k], got[k]) for k in want if not same_value(want[k], got[k])}
        assert not differing, f"log entry {index} differs: {differing}"


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def parameters(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny Qwen2ForSequenceClassification (one label) and its tokenizer, saved like a hub reward model."""
    from prorl_trl.tiny import build_tiny_tokenizer, tiny_config

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(1)
    config = tiny_config(tokenizer)
    config.num_labels = 1
    model = Qwen2ForSequenceClassification(config)
    path = tmp_path_factory.mktemp("reward") / "tiny-reward"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_once(trainer_cls, config_cls, case: Case, out_dir, tiny_dir, reward_model_dir):
    if case.from_path:
        model, tokenizer = str(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    else:
        model, tokenizer = tiny_model()
    args = config_cls(output_dir=str(out_dir), **{**TINY_ARGS, **case.config})
    dataset = chat_dataset if case.conversational else prompts_dataset
    train_dataset = dataset(case.train_size).to_iterable_dataset() if case.iterable else dataset(case.train_size)
    trainer = trainer_cls(
        model=model,
        processing_class=tokenizer,
        reward_funcs=list(case.rewards) + ([str(reward_model_dir)] if case.reward_model else []),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=dataset(case.eval_size) if case.eval_size else None,
        peft_config=lora() if case.peft else None,
        optimizers=case.optimizers(model) if case.optimizers else (None, None),
    )
    if case.setup:
        case.setup(trainer)
    initial = parameters(trainer.model)
    output = trainer.train()
    ref = parameters(trainer.ref_model) if trainer.ref_model is not None else None
    return trainer, output, initial, ref


@pytest.mark.parametrize("name", list(CASES))
def test_one_phase_prorl_trainer_is_grpo_trainer(name, tmp_path, tiny_dir, reward_model_dir):
    case = CASES[name]
    runs = [
        train_once(trainer, config, case, tmp_path / config.__name__, tiny_dir, reward_model_dir)
        for trainer, config in ((GRPOTrainer, GRPOConfig), (ProRLTrainer, ProRLConfig))
    ]
    (grpo, grpo_output, initial, grpo_ref), (prorl, prorl_output, _, prorl_ref) = runs

    grpo_history = comparable(grpo.state.log_history)
    assert len(steps_of(grpo_history)) >= 2
    steps = steps_of(grpo_history)
    assert all(key in entry for entry in steps for key in case.step_keys), (case.step_keys, steps[0].keys())
    assert case.num_steps is None or len(steps) == case.num_steps
    assert sum("eval_loss" in entry for entry in grpo_history) == case.num_evaluations
    assert case.learning_rates is None or [entry["learning_rate"] for entry in steps] == case.learning_rates
    assert_same_history(grpo_history, comparable(prorl.state.log_history))
    assert_same_history(grpo_history, comparable(prorl.prorl_log_history))
    assert (prorl_output.global_step, prorl_output.training_loss) == (grpo_output.global_step, grpo_output.training_loss)

    grpo_weights = parameters(grpo.model)
    assert max_abs_diff(grpo_weights, initial) > 0, "training must move the weights, or the comparison proves nothing"
    assert max_abs_diff(grpo_weights, parameters(prorl.model)) == 0.0
    if grpo_ref is not None:
        assert max_abs_diff(grpo_ref, prorl_ref) == 0.0
        if case.config.get("sync_ref_model"):  # the reference (loaded from the policy's path) was really synced
            assert max_abs_diff(grpo_ref, initial) > 0
    # `prorl/*` values are numbers (the phase name is on the console and in the phase table, not in the logs).
    prorl_values = [v for entry in prorl.prorl_log_history for k, v in entry.items() if k.startswith("prorl/")]
    assert prorl_values and all(type(v) in (int, float) for v in prorl_values)


# ------------------------------------------------------------------------------------------- the same call works
def test_signature_is_grpo_trainers():
    # Positional arguments after `args`, defaults and keyword names: a class swap is the only change a script needs.
    def described(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert described(ProRLTrainer) == described(GRPOTrainer)


def test_positional_arguments_and_a_default_config(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default config writes to ./<model name>-<trainer>
    # TRL's default config is bf16, which TrainingArguments refuses on a machine without a bf16 GPU: only that
    # hardware probe is patched, so both trainers build their default configs here (nothing is trained).
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    grpo = GRPOTrainer(str(tiny_dir), [length_reward], None, prompts_dataset(8))
    prorl = ProRLTrainer(str(tiny_dir), [length_reward], None, prompts_dataset(8))
    assert (grpo.args.output_dir, prorl.args.output_dir) == ("model-GRPO", "model-ProRL")
    assert isinstance(prorl.args, ProRLConfig) and len(prorl.train_dataset) == 8
    differing = [f.name for f in dataclasses.fields(GRPOConfig) if getattr(grpo.args, f.name) != getattr(prorl.args, f.name)]
    assert differing == ["output_dir"], "every other GRPOConfig default is GRPOTrainer's"


# --------------------------------------------------------------------------------- continuing a GRPOTrainer run
def grpo_args(out_dir, **overrides):
    return GRPOConfig(output_dir=str(out_dir), **{**TINY_ARGS, "max_steps": 4, **overrides})


def test_resume_from_a_grpo_checkpoint_is_grpo_resume(tmp_path):
    """A plain GRPOTrainer checkpoint resumes as phase 0 with no resets: the same steps as GRPOTrainer's resume."""
    model, tokenizer = tiny_model()
    common = dict(processing_class=tokenizer, reward_funcs=[length_reward, first_token_parity],
                  train_dataset=prompts_dataset(16), peft_config=lora())
    GRPOTrainer(model=model, args=grpo_args(tmp_path / "grpo", save_strategy="steps", save_steps=2), **common).train()
    checkpoint = tmp_path / "grpo" / "checkpoint-2"
    assert not (checkpoint / "prorl_state.json").exists()

    model, tokenizer = tiny_model()
    grpo = GRPOTrainer(model=model, args=grpo_args(tmp_path / "a"), **{**common, "processing_class": tokenizer})
    grpo.train(resume_from_checkpoint=str(checkpoint))
    model, tokenizer = tiny_model()
    args = ProRLConfig(output_dir=str(tmp_path / "b"), **{**TINY_ARGS, "max_steps": 4})
    prorl = ProRLTrainer(model=model, args=args, **{**common, "processing_class": tokenizer})
    prorl.train(resume_from_checkpoint=str(checkpoint))

    history = comparable(grpo.state.log_history)
    assert [e["step"] for e in steps_of(history)] == [1, 2, 3, 4], "the checkpoint's steps 1-2 and the resumed 3-4"
    assert_same_history(history, comparable(prorl.state.log_history))
    assert [e["prorl/global_step"] for e in steps_of(prorl.prorl_log_history)] == [1, 2, 3, 4]
    assert {(e["prorl/phase"], e["prorl/resets"]) for e in prorl.prorl_log_history} == {(0, 0)}
    assert max_abs_diff(parameters(grpo.model), parameters(prorl.model)) == 0.0

    # `resume_from_checkpoint=True` finds the newest TRL checkpoint when the folder holds no ProRL one.
    assert find_checkpoint(tmp_path / "grpo") == tmp_path / "grpo" / "checkpoint-4"
    # A folder inside a ProRL phase without prorl_state.json is a ProRL save cut short, never a TRL checkpoint.
    cut_short = tmp_path / "b" / "phase-0" / "checkpoint-9"
    shutil.copytree(checkpoint, cut_short)
    with pytest.raises(FileNotFoundError, match="prorl_state.json"):
        resume_state(cut_short, prorl.phases[0])
    # A checkpoint past phase 0's plan is refused: HF would skip phase 0 and start phase 1 from a longer run.
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=2)]
    model, tokenizer = tiny_model()
    prorl = ProRLTrainer(model=model, args=ProRLConfig(output_dir=str(tmp_path / "c"), **TINY_ARGS, phases=phases),
                         **{**common, "processing_class": tokenizer})
    with pytest.raises(ValueError, match="TRL checkpoint at step 2, past phase 0"):
        prorl.train(resume_from_checkpoint=str(checkpoint))


# ---------------------------------------------------------------------------------------------- generation_kwargs
def test_generation_kwargs_key_that_a_schedule_changes_is_refused(tmp_path):
    # Declared keys (`linear` declares its own) fail at init, before any model is loaded.
    args = ProRLConfig(output_dir=str(tmp_path), **TINY_ARGS, max_steps=2, generation_kwargs={"temperature": 0.5})
    ramp = SamplingScheduleCallback.linear("temperature", start=1.0, end=1.2, num_steps=2)
    with pytest.raises(ValueError, match=r"generation_kwargs sets \['temperature'\], which a SamplingScheduleCallback"):
        ProRLTrainer(model="no/such-model", reward_funcs=[length_reward], args=args, callbacks=[ramp])

    # The overlong penalty measures lengths against max_completion_length: a cap set in generation_kwargs is refused.
    capped = ProRLConfig(output_dir=str(tmp_path), **TINY_ARGS, max_steps=2, overlong_buffer=2,
                         generation_kwargs={"max_new_tokens": 6})
    with pytest.raises(ValueError, match="overlong penalty measures lengths against max_completion_length"):
        ProRLTrainer(model="no/such-model", reward_funcs=[length_reward], args=capped)

    # Undeclared keys fail when the schedule first changes them: at the first step, before anything is generated.
    model, tokenizer = tiny_model()
    recorder = Recorder()
    schedule = SamplingScheduleCallback(lambda step: {"temperature": 1.1})
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[recorder], args=args,
                           train_dataset=prompts_dataset(8), callbacks=[schedule])
    with pytest.raises(ValueError, match=r"Cannot change \['temperature'\] to \[1.1\]: `generation_kwargs` sets"):
        trainer.train()
    assert recorder.calls == [] and trainer.generation_config.temperature == 0.5

    # A schedule of another key runs next to generation_kwargs, and TRL keeps the generation_kwargs value.
    model, tokenizer = tiny_model()
    recorder = Recorder()
    args = ProRLConfig(output_dir=str(tmp_path), **TINY_ARGS, max_steps=2, generation_kwargs={"top_k": 5})
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[recorder], args=args,
                           train_dataset=prompts_dataset(8), callbacks=[ramp])
    recorder.trainer = trainer
    trainer.train()
    assert [call["temperature"] for call in recorder.calls] == [1.0, 1.1]
    assert trainer.generation_config.top_k == 5


# ----------------------------------------------------------------------------------------------------- optimizers
def user_optimizer(lr: float = 0.05):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize(
    "settings, optimizers, message",
    [
        (dict(phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)]), lambda: (user_optimizer(), None),
         "this run has 2 phases"),
        (dict(max_steps=2), lambda: (user_optimizer(), None), None),  # one phase, no reset: accepted
        (dict(max_steps=2, phases=[PhaseConfig(lora_r=8)]), lambda: (user_optimizer(), None), "another adapter shape"),
        (dict(max_steps=2, callbacks=True), lambda: (None, torch.optim.lr_scheduler.LambdaLR(user_optimizer(), lambda s: 1)),
         "a scheduler object cannot be rebuilt"),
        (dict(max_steps=2, callbacks=True, reset_optimizer=False),
         lambda: (None, torch.optim.lr_scheduler.LambdaLR(user_optimizer(), lambda s: 1)), None),
    ],
    ids=["multi_phase", "single_phase", "first_phase_reshape", "scheduler_with_reset", "scheduler_without_optimizer_reset"],
)
def test_user_built_optimizers_are_refused_where_they_would_be_rebuilt(tmp_path, settings, optimizers, message):
    settings = dict(settings)
    callbacks = [HardResetCallback(every_steps=1)] if settings.pop("callbacks", False) else None
    args = ProRLConfig(output_dir=str(tmp_path), **{**TINY_ARGS, **settings})
    call = dict(model="no/such-model", reward_funcs=[length_reward], args=args, callbacks=callbacks,
                optimizers=optimizers(), peft_config=lora())
    if message is None:  # the checks pass: only the (missing) model stops it
        with pytest.raises(OSError):
            ProRLTrainer(**call)
    else:
        with pytest.raises(ValueError, match=message):
            ProRLTrainer(**call)


def test_an_optimizer_hook_lr_is_refused_with_several_phases(tmp_path):
    model, tokenizer = tiny_model()
    args = ProRLConfig(output_dir=str(tmp_path), **TINY_ARGS, phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1)])
    recorder = Recorder()
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[recorder], args=args,
                           train_dataset=prompts_dataset(8), peft_config=lora())
    trainer.optimizer_cls_and_kwargs = (torch.optim.SGD, {"lr": 0.05})
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs sets lr=0.05, but this run has 2 phases"):
        trainer.train()
    assert recorder.calls == []


class OptimizerProbe(TrainerCallback):
    """Runs after HardResetCallback: the optimizer the HF loop will step next, right after each step's reset check."""

    def __init__(self):
        self.trainer, self.records = None, []

    def bind(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        optimizer = self.trainer.optimizer.optimizer  # accelerate's wrapper -> the user's object
        self.records.append(dict(optimizer=optimizer, buffers=len(optimizer.state), lr=optimizer.param_groups[0]["lr"]))
        return control


def test_a_reset_keeps_a_user_optimizer_and_clears_its_state(tmp_path):
    model, tokenizer = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    probe = OptimizerProbe()
    args = ProRLConfig(output_dir=str(tmp_path), **TINY_ARGS, max_steps=3, save_merged_on_reset=False)
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[length_reward, first_token_parity],
                           args=args, train_dataset=prompts_dataset(16), optimizers=(optimizer, None),
                           callbacks=[HardResetCallback(every_steps=2), probe])
    trainer.train()
    assert all(record["optimizer"] is optimizer for record in probe.records), "the user's object, never a default"
    assert optimizer.defaults["momentum"] == 0.9
    assert [record["buffers"] > 0 for record in probe.records] == [True, False, True], "momentum cleared at step 2"
    assert probe.records[1]["lr"] == pytest.approx(0.05), "a fresh schedule restarts from the optimizer's lr"
    assert [e["prorl/resets"] for e in steps_of(trainer.prorl_log_history)] == [0, 1, 1]

    # A scheduler object cannot be rebuilt: a manual reset that would restart it is refused before it changes anything.
    model, tokenizer = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = ProRLTrainer(model=model, processing_class=tokenizer, reward_funcs=[length_reward], args=args,
                           train_dataset=prompts_dataset(16), optimizers=sgd_and_constant(model))
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        trainer.hard_reset()
    assert trainer.prorl_resets == 0
