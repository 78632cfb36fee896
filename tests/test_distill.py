"""Distillation by rejection sampling: selection on constructed samples, then teacher -> student end to end."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch

from prorl_trl.distill import (
    DISTILLED_FILE,
    SUMMARY_FILE,
    DistillConfig,
    add_distill_arguments,
    check_distill_section,
    distill,
    distill_config_from_section,
    run_distill_section,
)
from prorl_trl.distill.cli import config_from_args
from prorl_trl.distill.rejection_sampling import (
    grade_samples, read_jsonl, rejection_sample, select_correct, write_jsonl,
)  # fmt: skip
from rewards import get_reward

CPU = {"use_cpu": True, "bf16": False, "report_to": "none"}
REPO = Path(__file__).resolve().parent.parent


def exact_answer(prompts, completions, completion_ids, answer, **kwargs):
    """+1 when the completion text is the gold answer, -1 otherwise, None when there is no gold."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if gold is None else (1.0 if text.strip() == gold else -1.0) for text, gold in zip(texts, answer)]


# ----------------------------------------------------------------------------------- selection, constructed


def test_rejection_sample_keeps_first_correct_sample_per_problem_only():
    problems = [
        {"prompt": "p0", "answer": "a"},
        {"prompt": "p1", "answer": "b"},
        {"prompt": "p2", "answer": "c"},
        {"prompt": "p3", "answer": None},  # the reward does not apply: never correct
    ]
    samples = {"p0": ["x", "a", "a "], "p1": ["y", "z", "w"], "p2": ["c", "q", "c"], "p3": ["", "k", "m"]}
    rows, stats = rejection_sample(problems, lambda prompts, n: [samples[p][:n] for p in prompts], exact_answer, 3)
    assert [(row["prompt"], row["completion"], row["answer"]) for row in rows] == [("p0", "a", "a"), ("p2", "c", "c")]
    assert (stats.num_problems, stats.num_kept, stats.num_samples, stats.num_correct_samples) == (4, 2, 12, 4)
    assert stats.kept_fraction == 0.5
    assert stats.teacher_accuracy == pytest.approx(4 / 12)


def test_correct_threshold_and_select_correct():
    problems = [{"prompt": "p", "answer": "a"}]
    # -1 / +1 rewards: a threshold above 1 makes nothing correct, one at -1 makes everything correct.
    assert grade_samples(exact_answer, problems, [["a", "b"]], correct_threshold=2.0) == [[False, False]]
    assert grade_samples(exact_answer, problems, [["a", "b"]], correct_threshold=-1.0) == [[True, True]]
    assert grade_samples(exact_answer, problems, [["b", "a"]]) == [[False, True]]
    assert select_correct([[False, True, True], [False, False], []]) == [1, None, None]


def test_grading_passes_columns_and_conversational_completions_like_trl():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, level=level)
        return exact_answer(prompts, completions, completion_ids, answer)

    prompt = [{"role": "user", "content": "2+2?"}]
    rows, _ = rejection_sample(
        [{"prompt": prompt, "answer": "4", "level": 3}],
        lambda prompts, n: [["5", "4"]],
        spy,
        num_samples=2,
    )
    assert seen["prompts"] == [prompt, prompt] and seen["level"] == [3, 3]
    assert seen["completions"] == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "4"}]]
    assert rows == [
        {"prompt": prompt, "answer": "4", "level": 3, "completion": [{"role": "assistant", "content": "4"}]}
    ]


def test_registry_correctness_is_used(tmp_path):
    reward = get_reward("boxed_answer")
    problems = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    samples = [["\\boxed{3}", "\\boxed{2}"], ["4", "\\boxed{5}"]]
    assert grade_samples(reward, problems, samples) == [[False, True], [False, False]]


def test_sample_fn_must_return_n_samples_per_prompt():
    with pytest.raises(ValueError, match="2 completions for each of the 1 prompts"):
        rejection_sample([{"prompt": "p", "answer": "a"}], lambda prompts, n: [["a"]], exact_answer, 2)


# ----------------------------------------------------------------------------------- end to end, tiny models


