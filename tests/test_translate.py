"""`prorl-trl convert`: open-r1's own GRPO recipe files (tests/data/open_r1/, copied verbatim) translate into recipes
with every key accounted for: translated (`mapped`) or named with its reason (`unmapped`). The expected unmapped
set is spelt out per file, so a change to the translation is a deliberate edit here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from prorl_trl.cli import main
from prorl_trl.recipe.load import recipe_from_dict
from prorl_trl.recipe.schema import RecipeError
from prorl_trl.recipe.translate import translate_flat_config

OPEN_R1 = Path(__file__).parent / "data" / "open_r1"
CODE = ("reward_funcs: code", "reward_funcs: ioi_code", "reward_funcs: cf_code", "reward_funcs: code_format")

# file -> (unmapped keys, recipe problems left after translation). open-r1 launches its GRPO runs on 8 GPUs with
# one serving vLLM (`accelerate launch --num_processes 7`), so the batch arithmetic is checked for 7 processes.
EXPECTED = {
    "DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml": ({"chat_template", "overwrite_output_dir"}, set()),
    "Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml": ({"overwrite_output_dir"}, set()),
    # num_generations 14: valid because the 7-process batch (16 x 7 x 4 = 448) is whole groups (one process would
    # have 64; validate judges the batch of the processes it is told).
    "Qwen2.5-1.5B-Instruct/grpo/config_demo_code.yaml": ({"overwrite_output_dir", "reward_funcs: code"}, set()),
    "Qwen2.5-1.5B-Instruct/grpo/config_demo_code_ioi.yaml": (
        {"overwrite_output_dir", "reward_funcs: ioi_code", "reward_funcs: code_format", "code_language",
         "code_eval_test_batch_size"},
        set(),
    ),
    # Both rewards execute code: no reward is left, and validation says so (the only problem).
    "Qwen2.5-Coder-7B-Instruct/grpo/config_codeforces.yaml": (
        {"overwrite_output_dir", "reward_funcs: cf_code", "reward_funcs: code_format", "callbacks", "benchmarks",
         "vllm_device", "wandb_entity", "wandb_project", "code_eval_test_batch_size", "code_eval_scoring_mode"},
        {"rewards"},
    ),
}  # fmt: skip


def open_r1_files() -> list[str]:
    return sorted(str(path.relative_to(OPEN_R1)) for path in OPEN_R1.rglob("grpo/*.yaml"))


def test_every_open_r1_grpo_recipe_has_an_expectation():
    assert open_r1_files() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_open_r1_recipe_translates_with_every_key_accounted_for(name):
    raw = yaml.safe_load((OPEN_R1 / name).read_text())
    translation = translate_flat_config(copy.deepcopy(raw), source=name)
    unmapped_keys = {key for key in translation.unmapped if not key.startswith("reward_funcs: ")}
    assert set(raw) == set(translation.mapped) | unmapped_keys  # nothing dropped silently
    assert not set(translation.mapped) & unmapped_keys
    expected_unmapped, expected_problems = EXPECTED[name]
    assert set(translation.unmapped) == expected_unmapped
    assert all(reason.strip() for reason in translation.unmapped.values())
    assert {"dataset_prompt_column", "max_prompt_length"} <= set(translation.mapped)
    problems: set[str] = set()
    try:
        recipe_from_dict(copy.deepcopy(translation.recipe), name, world_size=7)
    except RecipeError as error:
        problems = {problem.path for problem in error.problems}
    assert problems == expected_problems


def test_open_r1_math_demo_translates_to_the_same_run():
    """The values that decide the run, read back from the recipe the loader builds."""
    raw = yaml.safe_load((OPEN_R1 / "Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml").read_text())
    recipe = recipe_from_dict(translate_flat_config(raw).recipe, "demo", world_size=7)
    assert recipe.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct" and recipe.model.dtype == "bfloat16"
    assert recipe.peft is None  # open-r1's demos fine-tune fully
    assert (recipe.data.source, recipe.data.columns, recipe.data.max_prompt_tokens) == (
        "open-r1/OpenR1-Math-220k", {"prompt": "problem"}, 512,
    )  # fmt: skip
    assert recipe.data.system_prompt == raw["system_prompt"] and recipe.data.template == "raw"
    assert [(r.name, r.weight, r.params) for r in recipe.rewards] == [
        ("math_equivalence", 1.0, {"answer_key": "solution"}),
        ("think_answer_format", 1.0, {}),
        ("tag_count", 1.0, {}),
    ]
    args = recipe.training_args(dry=True)
    assert (args.learning_rate, args.num_generations, args.max_completion_length) == (2e-5, 16, 1024)
    assert args.warmup_steps == 0.1 and args.lr_scheduler_type == "cosine"
    assert args.use_vllm and args.vllm_mode == "server"
    assert args.report_to == ["wandb"]


def test_prompt_column_and_max_prompt_length_build_open_r1_prompts(tmp_path):
    """`dataset_prompt_column` picks the problem column; `max_prompt_length` drops longer prompts (TRL 1.16 has no
    max_prompt_length). Prompts are open-r1's `make_conversation`: [system, user: <column>]; `solution` stays."""
    from prorl_trl.data.builders import build_dataset, prompt_token_count
    from prorl_trl.tiny import build_tiny_tokenizer

    rows = [{"problem": "1 + 1?", "solution": "2"}, {"problem": "x" * 400, "solution": "3"}]
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = build_tiny_tokenizer()
    system = "Think, then answer."
    short = [{"role": "system", "content": system}, {"role": "user", "content": "1 + 1?"}]
    limit = prompt_token_count(short, tokenizer) + 10
    translation = translate_flat_config({
        "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "dataset_name": str(source), "dataset_prompt_column": "problem",
        "max_prompt_length": limit, "system_prompt": system, "reward_funcs": ["accuracy"], "num_generations": 2,
        "per_device_train_batch_size": 2,
    })  # fmt: skip
    assert translation.mapped["dataset_prompt_column"] == "data.columns.prompt"
    assert translation.mapped["max_prompt_length"] == "data.max_prompt_tokens"
    assert "max_prompt_length" in translation.notes and not translation.unmapped
    recipe = recipe_from_dict(translation.recipe, "unit")
    built = build_dataset(recipe.data, tokenizer=tokenizer, reward_funcs=recipe.reward_functions())
    assert built["prompt"] == [short] and built["solution"] == ["2"]


