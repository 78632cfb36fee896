"""The preflight (issue 12): every bad data file and bad recipe exits 2 from `validate` and from `train`, with one
message naming file, line/row and column, no traceback and nothing written; overrides read by the key's type;
both flag spellings and every default in `--help`; prompts length-filtered without tokenising megabytes."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from prorl_trl.cli import build_parser, main, parse_command_line
from prorl_trl.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
GOOD_ROW = {"prompt": "1+1=", "answer": "2"}


def data_recipe(tmp_path: Path, model: Path, source: Path, **data) -> dict:
    """A CPU recipe on a local JSON-lines file (prompt -> problem, answer -> gold), one short phase."""
    return {
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "peft": None,
        "data": {"builder": "jsonl", "source": str(source), "columns": {"prompt": "prompt", "answer": "answer"},
                 "template": "raw", "prompt_format": "plain", **data},
        "rewards": [{"name": "boxed_answer"}],
        "training": {"output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False, "save_strategy": "no",
                     "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8},
        "phases": [{"name": "only", "max_steps": 1}],
    }  # fmt: skip


def lines(*rows) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


# id: (file bytes, data-section changes, text every message must hold)
BAD_DATA = {
    "empty_prompt": (lines(GOOD_ROW, {"prompt": "", "answer": "3"}), {}, ["line 2", "column 'prompt'", "empty problem text"]),
    "null_prompt": (lines(GOOD_ROW, {"prompt": None, "answer": "3"}), {}, ["line 2", "column 'prompt'", "null problem text"]),
    "non_string_prompt": (lines(GOOD_ROW, {"prompt": 7, "answer": "3"}), {}, ["line 2", "is a number, not text"]),
    "bad_encoding": (lines(GOOD_ROW, b'{"prompt": "caf\xe9", "answer": "3"}'), {}, ["line 2", "not UTF-8 text (byte 0xe9"]),
    "malformed_line": (lines(GOOD_ROW, b'{"prompt": "x" "answer": "3"}'), {}, ["line 2", "not valid JSON"]),
    "zero_rows": (b"", {}, ["has no rows"]),
    "only_blank_lines": (b"\n  \n\n", {}, ["has no rows"]),
    "missing_prompt_column": (lines({"question": "1+1=", "answer": "2"}), {},
                              ["column 'prompt'", "no such column in any row (columns: answer, question)", "data.columns"]),
    "missing_gold_column": (lines({"prompt": "1+1="}, {"prompt": "2+2="}), {}, ["column 'answer'", "no such column in any row"]),
    "gold_column_not_mapped": (lines({"prompt": "1+1=", "final": "2"}), {"columns": {"prompt": "prompt"}},
                               ["reward `boxed_answer` reads the gold from column 'answer'", "(its columns: prompt, final)",
                                "data: {columns: {answer: <your column>}}"]),
    "empty_gold_column": (lines({"prompt": "1+1=", "answer": ""}, {"prompt": "2+2=", "answer": ""}), {},
                          ["reward `boxed_answer` can read no gold answer", "returns None for every row"]),
    "all_null_golds": (lines({"prompt": "1+1=", "answer": None}, {"prompt": "2+2=", "answer": None}), {},
                       ["reward `boxed_answer` can read no gold answer", "answer = None"]),
    "list_golds": (lines({"prompt": "1+1=", "answer": ["2"]}, {"prompt": "2+2=", "answer": ["4"]}), {},
                   ["reward `boxed_answer` can read no gold answer", "answer = ['2']"]),
    "some_null_golds": (lines(GOOD_ROW, {"prompt": "2+2=", "answer": None}, GOOD_ROW), {},
                        ["row 2", "no reward can read this row's gold answer"]),
    "non_finite_number": (lines(GOOD_ROW, b'{"prompt": "x", "answer": NaN}'), {},
                          ["line 2", "column 'answer'", "non-finite number"]),
    "mixed_types": (lines(GOOD_ROW, {"prompt": "x", "answer": 3}), {},
                    ["line 2", "column 'answer'", "a number here but text at line 1"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_exits_2_from_validate_and_train(capsys, tmp_path, tiny_dir, case):
    content, data, expected = BAD_DATA[case]
    source = tmp_path / "data.jsonl"
    source.write_bytes(content)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data_recipe(tmp_path, tiny_dir, source, **data)))
    for command in ("validate", "train"):
        code = main([command, str(recipe)])
        out, err = capsys.readouterr()
        assert code == 2, (command, err)
        assert str(source) in err and all(text in err for text in expected), (command, err)
        assert "Traceback" not in err + out
    assert not (tmp_path / "out").exists()


def test_one_pass_lists_recipe_file_and_data_problems_together(capsys, tmp_path, tiny_dir):
    """Issue 30: a recipe with a bad key, a missing local file and a bad data file gets all three from one `validate`
    (exit 2), and `train` refuses with the same list before loading anything; what could not be checked because of
    them is named."""
    source = tmp_path / "data.jsonl"
    source.write_bytes(lines({"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}))
    raw = data_recipe(tmp_path, tiny_dir, source)
    raw["training"]["learning_rat"] = 1e-6  # the recipe: an unknown key
    raw["rewards"] = [{"name": "boxed_answr"}]  # ... and a reward the registry lacks
    raw["model"]["tokenizer_name_or_path"] = str(tmp_path / "no-tokenizer")  # a local file that is not there
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    expected = [
        "training.learning_rat = 1e-06: unknown key; did you mean `learning_rate`?",
        "rewards.0.name = 'boxed_answr': unknown reward; did you mean `boxed_answer`?",
        f"model.tokenizer_name_or_path = '{tmp_path / 'no-tokenizer'}': local file or folder not found",
        f"data.source: {source}, column 'prompt': no such column in any row (columns: answer, question)",
    ]
    outputs = {}
    for command in ("validate", "train"):
        code = main([command, str(path)])
        out, err = capsys.readouterr()
        assert code == 2 and "(4 problems)" in err and all(text in err for text in expected), (command, err)
        assert "not checked until the problems above are fixed:\n  the launch (engine, processes" in err, err
        assert "Traceback" not in err + out
        outputs[command] = err
    assert outputs["validate"] == outputs["train"]  # the same list
    assert not (tmp_path / "out").exists()


def test_one_pass_skips_only_what_depends_on_a_broken_section(capsys, tmp_path, tiny_dir):
    """A broken `data` section: its rows are not read (noted), but the other files and the output folder still are;
    a broken `training.output_dir` skips the folder check only."""
    source = tmp_path / "data.jsonl"
    source.write_bytes(lines(GOOD_ROW))
    raw = data_recipe(tmp_path, tiny_dir, source)
    raw["data"]["columns"] = ["prompt"]  # not a mapping
    raw["model"]["name_or_path"] = str(tmp_path / "no-model")
    (tmp_path / "file").write_text("")
    raw["training"]["output_dir"] = str(tmp_path / "file" / "out")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "(3 problems)" in err and "data.columns = ['prompt']: expected a mapping" in err, err
    assert "model.name_or_path" in err and "local file or folder not found" in err
    assert "training.output_dir" in err and "is a file, so the run folder cannot be created under it" in err
    assert "the data files' rows (the `data` or `validation` section has a problem)" in err
    raw["data"]["columns"] = {"prompt": "prompt"}
    raw["training"]["output_dir"] = 7
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "(2 problems)" in err and "training.output_dir = 7" in err and "model.name_or_path" in err, err
    assert "the output folder (`training.output_dir` has a problem)" in err


def test_bad_parquet_rows_and_bad_gsm8k_golds_are_named(capsys, tmp_path, tiny_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", None, "  "], "answer": ["2", "3", "4"]}), table)
    raw = data_recipe(tmp_path, tiny_dir, table)
    raw["data"]["builder"] = "parquet"
    (tmp_path / "parquet.yaml").write_text(yaml.safe_dump(raw))
    assert main(["validate", str(tmp_path / "parquet.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{table}, row 2, column 'prompt': null problem text" in err and "row 3, column 'prompt': empty" in err
    # A GSM8K folder whose worked solutions lack the '#### <number>' line the gold is read from.
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_bytes(lines({"question": "1+1?", "answer": "#### 2"},
                                                           {"question": "2+2?", "answer": "four"}))  # fmt: skip
    raw = data_recipe(tmp_path, tiny_dir, tmp_path / "gsm8k")
    raw["data"] = {"builder": "gsm8k", "source": str(tmp_path / "gsm8k"), "prompt_format": "plain"}
    (tmp_path / "gsm8k.yaml").write_text(yaml.safe_dump(raw))
    assert main(["validate", str(tmp_path / "gsm8k.yaml")]) == 2
    err = capsys.readouterr().err
    assert "row 2, column 'answer': GSM8K answer has no '#### <number>' line" in err and "Traceback" not in err


BASE = {
    "model": {"name_or_path": "Qwen/Qwen2-0.5B"},
    "peft": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "data": {"builder": "gsm8k"},
    "rewards": [{"name": "boxed_answer"}],
    "training": {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 64},
    "phases": [{"name": "a", "max_steps": 2}, {"name": "b", "max_steps": 2, "top_p": 0.9}],
}


def with_changes(**changes) -> dict:
    recipe = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = recipe
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[last] = value
    return recipe


# id: (recipe, extra command-line tokens, text the message must hold)
BAD_RECIPES = {
    "learning_rate_nan": (with_changes(training__learning_rate=float("nan")), [],
                          ["training.learning_rate = nan: must be a finite number"]),
    "infinite_reward_param": (with_changes(rewards=[{"name": "boxed_answer", "params": {"correct": float("inf")}}]),
                              [], ["rewards.0.params.correct = inf: must be a finite number"]),
    "batch_size_1e30_integer": (with_changes(training__per_device_train_batch_size=10**30), [],
                                ["training.per_device_train_batch_size", "must be <= 2147483647"]),
    "batch_size_1e30_float": (with_changes(training__per_device_train_batch_size=1e30), [],
                              ["training.per_device_train_batch_size = 1e+30: expected an integer"]),
    "negative_synthetic_count": (with_changes(data={"builder": "synthetic_arithmetic", "options": {"num_train": -5}}),
                                 [], ["data.options.num_train = -5: must be >= 1"]),
    "output_dir_empty": (with_changes(training__output_dir=""), [], ["training.output_dir = '': must name a folder"]),
    "output_dir_null": (with_changes(training__output_dir=None), [], ["training.output_dir = None: must name a folder"]),
    "batch_for_3_processes": (with_changes(training__num_generations=8), ["--num-processes", "3"],
                              ["training.per_device_train_batch_size = 4: per_device_train_batch_size x processes x "
                               "gradient_accumulation_steps = 4 x 3 x 1 = 12", "num_generations = 8"]),
    "generation_batch_for_2_processes": (with_changes(training__generation_batch_size=4), ["--num_processes", "2"],
                                         ["training.generation_batch_size = 4: must be divisible by "
                                          "per_device_train_batch_size x processes = 4 x 2 = 8"]),
    "section_typo_in_override": (BASE, ["--trainin.beta", "0"],
                                 ["unknown section in override `--trainin.beta`; did you mean `training`?"]),
    "training_key_at_top_level": (with_changes(learning_rate=1e-6), [],
                                  ["learning_rate = 1e-06: unknown section; `learning_rate` is a training setting: "
                                   "put it under `training:`"]),
    "yaml_no_for_a_string_key": (with_changes(training__save_strategy=False), [],
                                 ["training.save_strategy = False", "quote the word"]),
    "grid_file": ({"base": "recipe.yaml", "variants": {"a": {}}}, [], ["`prorl-trl ablate FILE --validate-only`"]),
    "flat_trl_config": ({"model_name_or_path": "Qwen/Qwen2-0.5B", "dataset_name": "openai/gsm8k",
                         "learning_rate": 1e-6, "num_generations": 8, "reward_funcs": ["accuracy"], "bf16": True}, [],
                        ["(1 problem)", "flat TRL / open-r1 config", "learning_rate: 1e-06",
                         "model_name_or_path -> model.name_or_path", "dataset_name -> data.source"]),
    "offloaded_zero3_launch_with_resets": (BASE, ["--launch-config", str(REPO / "tests/recipes/launch_zero3_offload.yaml")],
                                           ["Hard resets are not supported under DeepSpeed ZeRO-3: CPU/NVMe offload",
                                            "zero3.yaml"]),
    "compiled_generation_under_fsdp2": (with_changes(training__compiled_generation=True),
                                        ["--launch-config", str(REPO / "recipes/accelerate/fsdp.yaml")],
                                        ["compiled_generation is not supported under FSDP2"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_bad_recipe_exits_2_with_a_message(capsys, tmp_path, case):
    recipe, extra, expected = BAD_RECIPES[case]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["validate", str(path), *extra])
    out, err = capsys.readouterr()
    assert code == 2 and str(path) in err and all(text in err for text in expected), err
    assert "Traceback" not in err + out


@pytest.mark.parametrize("kind", ["file", "empty_folder"])
def test_a_model_path_that_is_not_a_model_folder_stops_validate_and_train(capsys, tmp_path, kind):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"x") if kind == "file" else model.mkdir()
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(with_changes(model={"name_or_path": str(model)}, training__output_dir=str(tmp_path / "out"))))
    expected = "is a file; a model is a folder" if kind == "file" else "the folder holds no config.json / adapter_config.json"
    for command in ("validate", "train"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert f"model.name_or_path = '{model}': {expected}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, module", [({"training__use_vllm": True}, "vllm"), ({"model__quantization": "8bit"}, "bitsandbytes")])
def test_missing_extras_are_named_with_the_install_command(capsys, tmp_path, extra, module):
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(with_changes(**extra)))
    assert main(["validate", str(path)]) == 2
    assert f"needs `{module}`, which is not installed: pip install -e '.[" in capsys.readouterr().err


def test_overrides_are_read_by_the_key_type(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    recipe = load_recipe(path, ["--training.save_strategy", "no", "--model.revision", "1234",
                                "--training.learning_rate", "1e-6", "--data.split", "yes", "--phases.1.top_p=1",
                                "--peft", "null", "--phases.0.lora_r", "null", "--training.run_name", "007"])  # fmt: skip
    assert recipe.training["save_strategy"] == "no" and recipe.model.revision == "1234"
    assert recipe.training["learning_rate"] == 1e-6 and recipe.data.split == "yes" and recipe.training["run_name"] == "007"
    assert recipe.resolved_phases[1].top_p == 1.0 and recipe.peft is None


SPELLINGS = [
    (["validate", "r.yaml", "--num-processes", "3"], ["validate", "--num_processes", "3", "r.yaml"], "num_processes", 3),
    (["validate", "r.yaml", "--no-machine-checks"], ["validate", "r.yaml", "--no_machine_checks"], "no_machine_checks", True),
    (["ablate", "g.yaml", "--validate-only"], ["ablate", "g.yaml", "--validate_only"], "validate_only", True),
    (["eval", "--model", "a=b", "--dataset", "gsm8k", "--out", "o", "--top-p", "0.9"],
     ["eval", "--model", "a=b", "--dataset", "gsm8k", "--out", "o", "--top_p", "0.9"], "top_p", 0.9),
    (["eval", "--model", "a=b", "--dataset", "gsm8k", "--out", "o", "--max-new-tokens", "9"],
     ["eval", "--model", "a=b", "--dataset", "gsm8k", "--out", "o", "--max_completion_length", "9"], "max_new_tokens", 9),
    (["distill", "--teacher", "t", "--dataset", "kk", "--reward", "r", "--out", "o", "--max-completion-length", "9"],
     ["distill", "--teacher", "t", "--dataset", "kk", "--reward", "r", "--output_dir", "o", "--max_completion_length", "9"],
     "max_completion_length", 9),
    (["distill", "--teacher", "t", "--dataset", "kk", "--reward", "r", "--out", "o", "--min-kept", "5"],
     ["distill", "--teacher", "t", "--dataset", "kk", "--reward", "r", "--out", "o", "--min_kept", "5"], "min_kept", 5),
    (["demo", "--sft-steps", "3"], ["demo", "--sft_steps", "3"], "sft_steps", 3),
]  # fmt: skip


@pytest.mark.parametrize("kebab, snake, dest, value", SPELLINGS, ids=lambda x: x[0] if isinstance(x, list) else None)
def test_every_subcommand_takes_both_spellings(kebab, snake, dest, value):
    for argv in (kebab, snake):
        _, args = parse_command_line(argv)
        assert getattr(args, dest) == value, argv
        assert getattr(args, "overrides", []) == []  # options after RECIPE are options, not overrides


def test_options_after_the_recipe_are_options_and_the_rest_overrides():
    _, args = parse_command_line(["validate", "r.yaml", "--training.beta", "0", "--num-processes", "2", "--x=1"])
    assert (args.recipe, args.num_processes, args.overrides) == ("r.yaml", 2, ["--training.beta", "0", "--x=1"])


@pytest.mark.parametrize("command", ["train", "validate", "ablate", "eval", "distill", "demo"])
def test_help_shows_every_default(command):
    sub = build_parser([command]).subcommands[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS and action.default is not argparse.SUPPRESS \
                and not action.required:  # fmt: skip
            assert "default" in formatter._get_help_string(action).lower(), (command, action.option_strings)
    if command == "eval":
        assert "(default: 0.7)" in " ".join(sub.format_help().split())  # eval's top_p, no longer a hidden default


def test_each_warning_is_shown_once_even_when_filters_reset():
    from prorl_trl.console import each_warning_once

    def warn_three_times(shown: list[str]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # Python's own rule: once per code location...
            warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
            with each_warning_once() if shown is not plain else contextlib.nullcontext():
                for _ in range(3):
                    with warnings.catch_warnings():  # ...which every catch_warnings (TRL: every step) forgets
                        pass
                    warnings.warn("`gradient_checkpointing` is deprecated", UserWarning)
                warnings.warn("another one", UserWarning)

    plain: list[str] = []
    warn_three_times(plain)
    assert plain.count("`gradient_checkpointing` is deprecated") == 3  # the repetition the issue saw
    once: list[str] = []
    warn_three_times(once)
    assert once == ["`gradient_checkpointing` is deprecated", "another one"]


def test_a_slow_step_gets_a_heartbeat_and_logs_carry_the_eta(tmp_path, capsys):
    from transformers import TrainerState, TrainingArguments

    from prorl_trl.trainer.progress import RunProgress

    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, use_cpu=True, report_to=[])
    state = TrainerState(max_steps=10)
    progress = RunProgress(heartbeat_seconds=0.05)
    progress.on_train_begin(args, state, None)
    progress.on_step_begin(args, state, None)
    __import__("time").sleep(0.3)
    state.global_step = 1
    progress.on_step_end(args, state, None)
    progress.on_log(args, state, None, logs={"loss": 0.5, "reward": 0.25, "rewards/boxed_answer/mean": 0.25})
    err = capsys.readouterr().err
    assert "step 1/10: still running after" in err
    assert "step 1/10 (" in err and "s/step, ETA" in err and "loss 0.5, reward 0.25, boxed_answer 0.25" in err


def test_the_heartbeat_stops_when_a_step_raises(tmp_path, capsys):
    """HF calls no callback when a step raises: a caller that catches the error must not go on reading "still
    running" lines about a step that ended (a real HF Trainer on the tiny model, its loss raising at step 1)."""
    import time

    import torch
    from transformers import Trainer, TrainingArguments

    from prorl_trl.tiny import build_tiny
    from prorl_trl.trainer.progress import use_run_progress

    class StepFails(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            time.sleep(0.3)  # long enough for a heartbeat line: the thread was running
            raise RuntimeError("the step failed")

    model, _ = build_tiny()
    rows = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([1, 2, 3])}] * 4
    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, use_cpu=True, report_to=[], max_steps=2,
                             per_device_train_batch_size=1, save_strategy="no")  # fmt: skip
    trainer = StepFails(model=model, args=args, train_dataset=rows)
    use_run_progress(trainer).heartbeat_seconds = 0.05
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer.train()
    assert "step 1/2: still running after" in capsys.readouterr().err
    time.sleep(0.3)
    assert "still running" not in capsys.readouterr().err