def _addition_problems(count: int, seed: int, distinct: bool = False) -> list[dict]:
    rng = random.Random(seed)
    if distinct:
        pairs = rng.sample([(a, b) for a in range(10) for b in range(10)], count)
    else:
        pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def _completion_nll(model, tokenizer, rows) -> float:
    """Mean cross-entropy of the completion tokens (+ EOS) given the prompt, computed independently of TRL."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = tokenizer(row["prompt"])["input_ids"]
            completion = tokenizer(row["completion"] + tokenizer.eos_token)["input_ids"]
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            total += torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum").item()
            count += len(completion)
    return total / count


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and the CI machine's cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, one_thread):
    """A tiny model taught single-digit addition (`a+b=` -> `\\boxed{a+b}`) just long enough to be sometimes right."""
    from prorl_trl.tiny import build_tiny

    model, tokenizer = build_tiny(seed=1)
    rows = _addition_problems(80 * 32, seed=123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(80):
        batch = rows[step * 32 : (step + 1) * 32]
        prompts = [tokenizer(row["prompt"])["input_ids"] for row in batch]
        full = [
            p + tokenizer(f"\\boxed{{{row['answer']}}}{tokenizer.eos_token}")["input_ids"]
            for p, row in zip(prompts, batch)
        ]
        width = max(map(len, full))
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in full])
        labels = torch.full_like(input_ids, -100)
        for i, (p, ids) in enumerate(zip(prompts, full)):
            labels[i, len(p) : len(ids)] = input_ids[i, len(p) : len(ids)]
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path_factory.mktemp("teacher") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _config(teacher_dir, student, out, **overrides) -> DistillConfig:
    settings = dict(
        teacher=str(teacher_dir),
        student=str(student),
        dataset="synthetic_arithmetic",
        reward="boxed_answer",
        output_dir=str(out),
        samples=5,
        temperature=1.0,
        max_completion_length=8,
        sampling_batch_size=64,
        num_train_epochs=4,
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        max_length=64,
        sft_kwargs={"gradient_checkpointing": False, "logging_steps": 1000},
        **CPU,
    )
    settings.update(overrides)
    return DistillConfig(**settings)


def test_distill_end_to_end_keeps_verified_samples_and_lowers_student_loss(
    teacher_dir, tiny_dir, tmp_path, one_thread
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reward = get_reward("boxed_answer")
    # Problems with an unreachable gold answer are the ones the teacher can never get right.
    impossible = [{"prompt": f"{a}+{a}+{a}=", "answer": "99"} for a in range(4)]
    problems = _addition_problems(36, seed=7, distinct=True) + impossible
    config = _config(teacher_dir, tiny_dir, tmp_path / "out")
    summary = distill(config, problems=problems, reward_fn=reward)

    rows = read_jsonl(tmp_path / "out" / DISTILLED_FILE)
    # The teacher is sometimes right: some problems are kept, not all; at most one row per problem.
    assert 0 < len(rows) < len(problems)
    assert len({row["prompt"] for row in rows}) == len(rows)
    assert not [row for row in rows if row["answer"] == "99"]
    assert all(set(row) == {"prompt", "completion", "answer"} for row in rows)
    # Every kept completion is correct according to the reward, graded afresh.
    assert reward.is_correct(completions=[r["completion"] for r in rows], answer=[r["answer"] for r in rows]) == [
        True
    ] * len(rows)
    assert summary["num_kept"] == len(rows) and summary["kept_fraction"] == pytest.approx(len(rows) / len(problems))
    assert 0 < summary["teacher_accuracy"] < 1

    # The student (HF format, loads as a plain model) fits the distilled set better than before.
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    before = _completion_nll(AutoModelForCausalLM.from_pretrained(tiny_dir), tokenizer, rows)
    after = _completion_nll(AutoModelForCausalLM.from_pretrained(summary["student_path"]), tokenizer, rows)
    assert after < 0.7 * before
    assert summary["loss_after"] < summary["loss_before"]

    # A second run with the same settings reuses the finished work.
    again = distill(config, problems=problems, reward_fn=reward, sample_fn=lambda prompts, n: pytest.fail("resampled"))
    assert again["student_path"] == summary["student_path"]


# ----------------------------------------------------------------------------------- CLI and recipe section


def test_cli_flags_build_the_config(tmp_path):
    parser = add_distill_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--teacher", "t", "--student", "s", "--dataset", "kk", "--reward", "kk_logic", "--out", str(tmp_path),
         "--samples", "3", "--temperature", "0.8", "--dataset_kwargs", '{"split": "train"}', "--use_peft", "true",
         "--max_problems", "none", "--lora_target_modules", "q_proj", "v_proj"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.samples, config.temperature, config.dataset_kwargs) == (3, 0.8, {"split": "train"})
    assert (
        config.use_peft is True and config.max_problems is None and config.lora_target_modules == ["q_proj", "v_proj"]
    )
    assert config.output_dir == str(tmp_path) and config.num_train_epochs == 4.0


def test_cli_rejects_bad_settings_before_loading_anything(tmp_path, capsys):
    from prorl_trl.cli import main

    base = ["--student", "s", "--dataset", "kk", "--reward", "kk_logic", "--out", str(tmp_path / "o")]
    assert main(["distill", "--teacher", str(tmp_path / "missing"), *base]) == 2
    assert "Teacher checkpoint not found" in capsys.readouterr().err
    assert main(["distill", "--teacher", str(tmp_path), "--temperature", "0", *base]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["distill", "--teacher", str(tmp_path), *base, "--dataset", "gsm8"]) == 2
    assert "unknown dataset 'gsm8' (did you mean 'gsm8k'?)" in capsys.readouterr().err
    assert main(["distill", "--teacher", str(tmp_path), *base, "--reward", "boxed"]) == 2
    assert "unknown reward 'boxed'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_section_validation_names_the_bad_key():
    good = {"teacher": "t", "dataset": {"builder": "kk", "split": "test"}, "reward": "kk_logic", "samples": 5}
    config = distill_config_from_section(good, "student/path", "out")
    assert (config.dataset, config.dataset_kwargs, config.student) == ("kk", {"split": "test"}, "student/path")
    assert check_distill_section(good) == []
    assert check_distill_section({**good, "sample": 5}) == [
        ("distill.sample", f"unknown key (did you mean 'samples'?); allowed: {', '.join(_section_keys())}.")
    ]
    with pytest.raises(ValueError, match=r"distill\.student: unknown key \(the recipe's `model:` section"):
        distill_config_from_section({**good, "student": "x"})
    with pytest.raises(ValueError, match=r"distill\.reward: required"):
        distill_config_from_section({"teacher": "t", "dataset": "kk"})
    with pytest.raises(ValueError, match="samples` must be >= 1"):
        distill_config_from_section({**good, "samples": 0})
    with pytest.raises(ValueError, match="unknown reward 'kk_logc' \\(did you mean 'kk_logic'\\?\\)"):
        distill_config_from_section({**good, "reward": "kk_logc"})
    with pytest.raises(ValueError, match="unknown key 'splt' \\(did you mean 'split'\\?\\)"):
        distill_config_from_section({**good, "dataset": {"builder": "kk", "splt": "train"}})


def _section_keys():
    from dataclasses import fields

    owned = ("student", "model_init_kwargs", "tokenizer_name_or_path", "trust_remote_code", "output_dir")
    return [f.name for f in fields(DistillConfig) if f.name not in owned]


def test_sft_kwargs_must_be_fields_of_the_installed_sft_config(tmp_path, capsys):
    """`sft_kwargs` go to `trl.SFTConfig(**...)` after the teacher sampling: a key it has no field for (transformers
    5 has no `warmup_ratio`) is refused by the config, the section check and `validate`, naming the key."""
    from prorl_trl.cli import main

    good = {"teacher": "t", "dataset": "kk", "reward": "kk_logic"}
    assert check_distill_section({**good, "sft_kwargs": {"warmup_steps": 0.1, "lr_scheduler_type": "cosine"}}) == []
    [(path, message)] = check_distill_section({**good, "sft_kwargs": {"warmup_ratio": 0.1}})
    assert path == "distill" and "`sft_kwargs.warmup_ratio` is not a trl.SFTConfig field" in message
    assert "warmup_steps below 1 is read as the same ratio" in message
    with pytest.raises(ValueError, match=r"`sft_kwargs.lerning_rate_typo` is not a trl.SFTConfig field"):
        DistillConfig(teacher="t", dataset="kk", reward="kk_logic", output_dir="o", sft_kwargs={"lerning_rate_typo": 1})
    recipe = REPO / "recipes" / "distill_kk_qwen2.5_1.5b.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("warmup_steps: 0.03", "warmup_ratio: 0.1"))
    assert main(["validate", str(bad), "--no-machine-checks"]) == 2
    assert "`sft_kwargs.warmup_ratio` is not a trl.SFTConfig field" in capsys.readouterr().err


def _shipped_distill_recipes() -> list[Path]:
    import yaml

    recipes = sorted((REPO / "recipes").rglob("*.yaml"))
    return [path for path in recipes if "distill" in (yaml.safe_load(path.read_text()) or {})]


@pytest.mark.parametrize("recipe", _shipped_distill_recipes(), ids=lambda path: path.name)
def test_shipped_distill_recipes_use_sft_config_fields_and_validate(recipe, capsys):
    import dataclasses

    import yaml
    from trl import SFTConfig

    from prorl_trl.cli import main

    sft_kwargs = yaml.safe_load(recipe.read_text())["distill"].get("sft_kwargs") or {}
    assert set(sft_kwargs) <= {spec.name for spec in dataclasses.fields(SFTConfig)}
    assert main(["validate", str(recipe), "--no-machine-checks"]) == 0, capsys.readouterr().err


def test_section_takes_the_student_settings_from_the_recipe_model_section():
    """The recipe's `model:` loading options, tokenizer and trust_remote_code reach the distillation, and the
    section may not set them itself."""
    from prorl_trl.recipe.schema import ModelSection

    model = ModelSection(
        name_or_path="org/student", dtype="bfloat16", attn_implementation="sdpa", revision="v1",
        tokenizer_name_or_path="org/tokenizer", trust_remote_code=True,
    )  # fmt: skip
    config = distill_config_from_section({"teacher": "t", "dataset": "kk", "reward": "kk_logic"}, model, "out")
    assert config.student == "org/student"
    assert config.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "sdpa", "revision": "v1"}
    assert (config.tokenizer_name_or_path, config.trust_remote_code) == ("org/tokenizer", True)
    plain = distill_config_from_section({"teacher": "t", "dataset": "kk", "reward": "kk_logic"}, "student/path")
    assert (plain.student, plain.model_init_kwargs, plain.tokenizer_name_or_path) == ("student/path", {}, None)
    for key in ("trust_remote_code", "model_init_kwargs", "tokenizer_name_or_path"):
        [(path, message)] = check_distill_section({"teacher": "t", "dataset": "kk", "reward": "kk_logic", key: 1})
        assert path == f"distill.{key}" and "the recipe's `model:` section" in message


def test_section_defaults_to_the_recipe_data():
    from prorl_trl.data.spec import DataSection

    data = DataSection(builder="kk", options={"num_people": 3}, validation_split="test")
    config = distill_config_from_section({"teacher": "t", "reward": "kk_logic"}, "m", "o", data=data)
    # Only the keys that differ from the data section's defaults are carried.
    assert (config.dataset, config.dataset_kwargs) == (
        "kk",
        {"options": {"num_people": 3}, "validation_split": "test"},
    )


def test_run_distill_section_chains_data_builder_teacher_and_lora_student(teacher_dir, tiny_dir, tmp_path, one_thread):
    """The recipe path: builder data (`jsonl`), registry reward by name, LoRA student merged into a plain model."""
    from transformers import AutoModelForCausalLM

    write_jsonl(_addition_problems(24, seed=11, distinct=True), tmp_path / "problems.jsonl")
    section = {
        "teacher": str(teacher_dir), "reward": "boxed_answer", "samples": 4, "max_completion_length": 8,
        "dataset": {"builder": "jsonl", "source": str(tmp_path / "problems.jsonl"), "template": "raw",
                    "prompt_format": "plain", "columns": {"prompt": "prompt", "answer": "answer"}},
        "use_peft": True, "lora_r": 8, "lora_alpha": 16, "learning_rate": 5e-3, "num_train_epochs": 3,
        "per_device_train_batch_size": 4, "max_length": 64, "sft_kwargs": {"gradient_checkpointing": False}, **CPU,
    }  # fmt: skip
    student_path = run_distill_section(section, str(tiny_dir), tmp_path / "distill")

    summary = json.loads((tmp_path / "distill" / SUMMARY_FILE).read_text())
    assert summary["student_path"] == student_path and 0 < summary["num_kept"] <= 24
    assert summary["loss_after"] < summary["loss_before"]
    saved = sorted(p.name for p in (tmp_path / "distill" / "model").iterdir())
    assert "config.json" in saved and not any("adapter" in name for name in saved)  # merged, not an adapter
    model = AutoModelForCausalLM.from_pretrained(student_path)
    assert not any("lora" in name for name, _ in model.named_parameters())
    # A resumed recipe does not redo the work.
    weights = tmp_path / "distill" / "model" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert run_distill_section(section, str(tiny_dir), tmp_path / "distill") == student_path
    assert weights.stat().st_mtime_ns == stamp
    # Stored teacher samples drawn at another temperature are never mixed in: refused before any sampling.
    with pytest.raises(ValueError, match=r"sampled with other settings \(temperature: 1\.0 -> 0\.7\)"):
        run_distill_section({**section, "temperature": 0.7}, str(tiny_dir), tmp_path / "distill")


def test_shipped_recipe_is_the_seed_setup():
    import yaml

    from prorl_trl.recipe import recipe_from_dict
    from prorl_trl.recipe.schema import TOP_LEVEL_KEYS

    raw = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "recipes" / "distill_kk_qwen2.5_1.5b.yaml").read_text()
    )
    section = raw["distill"] if "distill" in TOP_LEVEL_KEYS else raw.pop("distill")  # until recipe.py knows it
    recipe = recipe_from_dict(raw, "distill_kk_qwen2.5_1.5b.yaml", world_size=1, dry=True)
    config = distill_config_from_section(section, recipe.model.name_or_path, "out", data=recipe.data)
    assert config.student == "Qwen/Qwen2.5-1.5B-Instruct" and config.reward == "kk_logic"
    assert (config.dataset, config.dataset_kwargs["options"]) == ("kk", {"num_people": 5})
    assert (config.samples, config.temperature, config.num_train_epochs) == (5, 1.0, 4)


def test_train_student_on_conversational_rows(tiny_dir, tmp_path, one_thread):
    """Chat-format distilled rows (prompt messages + assistant completion) train through the chat template."""
    from prorl_trl.distill.sft import train_student

    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "completion": [{"role": "assistant", "content": f"{a + b}"}],
        }
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (4, 4), (6, 3), (2, 5)]
    ]
    config = _config(tiny_dir, tiny_dir, tmp_path / "chat", num_train_epochs=3)
    model_dir, losses = train_student(config, rows, str(tiny_dir))
    assert losses["loss_after"] < losses["loss_before"]
    assert (model_dir / "config.json").is_file()


def test_student_loads_with_the_model_settings_and_tokenizer(tiny_dir, tmp_path, one_thread):
    """`model_init_kwargs` (a recipe's dtype, revision, ...) reach TRL's model loading and `tokenizer_name_or_path`
    is the tokenizer trained with and saved beside the student (the phases then load it from there)."""
    from transformers import AutoTokenizer

    from prorl_trl.distill.sft import train_student

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.model_max_length = 4321  # marks this copy
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = [{"prompt": f"{a}+{b}=", "completion": f"{a + b}"} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    config = _config(
        tiny_dir, tiny_dir, tmp_path / "out", num_train_epochs=1, model_init_kwargs={"dtype": "bfloat16"},
        tokenizer_name_or_path=str(tmp_path / "tokenizer"),
    )  # fmt: skip
    model_dir, _ = train_student(config, rows, str(tiny_dir))
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoTokenizer.from_pretrained(model_dir).model_max_length == 4321
    assert AutoTokenizer.from_pretrained(tiny_dir).model_max_length != 4321


def test_two_processes_split_the_sampling_and_merge_one_distilled_set(teacher_dir, tiny_dir, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo on CPU): each process samples half the problems, one merged set, DDP SFT."""
    import os
    import subprocess
    import sys

    problems = _addition_problems(12, seed=5, distinct=True)
    write_jsonl(problems, tmp_path / "problems.jsonl")
    data = {"source": str(tmp_path / "problems.jsonl"), "template": "raw", "prompt_format": "plain"}
    data["columns"] = {"prompt": "prompt", "answer": "answer"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "prorl_trl", "distill", "--teacher", str(teacher_dir), "--student", str(tiny_dir), "--dataset", "jsonl",
        "--dataset_kwargs", json.dumps(data), "--reward", "boxed_answer", "--out", str(tmp_path / "out"),
        "--samples", "3", "--max_completion_length", "8", "--num_train_epochs", "1", "--max_length", "64",
        "--per_device_train_batch_size", "4", "--use_cpu", "true", "--bf16", "false",
        "--sft_kwargs", '{"gradient_checkpointing": false}',
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    samples = tmp_path / "out" / "samples"
    part_sizes = [len(read_jsonl(samples / f"teacher-part{rank}.jsonl")) for rank in (0, 1)]
    assert part_sizes == [6 * 3, 6 * 3]  # every process drew its own half
    summary = json.loads((tmp_path / "out" / SUMMARY_FILE).read_text())
    rows = read_jsonl(tmp_path / "out" / DISTILLED_FILE)
    assert summary["num_problems"] == 12 and summary["num_samples"] == 36 and summary["num_kept"] == len(rows)
    assert len({row["prompt"] for row in rows}) == len(rows)
    assert not list((tmp_path / "out").glob("distill_part*"))
    assert (tmp_path / "out" / "model" / "config.json").is_file()


def test_recipe_with_distill_section_trains_the_phases_from_the_distilled_student(
    teacher_dir, tiny_dir, tmp_path, one_thread
):
    """`prorl-trl train RECIPE` with a `distill:` section: distillation first (on the recipe's data), then ProRL."""
    import yaml
    from safetensors.torch import load_file

    from prorl_trl.cli import main

    write_jsonl(_addition_problems(20, seed=3, distinct=True), tmp_path / "problems.jsonl")
    recipe = {
        "model": {"name_or_path": str(tiny_dir), "dtype": "float32"},
        "peft": None,
        "distill": {
            "teacher": str(teacher_dir), "reward": "boxed_answer", "samples": 3, "max_completion_length": 8,
            "num_train_epochs": 2, "learning_rate": 3e-3, "per_device_train_batch_size": 4, "max_length": 64,
            "sft_kwargs": {"gradient_checkpointing": False}, **CPU,
        },
        "data": {
            "builder": "jsonl", "source": str(tmp_path / "problems.jsonl"), "template": "raw",
            "prompt_format": "plain", "columns": {"prompt": "prompt", "answer": "answer"},
        },
        "rewards": [{"name": "boxed_answer"}],
        "training": {
            "output_dir": str(tmp_path / "run"), "use_cpu": True, "bf16": False, "learning_rate": 1e-4,
            "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
            "save_strategy": "no", "seed": 0,
        },
        "phases": [{"name": "rl", "max_steps": 2}],
        "logging": {"report_to": "none", "logging_steps": 1, "disable_tqdm": True},
    }  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "recipe.yaml")]) == 0

    summary = json.loads((tmp_path / "run" / "distill" / SUMMARY_FILE).read_text())
    assert summary["num_problems"] == 20 and summary["num_kept"] > 0  # distilled on the recipe's `data:`
    original, distilled, final = (
        load_file(path / "model.safetensors")
        for path in (tiny_dir, tmp_path / "run" / "distill" / "model", tmp_path / "run" / "final")
    )

    def distance(a, b):
        return sum((a[name] - b[name]).float().norm().item() for name in a)

    # The two RL steps start from the distilled student, not from the recipe's original model.
    assert distance(final, distilled) < 0.1 * distance(final, original)


