"""`validate` refuses what `train` refuses, with the same message, and data columns survive (issue 28).

Gold columns the rewards read stay in a user's table without a `data.columns` entry; a missing one names the mapping
to add, in `validate`, `train` and `eval` (before sampling). W&B without credentials, an `output_dir` that is a file,
data whose prompts are all over `max_prompt_tokens`, and prompts with control characters stop both commands; a UTF-8
BOM is read. Everything runs through `prorl_trl.cli.main` on a tiny local model; nothing trains.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest
import yaml
from test_preflight import GOOD_ROW, data_recipe, lines

from prorl_trl.cli import main
from prorl_trl.recipe.trackers import wandb_can_log_in


def write_recipe(
    tmp_path: Path, model: Path, content: bytes, name: str = "data.jsonl", rewards: list | None = None, **changes
) -> Path:
    """A recipe on a data file holding `content`; `changes` are `section__key` overrides of `data_recipe`'s recipe
    (`data__columns=None` drops the column map)."""
    source = tmp_path / name
    source.write_bytes(content)
    raw = data_recipe(tmp_path, model, source)
    raw["rewards"] = rewards or raw["rewards"]
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        if value is None:
            raw[section].pop(key, None)
        else:
            raw[section][key] = value
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def refused_by_both(capsys, recipe: Path, *expected: str) -> str:
    """`validate` and `train` exit 2 with the same message holding every `expected` text (validate files it under
    the recipe key, train under the data file: the line from `expected[0]` on is the same); nothing is written.
    Returns validate's line."""
    messages = []
    for command in ("validate", "train"):
        code = main([command, str(recipe)])
        out, err = capsys.readouterr()
        assert code == 2, (command, out, err)
        assert all(text in err for text in expected), (command, err)
        assert "Traceback" not in out + err
        line = next(line for line in err.splitlines() if expected[0] in line)
        messages.append(line)
    assert messages[0][messages[0].index(expected[0]) :] == messages[1][messages[1].index(expected[0]) :], messages
    out = recipe.parent / "out"  # the run folder holds no output (`train` may have recorded its manifest)
    assert not [path.name for path in (out.iterdir() if out.exists() else []) if not path.name.startswith(".")]
    return messages[0]


# ------------------------------------------------------------------------------------------------- data columns


def test_a_jsonl_with_prompt_and_answer_validates_with_no_column_map(capsys, tmp_path, tiny_dir):
    rows = lines({"prompt": "1+1=", "answer": "2", "id": 1}, {"prompt": "2+2=", "answer": "4", "id": 2})
    recipe = write_recipe(tmp_path, tiny_dir, rows, data__columns=None)
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err
    # A reward reading another column (`answer_key`) keeps that column, also without a map.
    rows = lines({"prompt": "1+1=", "final": "2"}, {"prompt": "2+2=", "final": "4"})
    rewards = [{"name": "boxed_answer", "params": {"answer_key": "final"}}]
    recipe = write_recipe(tmp_path, tiny_dir, rows, rewards=rewards, data__columns=None)
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_a_table_keeps_every_column_its_rewards_read(tmp_path):
    import rewards
    from prorl_trl.data import build_dataset
    from prorl_trl.data.spec import DataSection

    source = tmp_path / "puzzles.jsonl"
    source.write_bytes(lines({"prompt": "Ann says ...", "names": ["Ann"], "solution": [True], "final": "1", "x": 0}))
    readers = [rewards.get_reward("kk_logic"), rewards.get_reward("cosine_scaled", answer_key="final")]
    rows = build_dataset(DataSection(builder="jsonl", source=str(source), prompt_format="plain"), reward_funcs=readers)
    assert sorted(rows.column_names) == ["final", "names", "prompt", "question", "solution"]  # `x` is read by none


def test_a_missing_gold_column_names_data_columns_and_the_mapping_to_add(capsys, tmp_path, tiny_dir):
    rows = lines({"prompt": "1+1=", "final": "2"}, {"prompt": "2+2=", "final": "4"})
    recipe = write_recipe(tmp_path, tiny_dir, rows, data__columns=None)
    message = refused_by_both(
        capsys, recipe, "reward `boxed_answer` reads the gold from column 'answer'", "(its columns: prompt, final)",
        "data: {columns: {answer: <your column>}}", "params: {answer_key: <your column>}",
    )  # fmt: skip
    assert str(tmp_path / "data.jsonl") in message