def test_rewards_and_their_parameters():
    translation = translate_flat_config({
        "dataset_name": "d", "reward_funcs": ["cosine", "repetition_penalty", "soft_overlong_punishment", "length",
                                              "reasoning_steps", "my_pkg.my_reward", "rewards.boxed_answer"],
        "reward_weights": [1, 2, 3, 4, 5, 6, 7], "cosine_max_len": 500, "repetition_n_grams": 4,
        "soft_punish_cache": 128, "cosine_min_value_wrong": -1.0,
    })  # fmt: skip
    rewards = translation.recipe["rewards"]
    assert [(r["name"], r["weight"]) for r in rewards] == [
        ("cosine_scaled", 1), ("repetition_penalty", 2), ("soft_overlong", 3), ("kimi_length", 4),
        ("reasoning_steps", 5), ("boxed_answer", 7),
    ]  # fmt: skip
    assert rewards[0]["params"] == {"answer_key": "solution", "max_len": 500, "min_value_wrong": -1.0,
                                    "max_value_wrong": -0.5, "min_value_correct": 0.5, "max_value_correct": 1.0}  # fmt: skip
    assert rewards[1]["params"] == {"ngram_size": 4, "max_penalty": -1.0}
    assert rewards[2]["params"] == {"max_completion_len": 16384, "soft_punish_cache": 128}
    assert translation.mapped["cosine_max_len"] == "rewards[0].params.max_len"
    assert set(translation.unmapped) == {"reward_funcs: my_pkg.my_reward"}
    assert "rewards.register()" in translation.unmapped["reward_funcs: my_pkg.my_reward"]