def test_megabyte_prompts_are_dropped_without_tokenising(tmp_path):
    """4 prompts of 1 MB and 4 short ones: the length filter keeps the short ones and peak memory grows by well
    under the ~400 MB that tokenising one 1 MB prompt took (measured in a fresh process)."""
    source = tmp_path / "big.jsonl"
    with open(source, "w") as handle:
        for index in range(4):
            handle.write(json.dumps({"prompt": f"{index}+{index}=", "answer": str(2 * index)}) + "\n")
            handle.write(json.dumps({"prompt": "word " * 200_000, "answer": "1"}) + "\n")
    probe = f"""
import resource
from prorl_trl.data import build_dataset
from prorl_trl.data.spec import DataSection
from prorl_trl.tiny import build_tiny_tokenizer
tokenizer = build_tiny_tokenizer()
import datasets
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = build_dataset(DataSection(builder="jsonl", source={str(source)!r}, prompt_format="plain",
                                 columns={{"prompt": "prompt", "answer": "answer"}}), "train", tokenizer)
print(len(rows), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    kept, growth_mb = map(int, result.stdout.split()[-2:])
    assert kept == 4 and growth_mb < 200, result.stdout


def test_a_problem_with_one_training_key_leaves_the_others_checked_in_the_same_pass(capsys, tmp_path):
    """A batch that does not divide into groups (a `training` key's problem) and a missing vLLM (another key's) are
    both listed by one `validate`: the first used to hide the whole `training` section from the extras check."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(with_changes(training__use_vllm=True, training__num_generations=7)))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "which must be a multiple of num_generations = 7" in err and "needs `vllm`, which is not installed" in err