def test_eval_checks_the_gold_column_before_sampling(capsys, tmp_path, tiny_dir):
    source = tmp_path / "problems.jsonl"
    source.write_bytes(lines({"prompt": "1+1=", "final": "2"}, {"prompt": "2+2=", "final": "4"}))
    out = tmp_path / "eval"
    argv = ["eval", "--model", f"tiny={tiny_dir}", "--dataset", "jsonl", "--data-files", str(source), "--n", "1",
            "--k", "1", "--max-new-tokens", "4", "--out", str(out), "--device", "cpu", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "reads the gold from column 'answer'" in err and "--columns answer=<your column>" in err, err
    assert "(its columns: prompt, final)" in err and "Traceback" not in err
    assert not out.exists()  # nothing sampled, nothing written
    # Mapping the column, as the message says, reads it as the gold.
    from prorl_trl.evaluation.grading import resolve_reward
    from prorl_trl.evaluation.problems import load_rows

    rows = load_rows("jsonl", str(source), "train", {"answer": "final"}, reward_funcs=[resolve_reward("boxed_answer")])
    assert [row["answer"] for row in rows] == ["2", "4"]


# ------------------------------------------------------------------------------------------------ preflight parity


@pytest.fixture
def stand_in_wandb(tmp_path, monkeypatch):
    """wandb is not installed here: an importable stand-in package makes it look installed to `find_spec` (all the
    check asks of it), and HOME is an empty temporary folder, so no real credentials are found."""
    site = tmp_path / "site"
    (site / "wandb").mkdir(parents=True)
    (site / "wandb" / "__init__.py").write_text("run = None\n")
    monkeypatch.syspath_prepend(str(site))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "WANDB_DIR",
                 "WANDB_BASE_URL", "NETRC"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings of this checkout
    return home


def test_wandb_without_credentials_stops_validate_and_train_and_names_the_offline_mode(
    capsys, tmp_path, tiny_dir, stand_in_wandb, monkeypatch
):
    recipe = write_recipe(tmp_path, tiny_dir, lines(GOOD_ROW, GOOD_ROW))
    raw = yaml.safe_load(recipe.read_text())
    raw["logging"] = {"report_to": ["wandb"]}
    recipe.write_text(yaml.safe_dump(raw))
    refused_by_both(capsys, recipe, "logging.report_to", "no credentials", "WANDB_MODE=offline", "wandb login")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_wandb_credentials_are_found_where_wandb_documents_them(stand_in_wandb, tmp_path):
    home = stand_in_wandb
    assert not wandb_can_log_in({})
    assert wandb_can_log_in({"WANDB_MODE": "disabled"}) and wandb_can_log_in({"WANDB_API_KEY": "k" * 40})
    assert not wandb_can_log_in({"WANDB_MODE": "online"})
    netrc = home / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_can_log_in({})
    assert not wandb_can_log_in({"WANDB_BASE_URL": "https://wandb.example.com"})  # a self-hosted server's entry
    netrc.unlink()
    settings = home / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
    assert wandb_can_log_in({})
    assert not wandb_can_log_in({"WANDB_CONFIG_DIR": str(tmp_path / "elsewhere")})


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_an_output_dir_that_is_a_file_stops_validate_and_train(capsys, tmp_path, tiny_dir, where):
    (tmp_path / "notes.txt").write_text("mine")
    output_dir = tmp_path / "notes.txt" if where == "file" else tmp_path / "notes.txt" / "run"
    recipe = write_recipe(tmp_path, tiny_dir, lines(GOOD_ROW, GOOD_ROW), training__output_dir=str(output_dir))
    expected = "is a file; output_dir is the folder" if where == "file" else "notes.txt is a file, so the run folder"
    refused_by_both(capsys, recipe, "training.output_dir", expected)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_data_whose_prompts_are_all_too_long_stops_validate_as_it_stops_train(capsys, tmp_path, tiny_dir):
    recipe = write_recipe(tmp_path, tiny_dir, lines(GOOD_ROW, GOOD_ROW), data__max_prompt_tokens=1)
    refused_by_both(capsys, recipe, "no rows left: all 2 prompts are longer than data.max_prompt_tokens = 1")


# ---------------------------------------------------------------------------------------- characters and encoding


@pytest.mark.parametrize(
    ("row", "expected"),
    [({"prompt": "1+1=\x00", "answer": "3"}, ["line 2", "column 'prompt'", "U+0000 (NUL) at character 5"]),
     (b'{"prompt": "What is \\frac{1}{2}?", "answer": "3"}', ["line 2", "U+000C (form feed)", 'write "\\\\frac"']),
     ({"prompt": [{"role": "user", "content": "a\x1bb"}], "answer": "3"}, ["line 2", "U+001B (escape)"])],
    ids=["nul", "latex_backslash_eaten_by_json", "chat_message"],
)  # fmt: skip
def test_control_characters_in_prompts_are_refused_with_file_row_and_column(capsys, tmp_path, tiny_dir, row, expected):
    recipe = write_recipe(tmp_path, tiny_dir, lines(GOOD_ROW, row))
    message = refused_by_both(capsys, recipe, *expected)
    assert str(tmp_path / "data.jsonl") in message


def test_tabs_and_newlines_are_text_not_control_characters(capsys, tmp_path, tiny_dir):
    recipe = write_recipe(tmp_path, tiny_dir, lines(GOOD_ROW, {"prompt": "a\tb\r\nc", "answer": "3"}))
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", ["data.jsonl", "data.json"])
def test_a_utf8_bom_is_read(capsys, tmp_path, tiny_dir, name):
    body = lines(GOOD_ROW, GOOD_ROW) if name.endswith("l") else json.dumps([GOOD_ROW, GOOD_ROW]).encode()
    recipe = write_recipe(tmp_path, tiny_dir, codecs.BOM_UTF8 + body, name=name)
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err
