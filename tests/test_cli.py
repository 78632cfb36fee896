"""`prorl-trl train` end to end under `accelerate launch` (single-process config, on CPU), with command-line
overrides; the train path's own bad-input handling; the subcommand table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prorl_trl.cli import main

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "tests" / "recipes" / "tiny_gsm8k.yaml"
DEMO_RECIPE = REPO / "recipes" / "demo_tiny.yaml"


@pytest.fixture(scope="module")
def trained(tiny_dir, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data)}
    # The demo's recipe, shortened to a few steps, on a random tiny model (the demo would warm-start one first).
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/single_gpu.yaml", "--cpu",
        "-m", "prorl_trl", "train", str(DEMO_RECIPE),
        "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out),
        "--phases.0.max_steps", "1", "--phases.1.max_steps", "1", "--phases.1.temperature", "1.3",
        "--data.options.num_train", "128", "--data.validation_size", "8", "--validation.eval_steps", "1",
        "--training.save_strategy", "steps", "--training.save_steps", "1",  # a checkpoint at every step
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    return out, result


def test_train_under_accelerate_runs_all_phases_and_reports_outputs(trained):
    out, result = trained
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"outputs:  {out}/" in result.stdout and "final model:" in result.stdout
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2
    assert "eval_pass@1" in summary["final_eval"] and "boxed_answer" in summary["reward_means"]
    phases = [e["prorl/phase"] for e in summary["log_history"] if "prorl/phase" in e]
    assert sorted(set(phases)) == [0, 1]
    effective = yaml.safe_load((out / "recipe.yaml").read_text())
    assert effective["phases"][1]["temperature"] == 1.3 and effective["training"]["output_dir"] == str(out)


def test_console_shows_each_warning_once_and_whole_banners(trained):
    """Captured (not a terminal, like a log file): validation at the start and after each step and a checkpoint at
    every step re-raised TRL's gradient-checkpointing deprecations each time; they are the libraries' own calls, so
    the CLI shows none of them (`LIBRARY_NOISE`; any other warning once), and the phase banner keeps its last setting
    (rich used to crop it at 80 columns)."""
    out, result = trained
    assert result.returncode == 0
    err = result.stderr
    assert len(list(out.glob("phase-*/checkpoint-*"))) == 2  # several saves happened
    for deprecated in ("`gradient_checkpointing_enable` is deprecated", "`is_gradient_checkpointing` is deprecated"):
        assert err.count(deprecated) == 0, err[-3000:]
    banner = next(line for line in err.splitlines() if line.startswith("ProRL phase 2/2 'sharpen'"))
    assert len(banner) > 80 and "temperature=1.3" in banner and banner.rstrip().endswith("max_completion_length=8")
    assert "step 2/2 [sharpen]" in err and "{'loss'" not in err  # a short line per log, not HF's dict


def test_each_warning_once_shows_a_repeated_warning_once_and_library_noise_never(monkeypatch):
    import warnings

    from prorl_trl.console import each_warning_once

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # Python's own once-per-place rule out of the way: each_warning_once decides
        with each_warning_once():
            for _ in range(3):
                warnings.warn("the same thing again", UserWarning, stacklevel=1)
                warnings.warn("`gradient_checkpointing_enable` is deprecated and will be removed", FutureWarning,
                              stacklevel=1)  # fmt: skip
    assert shown == ["the same thing again"]


def test_final_model_card_names_the_base_model_and_the_recipe(trained, tiny_dir):
    out, result = trained
    card = (out / "final" / "README.md").read_text()
    assert f"Fine-tuned from `{tiny_dir}` (a local folder)" in card and "[None]" not in card
    assert "from the recipe `demo_tiny.yaml`" in card and "| sharpen | 1 | 1.3 |" in card
    assert "eval_pass@1" in card


def test_final_model_loads(trained):
    from transformers import AutoModelForCausalLM

    out, result = trained
    assert result.returncode == 0
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "qwen2"


def test_train_with_a_bad_recipe_exits_2_before_loading_anything(capsys, tmp_path):
    out = tmp_path / "never"
    code = main(["train", str(TINY_RECIPE), "--training.output_dir", str(out), "--training.num_generations", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "training.num_generations = 1" in err and str(TINY_RECIPE) in err and "Traceback" not in err
    assert not out.exists()


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for command in ("train", "validate", "ablate"):
        assert command in text
    for command, module in (("demo", "demo.py"), ("eval", "evaluation/cli.py"), ("distill", "distill/cli.py")):
        assert (command in text) == (REPO / "prorl_trl" / module).is_file()


@pytest.mark.parametrize("name", ["single_gpu", "cpu", "multi_gpu", "multi_gpu_4", "fsdp", "zero2", "zero3"])
def test_shipped_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "recipes" / "accelerate" / f"{name}.yaml"))
    expected = {"single_gpu": "NO", "cpu": "NO", "multi_gpu": "MULTI_GPU", "multi_gpu_4": "MULTI_GPU", "fsdp": "FSDP"}
    assert str(config.distributed_type).split(".")[-1] == expected.get(name, "DEEPSPEED")
    assert (config.num_processes == 1) == (name in ("single_gpu", "cpu"))
    if name.startswith("zero"):
        assert config.deepspeed_config["zero_stage"] == int(name[-1])


def test_help_after_the_recipe_shows_the_override_syntax(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(TINY_RECIPE), "--help"])
    assert exit_info.value.code == 0 and "--phases.2.temperature 1.2" in capsys.readouterr().out


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
