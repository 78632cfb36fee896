"""Recipe validation: every shipped recipe validates; each class of bad input exits 2 with a message naming the file,
the key path and the value, prints no traceback and leaves no output directory; overrides reach the right key."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prorl_trl.cli import main
from prorl_trl.recipe import RecipeError, load_recipe, parse_overrides

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in (REPO / "recipes").glob("*.yaml"))

BASE = {
    "model": {"name_or_path": "Qwen/Qwen2-0.5B", "dtype": "bfloat16"},
    "peft": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "data": {"builder": "gsm8k", "validation_split": "test", "validation_size": 10, "prompt_format": "plain"},
    "rewards": [{"name": "boxed_answer", "weight": 1.0}],
    "training": {
        "learning_rate": 1e-6,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 64,
    },
    "phases": [
        {"name": "a", "max_steps": 2},
        {"name": "b", "max_steps": 2, "top_p": 0.9},
        {"name": "c", "max_steps": 2, "temperature": 1.2, "num_generations": 8},
    ],
    "validation": {"eval_steps": 2, "num_samples": 2, "temperature": 1.0, "top_p": 0.7},
}


def write(tmp_path: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    recipe = copy.deepcopy(recipe)
    recipe.setdefault("training", {})["output_dir"] = str(tmp_path / "out")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def changed(path: str, value) -> dict:
    """BASE with one dotted key set (or deleted when value is DELETE)."""
    recipe = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = recipe
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is DELETE:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return recipe


DELETE = object()


def run_validate(capsys, path: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["validate", str(path), *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(capsys, recipe):
    # GPU recipes (bf16, hub models), and the demo's model folder exists only once the demo made it.
    extra = ["--num-processes", "4"] if "logic_rl" in recipe.name else []  # its batch sizes assume 4 GPUs
    code = main(["validate", *extra, str(recipe), "--no-machine-checks"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "is valid" in out


def test_prorl_recipe_has_the_seed_phase_table():
    recipe = load_recipe(REPO / "recipes" / "prorl_gsm8k_qwen2_0.5b.yaml")
    table = [
        (p.temperature, p.top_p, p.num_generations, p.max_completion_length, p.overlong_buffer, p.lora_r)
        for p in recipe.resolved_phases
    ]
    assert table == [
        (1.0, 0.7, 16, 4096, 0, 32),
        (1.0, 0.9, 16, 4096, 0, 32),
        (1.0, 1.0, 16, 4096, 0, 32),
        (1.2, 1.0, 16, 4096, 0, 32),
        (1.2, 1.0, 32, 6144, 4096, 64),
    ]
    assert [p.hard_reset for p in recipe.resolved_phases] == [False, True, True, True, True]
    assert recipe.resolved_phases[-1].lora_target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert (
        recipe.resolved_phases[0].generation_batch_size == 32
        and recipe.resolved_phases[-1].generation_batch_size == 64
    )
    args = recipe.training_args(dry=True)
    assert (args.learning_rate, args.beta, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        2e-6,
        0.001,
        16,
        2,
    )
    assert recipe.data.max_prompt_tokens == 512 and recipe.data.validation_size == 100
    assert (recipe.validation.temperature, recipe.validation.top_p) == (1.0, 0.7)
    assert recipe.peft_config().r == 32 and sorted(recipe.peft_config().target_modules) == ["k_proj", "q_proj"]
    assert [spec.name for spec in recipe.rewards] == ["boxed_answer"]


BAD_INPUTS = {
    # id: (recipe, key path in the message, value text in the message, other required text)
    "misspelled_training_key": (
        changed("training.learnig_rate", 1e-6),
        "training.learnig_rate",
        "1e-06",
        "did you mean `learning_rate`",
    ),
    "misspelled_section": (
        changed("valdation", {"eval_steps": 1}),
        "valdation",
        "eval_steps",
        "did you mean `validation`",
    ),
    "misspelled_phase_key": (
        changed("phases.1.temprature", 1.1),
        "phases.1.temprature",
        "1.1",
        "did you mean `temperature`",
    ),
    "wrong_type": (changed("training.learning_rate", "fast"), "training.learning_rate", "'fast'", "expected a number"),
    "wrong_type_section": (changed("peft.r", "eight"), "peft.r", "'eight'", "expected an integer"),
    "num_generations_below_2": (changed("training.num_generations", 1), "training.num_generations", "1", ">= 2"),
    "phase_num_generations_below_2": (changed("phases.2.num_generations", 1), "phases.2.num_generations", "1", ">= 2"),
    "negative_learning_rate": (changed("training.learning_rate", -1e-5), "training.learning_rate", "-1e-05", ">= 0"),
    "overlong_buffer_too_long": (
        changed("training.overlong_buffer", 64),
        "training.overlong_buffer",
        "64",
        "shorter than max_completion_length",
    ),
    "phase_overlong_buffer_too_long": (
        changed("phases.1.overlong_buffer", 100),
        "phases.1",
        "overlong_buffer (100)",
        "max_completion_length (64)",
    ),
    "lora_rank_zero": (changed("peft.r", 0), "peft.r", "0", ">= 1"),
    "phase_lora_rank_zero": (changed("phases.2.lora_r", 0), "phases.2.lora_r", "0", ">= 1"),
    "unknown_reward": (changed("rewards.0.name", "boxed_answr"), "rewards.0.name", "'boxed_answr'", "available: "),
    "empty_phases": (changed("phases", []), "phases", "[]", "is empty"),
    "phase_without_max_steps": (
        changed("phases.0.max_steps", DELETE),
        "phases.0",
        "",
        "max_steps is required in a multi-phase run",
    ),
    "validation_reward_not_in_recipe": (
        changed("validation.reward", "kk_logic"),
        "validation.reward",
        "'kk_logic'",
        "names no reward of this recipe",
    ),
    "top_p_above_1": (changed("validation.top_p", 1.5), "validation.top_p", "1.5", "<= 1"),
    "unknown_builder": (changed("data.builder", "gsm8"), "data.builder", "'gsm8'", "did you mean `gsm8k`"),
    "unknown_template": (
        changed("data.template", "boxed_mat"),
        "data.template",
        "'boxed_mat'",
        "did you mean `boxed_math`? (available: ",
    ),
    "bad_scheduler_choice": (
        changed("training.lr_scheduler_type", "constnat"),
        "training.lr_scheduler_type",
        "constnat",
        "did you mean `constant`",
    ),
    "columns_on_a_fixed_builder": (
        changed("data.columns", {"prompt": "q"}),
        "data.columns",
        "'q'",
        "for jsonl/parquet",
    ),
    "reserved_training_key": (
        changed("training.reward_weights", [1.0]),
        "training.reward_weights",
        "[1.0]",
        "rewards[i].weight",
    ),
    "bad_reward_params": (changed("rewards.0.params", {"corect": 2.0}), "rewards.0.params", "corect", "boxed_answer"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_file_key_and_value(capsys, tmp_path, case):
    recipe, key_path, value_text, other = BAD_INPUTS[case]
    path = write(tmp_path, recipe)
    code, out, err = run_validate(capsys, path)
    assert code == 2
    assert str(path) in err and key_path in err and value_text in err and other in err, err
    assert "Traceback" not in err + out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [("validation.enabled", False, "validation is off"), ("training.plateau_metric", "eval_pass@2", "is never logged")],
)
def test_a_plateau_rule_that_could_never_fire_is_refused(capsys, tmp_path, key, value, message):
    """A plateau on a validation metric nobody logs would let every phase run to max_steps without a word."""
    recipe = changed(key, value)
    recipe["training"]["plateau_patience"] = 2
    recipe["training"].setdefault("plateau_metric", "eval_pass@1")
    code, _, err = run_validate(capsys, write(tmp_path, recipe))
    assert code == 2 and "training.plateau_metric" in err and message in err, err
    recipe["validation"]["ks"] = [1, 2]  # eval_pass@2 logged now
    recipe["validation"]["enabled"] = True
    code, _, err = run_validate(capsys, write(tmp_path, recipe))
    assert code == 0, err


@pytest.mark.parametrize(
    "key, value, message",
    [("training.max_steps", 5000, "each phase's max_steps sets its length"),
     ("training.top_p", 0.95, "phase 0 sets top_p = 0.8")],
)  # fmt: skip
def test_a_training_key_the_phases_override_everywhere_is_refused(capsys, tmp_path, key, value, message):
    """Accepted, then ignored: phase 0 starts from `training`, each later phase from the one before."""
    recipe = changed(key, value)
    recipe["phases"][0]["top_p"] = 0.8
    code, _, err = run_validate(capsys, write(tmp_path, recipe))
    assert code == 2 and key in err and message in err, err
    recipe["training"].pop("max_steps", None)
    recipe["training"]["top_p"] = 0.8  # the same value as phase 0's: nothing is lost
    code, _, err = run_validate(capsys, write(tmp_path, recipe))
    assert code == 0, err


def test_unknown_reward_lists_every_registered_reward(capsys, tmp_path):
    import rewards

    code, _, err = run_validate(capsys, write(tmp_path, changed("rewards.0.name", "no_such_reward")))
    available = err.split("available: ", 1)[1]
    assert code == 2 and len(rewards.available()) >= 5 and all(name in available for name in rewards.available()), err


@pytest.mark.parametrize(
    "key, value",
    [("data.source", "./no/such/folder"), ("model.name_or_path", "/no/such/model"),
     ("model.name_or_path", "runs/no-run/final")],  # two slashes: no hub id, a local path (it was taken for one)
)  # fmt: skip
def test_missing_local_paths_stop_validate_and_train(capsys, tmp_path, key, value):
    path = write(tmp_path, changed(key, value))
    for command in ("validate", "train"):
        code = main([command, str(path)])
        err = capsys.readouterr().err
        assert code == 2 and f"{key} = '{value}': local file or folder not found" in err and "Traceback" not in err
        relative = "relative paths are read from the current folder" in err  # where a relative one was looked for
        assert relative == (not value.startswith("/")), err
    assert not (tmp_path / "out").exists()
    # A recipe meant for another machine: `--no-machine-checks` checks the recipe alone.
    code, out, err = run_validate(capsys, path, "--no-machine-checks")
    assert code == 0 and "recipe only (--no-machine-checks)" in out, err


def test_hub_ids_are_said_to_be_unchecked(capsys, tmp_path):
    code, out, err = run_validate(capsys, write(tmp_path, BASE))
    assert code == 0, err
    assert "note: model.name_or_path = 'Qwen/Qwen2-0.5B' is a hub id: not checked here" in err
    assert "note: data.source" not in err  # gsm8k's default hub data set: no source key set


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without a GPU")
def test_bf16_without_a_gpu_stops_validate_and_train(capsys, tmp_path):
    path = write(tmp_path, changed("training.bf16", True))
    for command in ("validate", "train"):
        code = main([command, str(path)])
        err = capsys.readouterr().err
        assert code == 2 and "training.bf16 = True: needs a CUDA GPU and torch sees none here" in err, err
        assert "Traceback" not in err
    assert run_validate(capsys, path, "--no-machine-checks")[0] == 0
    assert run_validate(capsys, path, "--training.use_cpu", "true")[0] == 0  # bf16 autocast on the CPU is allowed


def test_yaml_syntax_error_names_the_line(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  name_or_path: x\ndata: [builder: gsm8k\nrewards: []\n")
    code, _, err = run_validate(capsys, path)
    assert code == 2 and str(path) in err and "YAML syntax error at line 4" in err and "Traceback" not in err


def test_duplicate_key_is_an_error(capsys, tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False) + "model: {name_or_path: other}\n")
    code, _, err = run_validate(capsys, path)
    assert code == 2 and "duplicate key 'model'" in err


def test_missing_file(capsys, tmp_path):
    code, _, err = run_validate(capsys, tmp_path / "nope.yaml")
    assert code == 2 and "nope.yaml" in err and "file not found" in err and "Traceback" not in err


def test_all_problems_reported_at_once(capsys, tmp_path):
    recipe = changed("training.learnig_rate", 1e-6)
    recipe["peft"]["r"] = 0
    code, _, err = run_validate(capsys, write(tmp_path, recipe))
    assert code == 2 and "(2 problems)" in err and "peft.r" in err and "learnig_rate" in err


def test_overrides_set_nested_keys_and_parse_yaml_scalars(tmp_path):
    path = write(tmp_path, BASE)
    recipe = load_recipe(
        path,
        [
            "--training.learning_rate",
            "3e-6",
            "--phases.2.temperature=1.4",
            "--peft.target_modules",
            "[q_proj, k_proj]",
            "--beta",
            "0.01",
        ],
    )
    assert recipe.training["learning_rate"] == 3e-6 and recipe.training["beta"] == 0.01
    assert recipe.resolved_phases[2].temperature == 1.4 and recipe.resolved_phases[1].temperature == 1.0
    assert recipe.peft.target_modules == ["q_proj", "k_proj"]
    assert recipe.raw["phases"][2]["temperature"] == 1.4  # the effective recipe is what gets saved with the run


def test_an_override_of_a_logging_key_goes_where_the_recipe_sets_it(tmp_path):
    """Issue 39: `--training.disable_tqdm true` on a recipe with `logging.disable_tqdm` was refused as set twice."""
    recipe = {**copy.deepcopy(BASE), "logging": {"disable_tqdm": False}}
    recipe = load_recipe(write(tmp_path, recipe), ["--training.disable_tqdm", "true", "--disable_tqdm", "true"])
    assert recipe.raw["logging"]["disable_tqdm"] is True and "disable_tqdm" not in recipe.raw["training"]
    assert recipe.training["disable_tqdm"] is True
    recipe = changed("training.logging_steps", 3)
    other_way = load_recipe(write(tmp_path, recipe), ["--logging.logging_steps", "7"])
    assert other_way.raw["training"]["logging_steps"] == 7 and "logging_steps" not in (other_way.raw.get("logging") or {})


def test_override_can_remove_a_section(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["--peft", "null", "--phases.2.lora_r", "null"])
    assert recipe.peft is None and recipe.peft_config() is None


@pytest.mark.parametrize(
    "tokens, message",
    [
        (["--phases.7.temperature", "1.0"], "phases.7: override index out of range (3 entries: 0-2)"),
        (["--training.learning_rate"], "override has no value"),
        (["learning_rate", "1"], "expected an override"),
        (["--training.learnig_rate", "1e-6"], "did you mean `learning_rate`"),
    ],
)
def test_bad_overrides_exit_2(capsys, tmp_path, tokens, message):
    code, _, err = run_validate(capsys, write(tmp_path, BASE), *tokens)
    assert code == 2 and message in err and "Traceback" not in err


def test_parse_overrides_reads_values_like_the_recipe_does():
    assert parse_overrides(["--a.b", "1e-6", "--c=true", "--d", "[1, 2]", "--e", "-3", "--f", "none"]) == [
        ("a.b", 1e-6),
        ("c", True),
        ("d", [1, 2]),
        ("e", -3),
        ("f", "none"),
    ]
    with pytest.raises(RecipeError):
        parse_overrides(["--a"])


def test_validate_as_a_process_is_light_and_clean(tmp_path):
    """The real command: exit codes, no traceback on stderr, and no model, trainer or data module imported."""
    good, bad = write(tmp_path, BASE, "good.yaml"), write(tmp_path, changed("training.num_generations", 1), "bad.yaml")
    probe = (
        "import sys; from prorl_trl.cli import main; code = main(sys.argv[1:]); "
        "heavy = [m for m in ('prorl_trl.trainer.trainer', 'trl.trainer.grpo_trainer', 'prorl_trl.evaluation.validation', "
        "'transformers.models.qwen2.modeling_qwen2', 'datasets') if m in sys.modules]; "
        "print('HEAVY', heavy); raise SystemExit(code)"
    )
    for path, expected in ((good, 0), (bad, 2)):
        result = subprocess.run(
            [sys.executable, "-c", probe, "validate", str(path)], capture_output=True, text=True, cwd=REPO
        )
        assert result.returncode == expected, result.stderr
        assert "HEAVY []" in result.stdout and "Traceback" not in result.stderr
    assert "training.num_generations = 1" in result.stderr
    assert not (tmp_path / "out").exists()


def test_validation_grades_with_the_named_reward_and_its_params(tmp_path):
    from datasets import Dataset

    from prorl_trl.recipe.run import _validation_callback

    recipe = load_recipe(
        write(tmp_path, BASE),
        [
            "--rewards",
            "[{name: boxed_answer}, {name: soft_overlong, params: {max_completion_len: 64, soft_punish_cache: 16}}]",
            "--validation.reward",
            "soft_overlong",
        ],
    )
    rows = Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]})
    callback = _validation_callback(recipe, rows, recipe.training_args(dry=True))
    graded = callback.reward_func
    assert "overlong" in getattr(graded, "__name__", type(graded).__name__).lower()
    # its params reached it: 60 tokens lie in the last 16 before 64 (penalised); the default limit (20480) would give 0
    assert graded(completions=["x"], completion_ids=[[0] * 60], answer=["2"])[0] < 0
    default = _validation_callback(load_recipe(write(tmp_path, BASE)), rows, recipe.training_args(dry=True))
    assert "boxed" in getattr(default.reward_func, "__name__", "").lower()


def test_model_section_reaches_the_loader_settings(tmp_path):
    recipe = load_recipe(
        write(tmp_path, BASE),
        ["--model.quantization", "4bit", "--model.attn_implementation", "sdpa", "--model.revision", "main"],
    )
    args = recipe.training_args(dry=True)
    assert args.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "sdpa", "revision": "main"}
    assert args.trust_remote_code is False and args.reward_weights == [1.0]
    quantization = recipe.quantization_config()
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert load_recipe(write(tmp_path, BASE), ["--model.quantization", "8bit"]).quantization_config().load_in_8bit
    assert load_recipe(write(tmp_path, BASE)).quantization_config() is None
    lora = recipe.peft_config()
    assert (lora.r, lora.lora_alpha, sorted(lora.target_modules), lora.task_type) == (8, 16, ["q_proj", "v_proj"], "CAUSAL_LM")


@pytest.mark.parametrize("value, expected", [(True, True), (False, None), ("latest", True), ("ckpt/dir", "ckpt/dir")])
def test_resume_from_checkpoint_in_a_recipe_keeps_meaning_latest(tmp_path, value, expected):
    """`training.resume_from_checkpoint: true` (a YAML boolean) still means the latest checkpoint now that the field is
    typed `str` (as HfArgumentParser needs it); text reads the same way, a path stays a path."""
    recipe = load_recipe(write(tmp_path, changed("training.resume_from_checkpoint", value)))
    assert recipe.training_args(dry=True).resume_from_checkpoint == expected


def test_a_tilde_in_output_dir_is_the_folder_training_writes_to(tmp_path, monkeypatch):
    """`~/run` is expanded as TrainingArguments expands it, so the guards that protect a used folder (and `--resume`,
    `--overwrite`) look at `$HOME/run`, where training writes, not at a literal `./~/run`."""
    from prorl_trl.recipe.output_folder import OutputFolderError, plan_start

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(tmp_path, BASE)
    path.write_text(path.read_text().replace(str(tmp_path / "out"), "~/run"))
    recipe = load_recipe(path)
    assert recipe.output_dir == str(tmp_path / "home" / "run") == recipe.training_args(dry=True).output_dir
    finished = tmp_path / "home" / "run" / "final"
    finished.mkdir(parents=True)
    (finished / "prorl_state.json").write_text('{"finished": true, "global_step": 1, "resets": 0}')
    with pytest.raises(OutputFolderError, match="home/run/ holds a finished run"):  # refused, as any used folder
        plan_start(recipe.output_dir)