def _tiny_distill_args(tiny_dir, out, num_train: int, samples: int, cap: int, min_kept: int) -> list[str]:
    """`prorl-trl distill` with the tiny model as teacher and student on generated arithmetic."""
    return [
        "distill", "--teacher", str(tiny_dir), "--student", str(tiny_dir), "--dataset", "synthetic_arithmetic",
        "--dataset-kwargs", json.dumps({"options": {"num_train": num_train}}), "--reward", "boxed_answer",
        "--out", str(out), "--samples", str(samples), "--max-completion-length", str(cap), "--use-cpu", "true",
        "--bf16", "false", "--min-kept", str(min_kept),
    ]  # fmt: skip


def test_min_kept_refuses_to_fine_tune_the_student_on_too_few_problems(tiny_dir, tmp_path, capsys, caplog, one_thread):
    """A random tiny teacher solves (almost) nothing: distill warns, and `--min-kept` stops it before the SFT with
    exit 1, keeping the distilled set to look at and writing no student."""
    from prorl_trl.cli import main

    out = tmp_path / "out"
    code = main(_tiny_distill_args(tiny_dir, out, num_train=16, samples=2, cap=4, min_kept=4))
    err = capsys.readouterr().err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["num_problems"] == 16 and summary["num_kept"] < 2, summary
    assert code == 1 and f"distillation kept {summary['num_kept']} of 16 problems" in err
    assert "fewer than min_kept = 4: the student is not fine-tuned" in err and "Traceback" not in err
    assert f"Only {summary['num_kept']} of 16 problems" in caplog.text and "set --min-kept" in caplog.text  # warned
    assert (out / DISTILLED_FILE).is_file() and not (out / "model").exists()


