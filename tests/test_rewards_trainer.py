"""Registry rewards inside real TRL: a `GRPOTrainer` run with weighted rewards, and `trl grpo`'s own script resolving
`--reward_funcs rewards.<name>` dotted paths (trl.scripts.grpo.main, the code behind the CLI)."""

from __future__ import annotations

import json
import math

import pytest
from datasets import Dataset

from rewards import get_reward

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
PROMPTS = ["What is 2 + 3?", "What is 7 - 4?", "Compute 6 * 2.", "Halve 18."]
ANSWERS = ["#### 5", "#### 3", "#### 12", "#### 9"]


def tiny_grpo_args(output_dir, **overrides):
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def test_grpo_trainer_logs_each_registry_reward_with_weights(tiny, tmp_path):
    from trl import GRPOTrainer

    model, tokenizer = tiny
    reward_funcs = [
        get_reward("math_equivalence"),
        get_reward("boxed_answer", correct=5.0, incorrect=-5.0),  # RLinf variant: its own metric name
        get_reward("soft_overlong", max_completion_len=8, soft_punish_cache=4),
    ]
    weights = [1.0, 0.5, 0.2]
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward_funcs,
        args=tiny_grpo_args(tmp_path, reward_weights=weights),
        # conversational prompts: TRL hands the rewards message-list completions (the plain format is run below)
        train_dataset=Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 2], "answer": ANSWERS * 2}
        ),
    )
    trainer.train()
    step_logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(step_logs) == 2
    names = [f.__name__ for f in reward_funcs]
    assert names == [
        "math_equivalence",
        "boxed_answer_correct5_incorrect-5",
        "soft_overlong_max_completion_len8_soft_punish_cache4",
    ]
    for entry in step_logs:
        means = [entry[f"rewards/{name}/mean"] for name in names]
        assert all(math.isfinite(mean) for mean in means)
        assert 0.0 <= means[0] <= 1.0 and -5.0 <= means[1] <= 5.0 and -1.0 <= means[2] <= 0.0
        # TRL's total reward is the weighted sum of the per-function rewards, so its mean is the weighted sum of means
        assert entry["reward"] == pytest.approx(sum(w * m for w, m in zip(weights, means)), abs=1e-5)
        # math_equivalence reports its symbolic timeouts through TRL's log_metric hook, 0 when none happened
        assert entry["rewards/math_equivalence/timeouts"] == 0.0


def test_trl_grpo_script_resolves_dotted_reward_paths(tiny_dir, tmp_path, monkeypatch):
    """`trl grpo --reward_funcs rewards.boxed_answer rewards.tag_count rewards.soft_overlong`: the command line is
    parsed by TRL's own `make_parser()` and run through its `main` (importlib on the dotted path from the working
    directory), exactly what `trl/scripts/grpo.py` does under `accelerate launch`; it trains and logs each reward."""
    from trl.scripts.grpo import main, make_parser

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(PROMPTS, ANSWERS))
    )
    monkeypatch.chdir(REPO_ROOT)  # TRL puts the working directory on sys.path, as `trl grpo` run from the repo
    output_dir = tmp_path / "run"
    argv = f"""--model_name_or_path {tiny_dir} --dtype float32 --dataset_name {data_dir}
        --reward_funcs rewards.boxed_answer rewards.tag_count rewards.soft_overlong
        --output_dir {output_dir} --use_cpu --bf16 False --gradient_checkpointing False
        --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 8 --max_steps 1
        --logging_steps 1 --report_to none --save_strategy steps --save_steps 1 --seed 0""".split()
    script_args, training_args, model_args, dataset_args = make_parser().parse_args_and_config(argv)
    assert script_args.reward_funcs == ["rewards.boxed_answer", "rewards.tag_count", "rewards.soft_overlong"]
    main(script_args, training_args, model_args, dataset_args)
    state = json.loads((output_dir / "checkpoint-1" / "trainer_state.json").read_text())
    logged = {key for entry in state["log_history"] for key in entry}
    for name in ("boxed_answer", "tag_count", "soft_overlong"):
        assert f"rewards/{name}/mean" in logged
    boxed = [
        entry["rewards/boxed_answer/mean"] for entry in state["log_history"] if "rewards/boxed_answer/mean" in entry
    ]
    assert all(-1.0 <= value <= 1.0 for value in boxed)
