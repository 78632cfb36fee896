"""Data builders on the shared data sets (../shared/data) and the synthetic generators: prompt + gold columns as the
rewards expect them, templates for chat and plain prompts, the prompt-length filter, validation split and size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from datasets import Dataset
from tokenizers import processors

import rewards
from prorl_trl.cli import main
from prorl_trl.data import BUILDERS, build_dataset
from prorl_trl.data.builders import (
    gsm8k_gold,
    last_boxed_content,
    prompt_token_count,
    same_split_problem,
    scan_split_file,
)
from prorl_trl.data.checks import DataError
from prorl_trl.data.spec import DataSection
from prorl_trl.data.templates import KK_SYSTEM, TEMPLATES, render_prompt
from prorl_trl.demo import DEMO_RECIPE
from prorl_trl.tiny import build_tiny_tokenizer


def section(**kwargs) -> DataSection:
    return DataSection(**kwargs)


def test_gsm8k_gold_is_the_number_after_hashes_and_prompt_asks_for_boxed(shared_data):
    data = build_dataset(
        section(builder="gsm8k", source=str(shared_data / "gsm8k"), prompt_format="plain", max_train_samples=5)
    )
    first = json.loads(open(shared_data / "gsm8k" / "train.jsonl").readline())
    assert data.column_names == ["question", "answer", "prompt"]
    assert data[0]["question"] == first["question"] and data[0]["answer"] == "72"
    assert (
        isinstance(data[0]["prompt"], str)
        and "\\boxed{}" in data[0]["prompt"]
        and first["question"] in data[0]["prompt"]
    )
    assert len(data) == 5
    reward = rewards.get_reward("boxed_answer")
    assert reward(completions=["so \\boxed{72}", "\\boxed{71}"], answer=[data[0]["answer"]] * 2) == [1.0, -1.0]


def test_gsm8k_gold_extraction_edge_cases():
    assert gsm8k_gold("a\n#### 1,234") == "1234" and gsm8k_gold("#### -5") == "-5" and gsm8k_gold("####7.5") == "7.5"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        gsm8k_gold("the answer is 3")


def test_gsm8k_chat_prompt_and_validation_split(shared_data):
    spec = section(builder="gsm8k", source=str(shared_data / "gsm8k"), validation_split="test", validation_size=7)
    data = build_dataset(spec, "validation")
    first = json.loads(open(shared_data / "gsm8k" / "test.jsonl").readline())
    assert len(data) == 7 and data[0]["question"] == first["question"]
    assert data[0]["prompt"][-1]["role"] == "user" and first["question"] in data[0]["prompt"][-1]["content"]
    assert build_dataset(section(builder="gsm8k", source=str(shared_data / "gsm8k")), "validation") is None


def test_math500_keeps_level_and_subject(shared_data):
    data = build_dataset(
        section(builder="math500", source=str(shared_data / "math500"), max_train_samples=20)
    )  # split: test
    assert {"prompt", "answer", "level", "subject", "unique_id"} <= set(data.column_names)
    rows = [json.loads(line) for line in open(shared_data / "math500" / "test.jsonl")][:20]
    assert data["level"] == [r["level"] for r in rows] and data["subject"] == [r["subject"] for r in rows]
    assert data["answer"] == [r["answer"] for r in rows]


def test_kk_keeps_names_solution_and_uses_the_logic_rl_prompt(shared_data):
    spec = section(builder="kk", source=str(shared_data / "kk"), options={"num_people": 3}, max_train_samples=4)
    data = build_dataset(spec)
    row = json.loads(open(shared_data / "kk" / "3ppl_train.jsonl").readline())
    assert {"names", "solution", "solution_text_format", "prompt"} <= set(data.column_names)
    assert data[0]["names"] == row["names"] and data[0]["solution"] == row["solution"]
    assert (
        data[0]["prompt"][0] == {"role": "system", "content": KK_SYSTEM}
        and row["quiz"] in data[0]["prompt"][1]["content"]
    )
    truth = "\n".join(
        f"({i}) {n} is a {'knight' if k else 'knave'}"
        for i, (n, k) in enumerate(zip(row["names"], row["solution"], strict=True), 1)
    )
    reward = rewards.get_reward("kk_logic")
    good = f"<think>x</think><answer>{truth}</answer>"
    assert reward(completions=[good], **{k: [data[0][k]] for k in ("names", "solution", "solution_text_format")}) == [
        3.0
    ]


def test_areal_rows_give_answer_from_the_boxed_solution(shared_data, tmp_path):
    rows = [json.loads(line) for line in open(shared_data / "math500" / "test.jsonl")][:6]
    path = tmp_path / "areal.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"<|User|>{r['problem']}<|Assistant|><think>\n",
                    "solutions": [f"\\boxed{{{r['answer']}}}"],
                    "query_id": str(i),
                }
            )
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    data = build_dataset(section(builder="areal", source=str(path), prompt_format="plain"))
    assert data["answer"] == [r["answer"] for r in rows]
    assert data[0]["prompt"].startswith("<|User|>") and data[0]["solutions"] == [f"\\boxed{{{rows[0]['answer']}}}"]
    assert last_boxed_content("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}" and last_boxed_content("no box") is None


@pytest.mark.parametrize("builder", ["jsonl", "parquet"])
def test_table_builders_map_columns(shared_data, tmp_path, builder):
    source = shared_data / "math500" / "test.jsonl"
    if builder == "parquet":
        parquet = tmp_path / "math.parquet"
        Dataset.from_json(str(source)).select(range(10)).to_parquet(str(parquet))
        source = parquet
    spec = section(
        builder=builder,
        source=str(source),
        columns={"prompt": "problem", "answer": "answer", "level": "level"},
        template="boxed_math",
        max_train_samples=10,
    )
    data = build_dataset(spec)
    assert set(data.column_names) == {"question", "answer", "level", "prompt"} and len(data) == 10
    with pytest.raises(ValueError, match="no such column in any row"):
        build_dataset(section(builder=builder, source=str(source), columns={"prompt": "nope"}))


def test_prompt_length_filter_counts_template_tokens(shared_data):
    tokenizer = build_tiny_tokenizer()
    spec = dict(builder="gsm8k", source=str(shared_data / "gsm8k"), max_train_samples=50)
    full = build_dataset(section(**spec), tokenizer=tokenizer)
    lengths = [
        len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"])
        for p in full["prompt"]
    ]
    limit = sorted(lengths)[25]
    kept = build_dataset(section(**spec, max_prompt_tokens=limit), tokenizer=tokenizer)
    assert len(kept) == sum(length <= limit for length in lengths) and 0 < len(kept) < 50
    with pytest.raises(ValueError, match="no rows left: all 50 prompts are longer than data.max_prompt_tokens = 1"):
        build_dataset(section(**spec, max_prompt_tokens=1), tokenizer=tokenizer)


def test_synthetic_builders_give_disjoint_seeded_splits():
    arithmetic = section(
        builder="synthetic_arithmetic",
        options={"num_train": 12, "num_validation": 5, "seed": 3},
        validation_split="validation",
    )
    train, validation = build_dataset(arithmetic), build_dataset(arithmetic, "validation")
    assert len(train) == 12 and len(validation) == 5 and set(train["question"]).isdisjoint(validation["question"])
    assert build_dataset(arithmetic)["question"] == train["question"]  # deterministic
    reward = rewards.get_reward("boxed_answer")
    assert reward(completions=[f"\\boxed{{{a}}}" for a in train["answer"]], answer=train["answer"]) == [1.0] * 12
    kk = build_dataset(section(builder="synthetic_kk", options={"num_train": 4, "num_people": 3}))
    assert len(kk) == 4 and all(len(names) == 3 for names in kk["names"]) and isinstance(kk[0]["prompt"], list)


def test_plain_and_chat_rendering():
    assert render_prompt("Q?", "boxed_math", "plain").startswith("Question: Q?\n")
    chat = render_prompt("Q?", "think_answer", "chat", system_prompt="Be brief.")
    assert chat == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(messages, "raw", "chat") is messages


def test_every_builder_declares_its_hub_default_or_needs_a_source():
    assert BUILDERS["gsm8k"].default_source == "openai/gsm8k" and BUILDERS["gsm8k"].default_config == "main"
    assert BUILDERS["math500"].default_source == "HuggingFaceH4/MATH-500"
    assert BUILDERS["kk"].default_source == "K-and-K/knights-and-knaves"


# ------------------------------------------------------------------------------- held-out validation, settings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"builder": "gsm8k", "source": "gsm8k/train.jsonl"}, "validation reads the training file"),
        ({"builder": "math500", "source": "math500"}, "is the training split (MATH-500 has one split, test)"),
        ({"builder": "math500"}, "is the training split (MATH-500 has one split, test)"),  # hub default: no download
    ],
)
def test_validation_reading_the_training_split_is_refused(shared_data, kwargs, message):
    if "source" in kwargs:
        kwargs = {**kwargs, "source": str(shared_data / kwargs["source"])}
    spec = section(**kwargs, validation_split="test")
    with pytest.raises(DataError, match=re.escape(message)) as caught:
        build_dataset(spec, "validation")
    assert "data.validation_source" in str(caught.value)
    fixed = section(**kwargs, validation_split="test", validation_source=str(shared_data / "gsm8k" / "test.jsonl"))
    assert same_split_problem(fixed) is None
    folder = section(builder="gsm8k", source=str(shared_data / "gsm8k"), validation_split="test")
    assert same_split_problem(folder) is None


def test_validate_refuses_validation_on_the_training_file(shared_data, tiny_dir, tmp_path, capsys):
    recipe = Path(__file__).resolve().parent / "recipes" / "tiny_gsm8k.yaml"
    argv = ["validate", str(recipe), "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(tmp_path),
            "--data.source", str(shared_data / "gsm8k" / "train.jsonl")]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "validation reads the training file" in captured.out + captured.err


def test_shipped_recipes_pass_the_data_checks():
    recipes = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        raw = yaml.safe_load(path.read_text())
        data = dict(raw["data"])
        if raw.get("validation") is not None and data.get("validation_split") is None:
            data["validation_split"] = BUILDERS[data["builder"]].default_validation_split
        spec = section(**data)
        for which in ("train", "validation"):
            assert scan_split_file(spec, which) == [], path.name


def test_demo_recipe_validation_problems_are_held_out():
    spec = section(**DEMO_RECIPE["data"])
    train, validation = build_dataset(spec), build_dataset(spec, "validation")
    assert len(train) == DEMO_RECIPE["data"]["options"]["num_train"] and len(validation) == spec.validation_size
    assert set(train["question"]).isdisjoint(validation["question"])
    assert len(set(validation["question"])) == len(validation), "validation problems are distinct"
    kk = section(builder="synthetic_kk", options={"num_train": 30, "num_validation": 10, "num_people": 2},
                 validation_split="validation")  # fmt: skip
    assert set(build_dataset(kk)["question"]).isdisjoint(build_dataset(kk, "validation")["question"])


def test_a_problem_space_too_small_for_the_validation_size_is_refused():
    options = {**DEMO_RECIPE["data"]["options"], "num_validation": 41}  # the demo's task has 40 held-out problems
    spec = section(builder="synthetic_arithmetic", options=options, validation_split="validation")
    with pytest.raises(DataError, match="only 40 distinct validation problems .* fewer than the 41 asked for: lower "
                                        "num_validation or widen the task"):  # fmt: skip
        build_dataset(spec, "validation")


@pytest.mark.parametrize("prompt_format", ["chat", "plain"])
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_system_prompt_reaches_every_template(template, prompt_format):
    prompt = render_prompt("What is 2 + 2?", template, prompt_format, system_prompt="SYS")
    text = prompt if isinstance(prompt, str) else "\n".join(message["content"] for message in prompt)
    assert "SYS" in text and "What is 2 + 2?" in text
    if isinstance(prompt, list):
        assert prompt[0] == {"role": "system", "content": "SYS"}
    else:
        assert prompt.startswith("SYS")


def test_plain_length_filter_counts_the_special_tokens_trl_adds(tmp_path):
    """TRL 1.16 `_tokenize_prompts` encodes a plain prompt with `processing_class(text=prompts)` (special tokens on):
    a BOS-adding tokenizer makes a prompt of `cap` text tokens one over the cap."""
    tokenizer = build_tiny_tokenizer()
    bos = tokenizer.pad_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))]
    )
    prompt = render_prompt("2 + 2 = ?", "raw", "plain")
    text_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert prompt_token_count(prompt, tokenizer) == len(tokenizer(text=prompt)["input_ids"]) == text_tokens + 1
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": "4"}) + "\n" for q in ("2 + 2 = ?", "4 + 0 = ?")))
    at_cap = section(builder="jsonl", source=str(path), prompt_format="plain", max_prompt_tokens=text_tokens)
    with pytest.raises(DataError, match="no rows left"):  # both prompts are `text_tokens` + BOS long
        build_dataset(at_cap, tokenizer=tokenizer)
    at_cap.max_prompt_tokens = text_tokens + 1
    assert len(build_dataset(at_cap, tokenizer=tokenizer)) == 2


def test_areal_prompts_default_to_plain(tmp_path):
    path = tmp_path / "areal.jsonl"
    path.write_text(json.dumps({"prompt": "<|User|>1 + 1?<|Assistant|><think>\n", "solutions": ["\\boxed{2}"]}) + "\n")
    data = build_dataset(section(builder="areal", source=str(path)))
    assert data[0]["prompt"] == "<|User|>1 + 1?<|Assistant|><think>\n"
    assert isinstance(build_dataset(section(builder="jsonl", source=str(path), columns={"prompt": "prompt"}))[0][
        "prompt"], list), "other builders keep the chat default"  # fmt: skip


def test_settings_a_loader_would_ignore_are_refused(shared_data, tmp_path):
    local = str(shared_data / "gsm8k")
    for key, value in (("config", "socratic"), ("data_files", "train.jsonl")):
        with pytest.raises(DataError, match=f"`data.{key}` is ignored for a local source"):
            build_dataset(section(builder="gsm8k", source=local, **{key: value}))
    # the builder's own default config is no choice: a hub recipe (GSM8K `main`) pointed at a local copy runs
    assert len(build_dataset(section(builder="gsm8k", source=local, config="main"))) == 7473
    with pytest.raises(DataError, match="`data.config` is ignored by the `kk` builder"):
        build_dataset(section(builder="kk", source="K-and-K/knights-and-knaves", config="train"))
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}) + "\n")
    for key, value in (("template", "boxed_math"), ("system_prompt", "Be brief.")):
        with pytest.raises(DataError, match=f"chat message lists, .*`data.{key}` would be ignored"):
            build_dataset(section(builder="jsonl", source=str(path), **{key: value}))
    assert build_dataset(section(builder="jsonl", source=str(path)))[0]["prompt"][0]["content"] == "1 + 1?"
    # `raw` does nothing to a row (translated open-r1 configs write it): no refusal
    assert build_dataset(section(builder="jsonl", source=str(path), template="raw"))[0]["prompt"][0]["role"] == "user"
    # the hub file a recipe names (the RLinf recipe's data_files), with `--data.source` the local copy of it
    copy = tmp_path / "copy" / "train.jsonl"
    copy.parent.mkdir()
    copy.write_text((shared_data / "gsm8k" / "train.jsonl").read_text())
    assert len(build_dataset(section(builder="gsm8k", source=str(copy), data_files="train.jsonl"))) == 7473
