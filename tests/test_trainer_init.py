"""ProRLTrainer fails at construction, before any generation, when a registry reward's gold column is missing."""

import pytest
from datasets import Dataset

import rewards
from prorl_trl import ProRLConfig, ProRLTrainer
from prorl_trl.tiny import build_tiny


def make_trainer(tmp_path, dataset, reward_funcs):
    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, max_steps=1, save_strategy="no",
    )
    return ProRLTrainer(model=model, processing_class=tokenizer, args=args, reward_funcs=reward_funcs,
                        train_dataset=dataset)


def test_missing_gold_column_is_refused_at_init(tmp_path):
    dataset = Dataset.from_list([{"prompt": "1+1=", "solution": "2"}] * 8)
    with pytest.raises(rewards.MissingColumnError) as error:
        make_trainer(tmp_path, dataset, [rewards.get_reward("boxed_answer")])
    assert "boxed_answer" in str(error.value) and "answer" in str(error.value)
    # the same reward pointed at the column the data has is accepted
    trainer = make_trainer(tmp_path, dataset, [rewards.get_reward("boxed_answer", answer_key="solution")])
    assert trainer.reward_func_names[0].startswith("boxed_answer")