def test_reward_parameters_of_unused_rewards_and_unknown_keys_are_named():
    translation = translate_flat_config(
        {"dataset_name": "d", "reward_funcs": ["format"], "cosine_max_len": 500, "learning_rat": 1e-6, "lora_r": 8,
         "warmup_steps": 10, "warmup_ratio": 0.1}
    )  # fmt: skip
    assert set(translation.unmapped) == {"cosine_max_len", "learning_rat", "lora_r", "warmup_ratio"}
    assert translation.recipe["training"]["warmup_steps"] == 10
    assert "`warmup_steps` also sets training.warmup_steps" in translation.unmapped["warmup_ratio"]
    assert "reward_funcs does not list" in translation.unmapped["cosine_max_len"]
    assert "did you mean `learning_rate`?" in translation.unmapped["learning_rat"]
    assert "use_peft" in translation.unmapped["lora_r"]


def test_trl_flat_config_with_lora():
    """A `trl grpo --config` file: TRL's reward names, LoRA with ModelConfig's defaults, no open-r1 vLLM server."""
    translation = translate_flat_config({
        "model_name_or_path": "Qwen/Qwen2-0.5B", "dataset_name": "openai/gsm8k", "dataset_config": "main",
        "use_peft": True, "lora_r": 8, "load_in_4bit": True, "use_vllm": True, "scale_rewards": False,
        "reward_funcs": ["accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"],
    })  # fmt: skip
    recipe = translation.recipe
    assert recipe["peft"] == {"enabled": True, "r": 8, "lora_alpha": 32, "lora_dropout": 0.05}
    assert recipe["model"]["quantization"] == "4bit"
    assert "vllm_mode" not in recipe["training"] and recipe["training"]["scale_rewards"] == "none"
    assert [r["name"] for r in recipe["rewards"]] == ["math_equivalence", "soft_overlong"]
    assert set(translation.unmapped) == {"reward_funcs: think_format_reward"}
    assert "lora_target_modules" in translation.notes["use_peft"]
    assert "use_vllm" not in translation.notes  # no open-r1 markers: vllm_mode is TRL's default, no note says "server"


def test_notes_never_contradict_what_the_file_sets():
    """Audit finding (issue 39): `lora_target_modules: all-linear` was noted as "not set", and `vllm_mode: colocate`
    as "the recipe sets training.vllm_mode: server". Those notes are for keys the file leaves out, only."""
    given = {"model_name_or_path": "Qwen/Qwen2-0.5B", "dataset_name": "x/y", "use_peft": True,
             "lora_target_modules": "all-linear", "use_vllm": True, "vllm_mode": "colocate", "system_prompt": "s",
             "reward_funcs": ["accuracy"]}  # fmt: skip
    translation = translate_flat_config(given)
    assert translation.recipe["peft"]["target_modules"] == "all-linear"
    assert translation.recipe["training"]["vllm_mode"] == "colocate"
    notes = " ".join(translation.notes.values())
    assert "not set" not in notes and "server" not in notes, translation.notes
    left_out = translate_flat_config({k: v for k, v in given.items() if k not in ("lora_target_modules", "vllm_mode")})
    assert "lora_target_modules not set" in left_out.notes["use_peft"]
    assert left_out.recipe["training"]["vllm_mode"] == "server" and "server" in left_out.notes["use_vllm"]


def test_convert_command_writes_a_recipe_validate_accepts(tmp_path, capsys):
    out = tmp_path / "recipe.yaml"
    source = OPEN_R1 / "DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml"
    assert main(["convert", str(source), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "not translated: chat_template:" in err and "note: max_prompt_length -> data.max_prompt_tokens" in err
    text = out.read_text()
    assert text.startswith("# Translated from") and "#   chat_template: " in text
    recipe = yaml.safe_load(text)
    recipe["training"]["output_dir"] = str(tmp_path / "run")
    out.write_text(yaml.safe_dump(recipe))
    assert main(["validate", str(out), "--no-machine-checks", "--num-processes", "7"]) == 0
    assert "ok:" in capsys.readouterr().out
