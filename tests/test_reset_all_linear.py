"""A phase that keeps the adapter (`hard_reset: false`, same LoRA settings) must not be hard-reset.

Regression test: with `LoraConfig(target_modules="all-linear")` PEFT rewrites the config's `target_modules` into the
set of full module names (in the caller's object too), so comparing configs saw a "LoRA shape change" and forced a
reset at every phase boundary. The trainer now decides with `prorl_trl.reset.adapter_needs_rebuild` (wrapped modules).
"""

from datasets import Dataset
from peft import LoraConfig

from prorl_trl.config import ProRLConfig
from prorl_trl.reset import adapter_needs_rebuild
from prorl_trl.tiny import build_tiny
from prorl_trl.trainer import ProRLTrainer


def constant_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) for ids in completion_ids]


def test_all_linear_phase_without_reset_keeps_the_adapter(tmp_path):
    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
        logging_steps=1, save_strategy="no", report_to=[], bf16=False, use_cpu=True, gradient_checkpointing=False,
        disable_tqdm=True, save_merged_on_reset=False,
        phases=[{"max_steps": 1}, {"max_steps": 1, "hard_reset": False}],
    )  # fmt: skip
    trainer = ProRLTrainer(
        model=model,
        reward_funcs=constant_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1 + 1 ="] * 8}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    assert not adapter_needs_rebuild(trainer.model, r=4, target_modules="all-linear")  # what the decision should be
    trainer.train()
    assert trainer.prorl_resets == 0
