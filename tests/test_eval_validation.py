"""ValidationCallback inside a real trl.GRPOTrainer (tiny Qwen2 + LoRA): metrics reach log_history and on_log,
TRL's own training metrics survive, the training RNG and train mode are untouched. Also guards the TRL private
attributes the callback relies on (`_metrics`, `log_completions`, `GRPOTrainer.log` clearing its buffers)."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from prorl_trl.evaluation.validation import ValidationCallback
from prorl_trl.tiny import build_tiny


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Small models run fastest single-threaded on the shared 2-core CI machine; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _dataset(size=8):
    pairs = [(a, a + 1) for a in range(size)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in pairs],
        "answer": [str(a + b) for a, b in pairs],
    })


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs, self.training_at_step_end = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.training_at_step_end.append(model.training)


def _trainer(tmp_path, max_steps=2):
    model, tokenizer = build_tiny(seed=0)
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=max_steps, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        learning_rate=1e-3, seed=0, disable_tqdm=True,
    )
    return GRPOTrainer(
        model=model, reward_funcs=_reward(), args=args,
        train_dataset=_dataset(), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )


def _reward():
    from rewards import get_reward

    return get_reward("boxed_answer")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("grpo"))
    validation = ValidationCallback(
        _dataset(), "boxed_answer", eval_steps=1, num_problems=3, num_generations=2, ks=(2,),
        max_completion_length=6, at_start=True, trainer=trainer,
    )
    recorder = Recorder()
    trainer.add_callback(validation)
    trainer.add_callback(recorder)  # after the validation callback: it must still see the eval entries
    trainer.train()
    return trainer, validation, recorder


def test_metrics_land_in_log_history_and_reach_on_log(trained):
    trainer, validation, recorder = trained
    evals = [e for e in trainer.state.log_history if "eval_pass@1" in e]
    assert [e["step"] for e in evals] == [0, 1, 2]  # at start, then every step
    for entry in evals:
        assert set(entry) >= {"eval_pass@1", "eval_pass@2", "eval_reward", "eval_mean_length"}
        assert 0.0 <= entry["eval_pass@1"] <= entry["eval_pass@2"] <= 1.0
        assert -1.0 <= entry["eval_reward"] <= 1.0  # boxed_answer: +1 / -1
        assert 0 < entry["eval_mean_length"] <= 6
    assert sum("eval_pass@1" in logs for logs in recorder.logs) == 3
    assert validation.last_metrics == {k: v for k, v in evals[-1].items() if k.startswith("eval_")}


def test_per_problem_correct_counts_are_the_ones_behind_the_logged_pass_at_k(trained):
    _, validation, _ = trained
    correct, metrics = validation.last_correct, validation.last_metrics
    assert len(correct) == 3 and all(0 <= c <= 2 for c in correct)  # 3 problems x 2 samples
    assert metrics["eval_pass@1"] == pytest.approx(sum(c / 2 for c in correct) / 3)
    assert metrics["eval_pass@2"] == pytest.approx(sum(c > 0 for c in correct) / 3)


def test_trl_training_metrics_are_not_disturbed(trained):
    trainer, _, recorder = trained
    train_entries = [e for e in trainer.state.log_history if "loss" in e]
    assert len(train_entries) == 2
    for entry in train_entries:
        assert "reward" in entry and "completions/mean_length" in entry and "rewards/boxed_answer/mean" in entry
        assert not any(key.startswith("eval_") for key in entry)
    assert recorder.training_at_step_end == [True, True]  # train mode restored after each validation


def test_validation_leaves_the_training_rng_alone_and_is_seeded(trained):
    _, validation, _ = trained
    state = torch.get_rng_state()
    first = validation.evaluate()
    assert torch.equal(state, torch.get_rng_state())
    assert validation.evaluate() == first


def test_guard_grpo_log_clears_its_metric_buffers(tmp_path):
    """Why the callback swaps `_metrics`: trl 1.16's GRPOTrainer.log averages then clears the current mode's buffer."""
    trainer = _trainer(tmp_path, max_steps=1)
    assert set(trainer._metrics) == {"train", "eval"}
    assert isinstance(trainer.log_completions, bool)
    trainer.model.train()
    trainer._metrics["train"]["sentinel"].append(3.0)
    trainer.log({})
    assert trainer.state.log_history[-1]["sentinel"] == 3.0
    assert "sentinel" not in trainer._metrics["train"]

    trainer._metrics["train"]["sentinel"].append(5.0)
    validation = ValidationCallback(_dataset(2), _reward(), num_generations=1, max_completion_length=2, trainer=trainer)
    validation._validate_and_log()
    entry = trainer.state.log_history[-1]
    assert "eval_pass@1" in entry and "sentinel" not in entry and "eval_sentinel" not in entry
    assert trainer._metrics["train"]["sentinel"] == [5.0]  # still there for TRL's next training log
    assert trainer.model.training


def test_unbound_callback_and_bad_settings_fail_clearly():
    validation = ValidationCallback(_dataset(2), _reward(), num_generations=2, max_completion_length=4)
    with pytest.raises(RuntimeError, match="bind"):
        validation.evaluate()
    with pytest.raises(ValueError, match="num_generations"):
        ValidationCallback(_dataset(2), _reward(), num_generations=2, ks=(4,))
    with pytest.raises(ValueError, match="prompt"):
        ValidationCallback([{"question": "x"}], _reward())
    with pytest.raises(ValueError, match="Unknown reward"):
        ValidationCallback(_dataset(2), "no_such_reward")


def test_validation_prompts_use_the_trainers_chat_template_kwargs_like_trl(tmp_path):
    """`GRPOConfig.chat_template_kwargs` (e.g. enable_thinking=False) reach TRL's training prompts; validation
    rendered without them, so it sampled other prompts than training."""
    from prorl_trl.tiny import CHAT_TEMPLATE

    model, tokenizer = build_tiny(seed=0)
    tokenizer.chat_template = CHAT_TEMPLATE + (
        "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    )
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=_reward(), args=args, train_dataset=_dataset(), processing_class=tokenizer
    )
    validation = ValidationCallback(_dataset(3), "boxed_answer", num_generations=2, trainer=trainer)
    prompts = [row["prompt"] for row in validation.rows]
    ids = validation.prompt_ids(prompts)
    training_ids, _, _ = trainer._tokenize_prompts(prompts)  # what TRL 1.16 feeds generation in training
    assert ids == [list(row) for row in training_ids]
    rendered = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, return_dict=True, enable_thinking=False)
        for p in prompts
    ]
    assert ids == [row["input_ids"] for row in rendered]
    assert all(tokenizer.decode(row).endswith("<think>\n\n</think>\n\n") for row in ids)


def test_prorl_trainer_binds_it_and_its_plateau_rule_sees_the_metric(tmp_path):
    """ProRLTrainer binds callbacks that have `bind`; eval entries carry `prorl/*` keys and drive the plateau rule."""
    from prorl_trl import ProRLConfig, ProRLTrainer

    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=6, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        learning_rate=1e-3, seed=0, disable_tqdm=True, plateau_metric="eval_pass@1", plateau_patience=1,
        save_merged_on_reset=False,
    )
    validation = ValidationCallback(_dataset(), "boxed_answer", eval_steps=1, num_problems=2, num_generations=2,
                                    max_completion_length=4, at_start=True)
    trainer = ProRLTrainer(
        model=model, reward_funcs=[_reward()], args=args, train_dataset=_dataset(), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        callbacks=[validation],
    )
    assert validation.trainer is trainer
    trainer.train()
    evals = [e for e in trainer.prorl_log_history if "eval_pass@1" in e]
    assert evals and all("prorl/global_step" in e for e in evals)
    assert trainer.prorl_global_step < 6  # a tiny random model never improves: the plateau rule ends the phase