def test_a_teacher_that_solves_nothing_stops_cleanly_whatever_min_kept(tiny_dir, tmp_path, capsys, one_thread):
    """`--min-kept 0` accepts few rows, but with none the SFT raised a traceback; it is now the same clean stop."""
    from prorl_trl.cli import main

    out = tmp_path / "out"
    code = main(_tiny_distill_args(tiny_dir, out, num_train=8, samples=1, cap=2, min_kept=0))
    err = capsys.readouterr().err
    assert json.loads((out / SUMMARY_FILE).read_text())["num_kept"] == 0
    assert code == 1 and "kept none of 8 problems" in err and "Traceback" not in err, err[-2000:]
    assert not (out / "model").exists()


# ----------------------------------------------------------------------------------- the output folder (--out)


class SamplingReached(RuntimeError):
    exit_status = 3  # `prorl-trl` exits with it: the run got past its checks to the teacher


@pytest.fixture
def refused_before_loading(monkeypatch):
    """`prorl-trl distill` whose teacher sampling (the first work: tokenizer, teacher) is a recorder that stops the
    run with exit 3: a refusal must come before it."""
    calls = []

    def record(config, *args):
        calls.append(config)
        raise SamplingReached("sampling reached")

    monkeypatch.setattr("prorl_trl.distill.run._build_distilled_set", record)
    return calls


def _quick_args(tmp_path, out, *flags: str) -> list[str]:
    teacher = tmp_path / "teacher"
    teacher.mkdir(exist_ok=True)
    return ["distill", "--teacher", str(teacher), "--student", "s", "--dataset", "synthetic_arithmetic",
            "--reward", "boxed_answer", "--out", str(out), *flags]  # fmt: skip


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_out_holding_files_distill_writes_over_or_deletes_is_refused(tmp_path, capsys, refused_before_loading):
    """The review's case: `--out` holding the user's own `distilled.jsonl`, `distill_part0.jsonl` and `model/`:
    distill wrote its set over the first, wrote and then deleted the second, and saved the student into the third.
    Now exit 2 before any model loads, nothing changed, even with --allow-other-files."""
    from prorl_trl.cli import main

    out = tmp_path / "project"
    for name in ("distilled.jsonl", "distill_part0.jsonl", "model/config.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text('{"mine": true}\n')
    before = _files(out)
    for flags in ((), ("--allow-other-files",)):
        assert main(_quick_args(tmp_path, out, *flags)) == 2
        err = capsys.readouterr().err
        assert f"{out}/ holds distill_part0.jsonl, distilled.jsonl, model/, named like outputs this run writes" in err
        assert "Nothing was changed" in err and "choose another --out" in err, err
    assert _files(out) == before and refused_before_loading == []


def test_an_out_holding_other_files_needs_allow_other_files(tmp_path, capsys, refused_before_loading):
    from prorl_trl.cli import main

    out = tmp_path / "project"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(_quick_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"{out}/ holds files this run did not write: notes.txt. Nothing was changed." in err, err
    assert "Choose a new or empty --out, or pass --allow-other-files" in err and refused_before_loading == []
    assert main(_quick_args(tmp_path, out, "--allow_other_files")) == 3 and len(refused_before_loading) == 1
    assert (out / "notes.txt").read_text() == "mine"


def test_an_out_holding_another_commands_run_or_a_file_is_refused_whatever_the_flags(
    tmp_path, capsys, refused_before_loading
):
    """Never among a training run's (or an ablation's) outputs, whose manifest would then list the student as the
    run's (`train --overwrite` deleting it), nor where a file is."""
    from prorl_trl.cli import main
    from prorl_trl.trainer.manifest import MANIFEST_NAME, record_outputs

    run, ablation, file = tmp_path / "run", tmp_path / "ablation", tmp_path / "a-file"
    record_outputs(run, ["phase-0/"])
    ablation.mkdir()
    (ablation / MANIFEST_NAME).write_text(json.dumps({"format": 1, "kind": "ablate", "paths": ["summary.csv"]}))
    file.write_text("mine")
    expected = {
        run: "holds the outputs of `prorl-trl train`", ablation: "holds the outputs of `prorl-trl ablate`",
        file: "is a file, not a folder",
    }  # fmt: skip
    for out, message in expected.items():
        for flags in ((), ("--allow-other-files",)):
            assert main(_quick_args(tmp_path, out, *flags)) == 2
            err = capsys.readouterr().err
            assert message in err and "Nothing was changed" in err, err
    assert refused_before_loading == [] and file.read_text() == "mine"
    from prorl_trl.recipe.output_folder import OutputFolderError

    config = DistillConfig(teacher="t", student="s", dataset="kk", reward="kk_logic", output_dir=str(run))
    with pytest.raises(OutputFolderError, match="holds the outputs of `prorl-trl train`"):
        distill(config, sample_fn=lambda prompts, n: pytest.fail("sampled"))  # the API (a recipe section, a notebook)


def test_a_distillation_from_before_manifests_is_its_own_folder(tmp_path, refused_before_loading):
    """A folder a distillation wrote before manifests (its summary or its teacher's samples there) is re-run into
    as before, by the exact names it writes; a user's file beside them needs no flag (as `train --resume`)."""
    from prorl_trl.cli import main
    from prorl_trl.trainer.manifest import MANIFEST_NAME, read_manifest

    out = tmp_path / "old"
    (out / "samples").mkdir(parents=True)
    (out / "samples" / "teacher-part0.meta.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert main(_quick_args(tmp_path, out)) == 3
    (out / MANIFEST_NAME).unlink()  # what the run just recorded
    (out / SUMMARY_FILE).write_text("{}")
    (out / DISTILLED_FILE).write_text("")
    (out / "model").mkdir()
    assert main(_quick_args(tmp_path, out)) == 3 and len(refused_before_loading) == 2
    assert {"samples/", SUMMARY_FILE, DISTILLED_FILE, "model/"} <= set(read_manifest(out))


def test_a_rerun_into_its_own_folder_goes_on_and_the_manifest_lists_what_it_wrote(
    tiny_dir, tmp_path, capsys, caplog, one_thread
):
    """The first run records what it writes (kind `distill`) before writing it; the same command again reuses the
    distilled set there, as before."""
    from prorl_trl.cli import main
    from prorl_trl.trainer.manifest import manifest_kind, read_manifest

    out = tmp_path / "out"
    args = _tiny_distill_args(tiny_dir, out, num_train=8, samples=1, cap=2, min_kept=4)
    assert main(args) == 1  # too few kept: stops before the SFT
    assert manifest_kind(out) == "distill"
    assert {DISTILLED_FILE, SUMMARY_FILE, "samples/", "model/", "distill_part0.jsonl"} <= set(read_manifest(out))
    assert main(args) == 1 and "Reusing the distilled set" in caplog.text
    assert "fewer than min_kept = 4" in capsys.readouterr().err
