"""Portable runs and changed resumes (issue 28), through `prorl-trl train` as users run it.

* A run folder moved (`mv`) after its reset-1 checkpoint resumes from the new place to the uninterrupted run's
  weights; in merge mode, another run's `merged/reset-1` at the old place is never loaded (an old absolute path is
  refused), and a merged base changed since the reset is refused by its recorded sha256.
* `--resume` with a recipe that changes training is refused before anything loads, listing `key: old -> new`;
  `--allow-changes` goes on and records the change in `resume_history.yaml`; `recipe.yaml` keeps the original; a
  logging-only change passes.
The pure functions (`reset.provenance`, `recipe.changes`) are tested directly first. CLI runs reuse
tests/test_resume_cli.py's launcher and tiny recipe (2 + 2 steps here, no validation: ~8 CLI processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import _cli_fork
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_resume_cli import LAUNCHER, RECIPE, SHAPE, assert_same_weights, cli

from prorl_trl.recipe.changes import (
    RESUME_HISTORY_NAME,
    ChangedRecipeError,
    alters_training,
    check_resume_changes,
    flatten,
    recipe_changes,
    record_resume,
)
from prorl_trl.reset.checkpoint import CHECKPOINT_HASHES_NAME
from prorl_trl.reset.provenance import (
    RunFilesError,
    base_model_difference,
    base_model_identity,
    file_hashes,
    file_sha256,
    resolve_in_run,
    verify_files,
)

SHORT = ["--phases.0.max_steps", "2", "--phases.1.max_steps", "2", "--validation.eval_steps", "100"]
AFTER_RESET_1 = {"PRORL_TEST_KILL_AT": "on_step_begin:1:2"}  # phase-1/checkpoint-1 (after reset 1) is committed


# ------------------------------------------------------------------------------------------------ pure functions
def test_flatten_walks_mappings_and_lists_of_mappings():
    raw = {"training": {"learning_rate": 1e-4}, "phases": [{"max_steps": 3}], "peft": {"target_modules": ["q", "v"]}}
    assert flatten(raw) == {"training.learning_rate": 1e-4, "phases.0.max_steps": 3, "peft.target_modules": ["q", "v"]}


def test_recipe_changes_lists_each_key_and_says_which_alter_training():
    old = {"training": {"learning_rate": 1e-4, "logging_steps": 1}, "phases": [{"max_steps": 3}]}
    new = {"training": {"learning_rate": 1e-3, "logging_steps": 5, "report_to": "tensorboard"},
           "phases": [{"max_steps": 3}, {"max_steps": 2}]}  # fmt: skip
    described = {change.key: (change.describe(), change.alters_training) for change in recipe_changes(old, new)}
    assert described == {
        "training.learning_rate": ("training.learning_rate: 0.0001 -> 0.001", True),
        "training.logging_steps": ("training.logging_steps: 1 -> 5", False),
        "training.report_to": ("training.report_to: (not set) -> tensorboard", False),
        "phases.1.max_steps": ("phases.1.max_steps: (not set) -> 2", True),
    }


def test_equivalent_spellings_are_not_changes():
    """Audit finding (issue 37): an explicit default (`weight: 1.0`), reordered `target_modules` and the `model:`
    shorthand were refused as changes. Values equal in effect compare equal; a real difference still shows."""
    recorded = {"model": "org/m", "rewards": ["accuracy"], "peft": {"r": 8, "target_modules": ["q_proj", "v_proj"]},
                "phases": [{"max_steps": 2}, {"lora_target_modules": ["up_proj", "k_proj"]}]}  # fmt: skip
    spelled = {"model": {"name_or_path": "org/m"}, "rewards": [{"name": "accuracy", "weight": 1.0, "params": {}}],
               "peft": {"r": 8, "target_modules": ["v_proj", "q_proj", "v_proj"], "lora_dropout": 0.0},
               "phases": [{"max_steps": 2}, {"lora_target_modules": ["k_proj", "up_proj"]}]}  # fmt: skip
    assert recipe_changes(recorded, spelled) == []
    weighted = {**spelled, "rewards": [{"name": "accuracy", "weight": 2.0}]}
    assert [change.describe() for change in recipe_changes(recorded, weighted)] == ["rewards.0.weight: 1.0 -> 2.0"]
    fewer = {**spelled, "peft": {"r": 8, "target_modules": ["q_proj"]}}
    assert [change.key for change in recipe_changes(recorded, fewer)] == ["peft.target_modules"]
    # `training` keys compare as written: their effective values are resolved from other keys later
    assert [change.key for change in recipe_changes({"training": {}}, {"training": {"beta": 0.0}})] == ["training.beta"]


def test_pass_list():
    for key in ("logging.report_to", "training.run_name", "training.output_dir", "training.save_steps", "description"):
        assert not alters_training(key), key
    for key in ("training.seed", "validation.eval_steps", "data.source", "model.name_or_path", "rewards.0.name"):
        assert alters_training(key), key
    # a plateau rule on a training metric makes the logging frequency decide where phases end
    assert alters_training("training.logging_steps", {"training": {"plateau_metric": "reward"}})
    assert alters_training("logging.logging_steps", {"training": {"plateau_metric": "reward"}})  # where recipes set it
    assert not alters_training("logging.logging_steps", {"training": {"plateau_metric": "eval_pass@1"}})


def test_accepted_changes_are_recorded_and_not_asked_again(tmp_path):
    recorded = {"training": {"learning_rate": 1e-4, "seed": 0}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recorded))
    changed = {"training": {"learning_rate": 1e-3}}  # seed removed: also a change
    with pytest.raises(ChangedRecipeError) as refused:
        check_resume_changes(tmp_path, changed, allow_changes=False)
    assert "training.learning_rate: 0.0001 -> 0.001" in refused.value.render()
    assert "training.seed: 0 -> (not set)" in refused.value.render() and "--allow-changes" in refused.value.render()
    changes = check_resume_changes(tmp_path, changed, allow_changes=True)
    record_resume(tmp_path, changes, "run/phase-0/checkpoint-2", 2, argv=["prorl-trl", "train", "r.yaml"])
    assert check_resume_changes(tmp_path, changed, allow_changes=False) == []  # the history is part of the record
    entry = yaml.safe_load((tmp_path / RESUME_HISTORY_NAME).read_text())[0]
    assert entry["global_step"] == 2 and entry["command"] == "prorl-trl train r.yaml"
    assert entry["changes"][0] == {"key": "training.learning_rate", "old": 1e-4, "new": 1e-3, "alters_training": True}
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text()) == recorded


def test_paths_resolve_inside_the_run_folder_only(tmp_path):
    run, other = tmp_path / "runB", tmp_path / "runA"
    (run / "merged" / "reset-1").mkdir(parents=True)
    checkpoint = run / "phase-1" / "checkpoint-1"
    assert resolve_in_run("merged/reset-1", run, checkpoint, "merged_base") == run / "merged" / "reset-1"
    inside = str((run / "merged" / "reset-1").resolve())
    assert resolve_in_run(inside, run, checkpoint, "merged_base") == Path(inside)  # an old run that did not move
    with pytest.raises(RunFilesError, match="outside the run folder") as refused:
        resolve_in_run(str(other / "merged" / "reset-1"), run, checkpoint, "merged_base")
    assert '"merged/reset-1"' in str(refused.value)  # says how to point it at the run's own copy


def test_changed_file_is_refused_by_its_hash(tmp_path):
    save_file({"w": torch.zeros(3)}, tmp_path / "f.safetensors")
    hashes = file_hashes(tmp_path / "f.safetensors", tmp_path)
    verify_files(hashes, tmp_path, tmp_path / "ckpt", "frozen factors")
    save_file({"w": torch.ones(3)}, tmp_path / "f.safetensors")
    with pytest.raises(RunFilesError, match=r"f\.safetensors is not the file"):
        verify_files(hashes, tmp_path, tmp_path / "ckpt", "frozen factors")


def test_base_model_identity_follows_the_weights_not_the_path(tiny_dir, tmp_path):
    recorded = base_model_identity(str(tiny_dir), None, None, tmp_path / "run")
    moved = tmp_path / "moved-model"
    shutil.copytree(tiny_dir, moved)
    assert base_model_difference(recorded, base_model_identity(str(moved), None, None, tmp_path / "run")) is None
    weights = load_file(moved / "model.safetensors")
    save_file({k: v + 1 for k, v in weights.items()}, moved / "model.safetensors", metadata={"format": "pt"})
    other = base_model_identity(str(moved), None, None, tmp_path / "run")
    assert "holds other weights" in base_model_difference(recorded, other)
    hub = {"name_or_path": "org/model", "revision": None, "commit": "abc"}
    assert base_model_difference(hub, {**hub, "commit": "def"}) is not None
    assert base_model_difference(None, hub) is None  # a checkpoint from before base models were recorded


def swap_two_token_ids(folder: Path) -> None:
    """Swap the ids of two vocabulary entries in `folder`'s tokenizer.json: the same text, other token ids."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def test_base_model_identity_records_the_tokenizer_files(tiny_dir, tmp_path):
    """Review finding: a tokenizer.json changed in the base model folder was not noticed on resume (the fingerprint
    covers config.json and the weights only). The tokenizer files are recorded apart and compared by sha256, file by
    file, wherever the tokenizer is loaded from; a record from before (no `tokenizer_files`) still passes."""
    run = tmp_path / "run"
    model = tmp_path / "tiny2"
    shutil.copytree(tiny_dir, model)
    recorded = base_model_identity(str(model), None, None, run)
    assert set(recorded["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert "tokenizer_name_or_path" not in recorded  # the model's own folder
    moved = tmp_path / "moved-model"
    shutil.copytree(model, moved)
    assert base_model_difference(recorded, base_model_identity(str(moved), None, None, run)) is None
    swap_two_token_ids(model)
    current = base_model_identity(str(model), None, None, run)
    assert current["fingerprint"] == recorded["fingerprint"]  # what runs recorded before this fix keep comparing
    assert f"{model / 'tokenizer.json'} (changed)" in base_model_difference(recorded, current)
    old_record = {key: value for key, value in recorded.items() if key != "tokenizer_files"}
    assert base_model_difference(old_record, current) is None  # recorded before tokenizers were: not refused
    (moved / "chat_template.jinja").unlink()
    removed = base_model_identity(str(moved), None, None, run)
    assert "chat_template.jinja (removed)" in base_model_difference(recorded, removed)
    # `model.tokenizer_name_or_path`: another folder, recorded with its files (the model folder's are not used)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tiny_dir, tokenizer)
    separate = base_model_identity(str(moved), None, None, run, str(tokenizer))
    assert separate["tokenizer_name_or_path"] == str(tokenizer)
    assert separate["tokenizer_files"] == recorded["tokenizer_files"]
    swap_two_token_ids(tokenizer)
    difference = base_model_difference(separate, base_model_identity(str(moved), None, None, run, str(tokenizer)))
    assert f"{tokenizer / 'tokenizer.json'} (changed)" in difference
    assert "tokenizer_files" not in base_model_identity(str(moved), None, None, run, "")  # built in memory


# ---------------------------------------------------------------------------------------------------- CLI runs
def test_moved_run_resumes_to_the_uninterrupted_weights(tiny_dir, shared_data, tmp_path):
    reference = tmp_path / "reference"
    done = cli(reference, tiny_dir, shared_data, *SHORT)
    assert done.returncode == 0, done.stderr[-3000:]
    old, new = tmp_path / "runA", tmp_path / "runB"
    killed = cli(old, tiny_dir, shared_data, *SHORT, env=AFTER_RESET_1)
    assert killed.returncode == -9, killed.stderr[-2000:]
    state = json.loads((old / "phase-1" / "checkpoint-1" / "prorl_state.json").read_text())
    assert state["frozen_factors"] == "frozen/reset-1.safetensors" and state["merged_base"] == "merged/reset-1"
    assert list(state["reset_files_sha256"]) == ["frozen/reset-1.safetensors"]
    assert state["base_model"]["fingerprint"]
    shutil.move(old, new)
    finished = cli(new, tiny_dir, shared_data, *SHORT, "--phases.0.max_steps", "3", "--resume", "--allow-changes")
    assert finished.returncode == 2 and "earlier, finished phases" in finished.stderr, finished.stderr[-2000:]
    assert "phases.0.max_steps: 2 -> 3" in finished.stderr  # phase 0 trained as recorded: refused, not ignored
    resumed = cli(new, tiny_dir, shared_data, *SHORT, "--resume")  # a moved run: its output_dir changes, and passes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and not old.exists()
    assert_same_weights(new, reference)


def test_the_same_values_spelled_otherwise_resume_without_allow_changes(tiny_dir, shared_data, tmp_path):
    """Audit finding (issue 37): the same model folder at a new path, an explicit `weight: 1.0` and reordered
    `target_modules` were refused as changes. They resume without `--allow-changes` and record no change; a model
    folder at the new path holding other weights is still refused (exit 2) before anything loads."""
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    other = tmp_path / "other-model"
    shutil.copytree(tiny_dir, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: v * 2 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    refused = cli(out, tiny_dir, shared_data, *SHORT, "--model.name_or_path", str(other), "--resume")
    assert refused.returncode == 2 and f"model.name_or_path: {tiny_dir} -> {other}" in refused.stderr, refused.stderr
    moved = tmp_path / "moved-model"
    shutil.copytree(tiny_dir, moved)
    spelled = ["--model.name_or_path", str(moved), "--rewards", "[{name: token_hash, weight: 1.0}]",
               "--peft.target_modules", "[v_proj, q_proj]"]  # fmt: skip
    resumed = cli(out, tiny_dir, shared_data, *SHORT, *spelled, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming with changes" not in resumed.stdout and not (out / RESUME_HISTORY_NAME).exists()


def tokenizer_run(model: Path, tokenizer: Path, output_dir: Path, max_steps: int):
    """A ProRLTrainer on the tiny model and tokenizer saved at `model` and `tokenizer`, saving every step."""
    from _prorl_helpers import lora, prompts_dataset, tiny_args
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prorl_trl import ProRLTrainer

    args = tiny_args(output_dir, max_steps=max_steps, save_strategy="steps", save_steps=1, num_generations=2)
    return ProRLTrainer(
        model=AutoModelForCausalLM.from_pretrained(model), processing_class=AutoTokenizer.from_pretrained(tokenizer),
        reward_funcs=[lambda completion_ids, **kw: [sum(ids) % 7 / 7 for ids in completion_ids]], args=args,
        train_dataset=prompts_dataset(8), peft_config=lora(),
    )  # fmt: skip


def test_a_changed_tokenizer_is_refused_on_resume(tiny_dir, tmp_path):
    """Review finding, end to end: vocabulary ids swapped in the base model folder's tokenizer.json after a
    checkpoint were accepted by a resume, and the run went on with other token ids. Refused (`RunFilesError`: the
    CLI exits 2), naming the file, as changed weights are; nothing is loaded."""
    model = tmp_path / "tiny2"
    shutil.copytree(tiny_dir, model)
    tokenizer_run(model, model, tmp_path, max_steps=1).train()
    state = json.loads((tmp_path / "run" / "phase-0" / "checkpoint-1" / "prorl_state.json").read_text())
    assert state["base_model"]["tokenizer_files"]["tokenizer.json"] == file_sha256(model / "tokenizer.json")
    swap_two_token_ids(model)
    resumed = tokenizer_run(model, model, tmp_path, max_steps=2)
    with pytest.raises(RunFilesError, match="another base model") as refused:
        resumed.train(resume_from_checkpoint=True)
    assert f"{model / 'tokenizer.json'} (changed)" in str(refused.value)
    assert resumed.state.global_step == 0 and RunFilesError.exit_status == 2


def test_the_trainer_records_the_tokenizer_it_was_given(tiny_dir, tmp_path):
    """The trainer records the files of the tokenizer it trains with (`model.tokenizer_name_or_path`: another folder
    than the model's), which a resume compares (`base_model_difference`)."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tiny_dir, tokenizer)
    swap_two_token_ids(tokenizer)
    recorded = tokenizer_run(tiny_dir, tokenizer, tmp_path, max_steps=1).prorl_base_model
    assert recorded["tokenizer_name_or_path"] == str(tokenizer)
    assert recorded["tokenizer_files"]["tokenizer.json"] == file_sha256(tokenizer / "tokenizer.json")
    own = base_model_identity(str(tiny_dir), None, None, tmp_path / "run")  # the model folder's tokenizer: another
    assert "tokenizer.json (changed)" in base_model_difference(recorded, own)


def test_merge_mode_never_loads_another_runs_merged_base(tiny_dir, shared_data, tmp_path):
    merge = [*SHORT, "--training.lora_reset_mode", "merge"]
    old, new = tmp_path / "runA", tmp_path / "runB"
    killed = cli(old, tiny_dir, shared_data, *merge, env=AFTER_RESET_1)
    assert killed.returncode == -9, killed.stderr[-2000:]
    shutil.move(old, new)
    # Another run's merged base now sits where this run's used to be.
    shutil.copytree(new / "merged" / "reset-1", old / "merged" / "reset-1")
    decoy = old / "merged" / "reset-1" / "model.safetensors"
    save_file({k: v + 1 for k, v in load_file(decoy).items()}, decoy, metadata={"format": "pt"})
    state_file = new / "phase-1" / "checkpoint-1" / "prorl_state.json"
    text, hashes = state_file.read_text(), state_file.with_name(CHECKPOINT_HASHES_NAME)
    written = json.loads(text)
    assert written["merged_base"] == "merged/reset-1"

    # As an older version wrote it: the absolute path, no hashes (of the reset's files, nor of the checkpoint's).
    # Refused, not loaded.
    old_format = {**written, "merged_base": str(old / "merged" / "reset-1")}
    del old_format["reset_files_sha256"]
    state_file.write_text(json.dumps(old_format))
    checkpoint_hashes = hashes.read_bytes()
    hashes.unlink()
    refused = cli(new, tiny_dir, shared_data, *merge, "--resume")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "outside the run folder" in refused.stderr and "Traceback" not in refused.stderr
    assert not (new / "final").exists()

    # The run's own merged base changed since the reset: refused by its sha256, naming the file.
    state_file.write_text(text)
    hashes.write_bytes(checkpoint_hashes)
    own = new / "merged" / "reset-1" / "model.safetensors"
    original = own.read_bytes()
    shutil.copyfile(decoy, own)
    refused = cli(new, tiny_dir, shared_data, *merge, "--resume")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"{own} is not the file" in refused.stderr and not (new / "final").exists()

    own.write_bytes(original)
    resumed = cli(new, tiny_dir, shared_data, *merge, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (new / "final" / "model.safetensors").is_file()


def test_changed_resume_is_refused_unless_allowed_and_recorded(tiny_dir, shared_data, tmp_path):
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    recorded = (out / "recipe.yaml").read_bytes()

    refused = cli(out, tiny_dir, shared_data, *SHORT, "--training.learning_rate", "1e-3", "--resume")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "training.learning_rate: 0.0001 -> 0.001" in refused.stderr and "--allow-changes" in refused.stderr
    assert "lora_r" not in refused.stdout  # refused before the recipe table, i.e. before anything was loaded
    validate = LAUNCHER + ["validate", RECIPE, "--model.name_or_path", str(tiny_dir), "--training.output_dir",
                           str(out), *SHAPE, *SHORT, "--training.learning_rate", "1e-3", "--resume"]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data)}
    checked = _cli_fork.run(validate, env=environment, timeout=300)
    assert checked.returncode == 2, checked.stderr[-3000:]  # `validate --resume` reports the same diff
    assert "training.learning_rate: 0.0001 -> 0.001" in checked.stderr

    # A logging-only change passes (the kill proves it trained on).
    logging_only = cli(out, tiny_dir, shared_data, *SHORT, "--training.logging_steps", "2", "--resume",
                       env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})  # fmt: skip
    assert logging_only.returncode == -9, logging_only.stderr[-3000:]
    assert "training.logging_steps: 1 -> 2" in logging_only.stdout

    allowed = cli(out, tiny_dir, shared_data, *SHORT, "--training.learning_rate", "1e-3", "--resume", "--allow-changes")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert (out / "recipe.yaml").read_bytes() == recorded
    history = yaml.safe_load((out / RESUME_HISTORY_NAME).read_text())
    assert [[change["key"] for change in entry["changes"]] for entry in history] == [
        ["training.logging_steps"],
        ["training.learning_rate", "training.logging_steps"],  # logging_steps back to the recipe's 1
    ]
    assert history[1]["checkpoint"].endswith("checkpoint-1") and history[1]["global_step"] == 1
    assert "--allow-changes" in history[1]["command"]


def test_a_resume_the_trainer_refuses_records_nothing(tiny_dir, shared_data, tmp_path):
    """The trainer's own resume checks (here: another LoRA rank inside the running phase) come after the CLI's; the
    run's records were written before them, so a refused resume was kept in resume_history.yaml as one that went on.
    They are now written once the trainer has accepted the checkpoint."""
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    recorded = (out / "recipe.yaml").read_bytes()
    refused = cli(out, tiny_dir, shared_data, *SHORT, "--peft.r", "8", "--resume", "--allow-changes")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "inside phase 0" in refused.stderr, refused.stderr[-3000:]
    assert not (out / RESUME_HISTORY_NAME).exists()
    assert (out / "recipe.yaml").read_bytes() == recorded


def test_a_deleted_or_damaged_run_recipe_is_refused_not_ignored(tiny_dir, shared_data, tmp_path):
    """Audit findings (issue 37): with the run's `recipe.yaml` deleted, `--resume --training.learning_rate 1e-3`
    went on without `--allow-changes`; a `recipe.yaml` or `resume_history.yaml` that is not the YAML the run wrote
    ended in a traceback (exit 1). Each is now exit 2 with a message naming the file, before anything loads."""
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    recipe = (out / "recipe.yaml").read_bytes()
    current = yaml.safe_load(recipe)
    damages = [("recipe.yaml", b"\x00\xff\xfe binary"), ("recipe.yaml", b"- a list\n"),
               ("recipe.yaml", b"key: [unclosed\n"), (RESUME_HISTORY_NAME, b"just a string\n"),
               (RESUME_HISTORY_NAME, b"- 5\n"), (RESUME_HISTORY_NAME, b"{a: [\n")]  # fmt: skip
    for index, (name, content) in enumerate(damages):
        (out / name).write_bytes(content)
        if index in (0, 3):  # through the CLI: exit 2, no traceback (each CLI process costs ~8 s)
            damaged = cli(out, tiny_dir, shared_data, *SHORT, "--resume")
            assert damaged.returncode == 2 and "Traceback" not in damaged.stderr, (name, damaged.stderr[-2000:])
            assert f"{out / name}" in damaged.stderr and "is damaged" in damaged.stderr, damaged.stderr[-2000:]
        with pytest.raises(ChangedRecipeError) as refused:  # what the CLI turns into that exit 2
            check_resume_changes(out, current, allow_changes=False)
        assert f"{out / name}" in refused.value.render() and "is damaged" in refused.value.render()
        (out / "recipe.yaml").write_bytes(recipe)
        (out / RESUME_HISTORY_NAME).unlink(missing_ok=True)
    (out / "recipe.yaml").unlink()
    refused = cli(out, tiny_dir, shared_data, *SHORT, "--training.learning_rate", "1e-3", "--resume")
    assert refused.returncode == 2 and "recipe.yaml is missing" in refused.stderr, refused.stderr[-3000:]
    allowed = cli(out, tiny_dir, shared_data, *SHORT, "--training.learning_rate", "1e-3", "--resume", "--allow-changes")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert yaml.safe_load((out / "recipe.yaml").read_text())["training"]["learning_rate"] == 1e-3  # now the record


def test_a_data_file_rewritten_under_the_same_name_is_noticed_on_resume(tiny_dir, shared_data, tmp_path):
    """Audit finding (issue 37): a jsonl rewritten in place between a stop and `--resume` went unnoticed. The run
    records what its local data files held (`data_files.json`); a resume with other bytes is refused (exit 2) naming
    the file, unless `--allow-changes`, which records the change and the new content."""
    from prorl_trl.data.fingerprint import file_fingerprint

    data = tmp_path / "gsm8k"
    shutil.copytree(shared_data / "gsm8k", data)
    source = ["--data.source", str(data)]
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, *source, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    recorded = json.loads((out / "data_files.json").read_text())
    train = Path(recorded["train"]["file"])
    assert train.parent == data and recorded["train"]["fingerprint"] == file_fingerprint(train)
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(reversed(lines)))  # the same rows, the same size, in another order
    refused = cli(out, tiny_dir, shared_data, *SHORT, *source, "--resume")
    assert refused.returncode == 2 and f"data file (train) {train}" in refused.stderr, refused.stderr[-3000:]
    assert "--allow-changes" in refused.stderr and "Traceback" not in refused.stderr
    allowed = cli(out, tiny_dir, shared_data, *SHORT, *source, "--resume", "--allow-changes")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    history = yaml.safe_load((out / RESUME_HISTORY_NAME).read_text())
    assert [change["key"] for change in history[-1]["changes"]] == [f"data file (train) {train}"]
    assert json.loads((out / "data_files.json").read_text())["train"]["fingerprint"] == file_fingerprint(train)


def test_large_files_are_fingerprinted_from_samples_and_small_ones_whole(tmp_path):
    from prorl_trl.data import fingerprint

    small, large = tmp_path / "small.jsonl", tmp_path / "large.bin"
    small.write_bytes(b"x" * 1000)
    assert fingerprint.file_fingerprint(small).startswith("size:1000;sha256:")
    large.write_bytes(bytes(range(256)) * (fingerprint.FULL_HASH_LIMIT // 256 + 4096))
    first = fingerprint.file_fingerprint(large)
    assert "sampled-sha256" in first
    with large.open("r+b") as file:  # a byte inside the first block changes the fingerprint
        file.seek(10)
        file.write(b"\xff")
    assert fingerprint.file_fingerprint(large) != first


def test_a_resume_with_a_new_learning_rate_trains_at_it_from_the_recorded_step(tiny_dir, shared_data, tmp_path):
    """Audit finding (issue 37): `--resume --training.learning_rate 1e-3 --allow-changes` went on at the old rate
    (the checkpoint's scheduler state carries it) while resume_history.yaml said the change held. Now the rates from
    the resumed step on are, bit for bit, those of a run that had the new rate from the start."""

    def rates(folder: Path) -> dict[int, float]:
        entries = json.loads((folder / "run_summary.json").read_text())["log_history"]
        return {entry["prorl/global_step"]: entry["learning_rate"] for entry in entries if "learning_rate" in entry}

    fresh = cli(tmp_path / "fresh", tiny_dir, shared_data, *SHORT, "--training.learning_rate", "1e-3")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "FutureWarning" not in fresh.stderr  # the libraries' own deprecations are not the user's (LIBRARY_NOISE)
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, *SHORT, env={"PRORL_TEST_KILL_AT": "on_step_begin:0:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = cli(out, tiny_dir, shared_data, *SHORT, "--training.learning_rate", "1e-3", "--resume", "--allow-changes")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = rates(tmp_path / "fresh"), rates(out)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert got[1] != want[1]  # step 1 trained before the change, at the old rate
    assert all(got[step] == want[step] for step in (2, 3, 4)), (got, want)
    history = yaml.safe_load((out / RESUME_HISTORY_NAME).read_text())
    assert history[-1]["global_step"] == 1 and history[-1]["changes"][0]["key"] == "training.learning_rate"


def test_changes_to_a_phase_its_checkpoint_ended_are_refused_unless_a_longer_phase_takes_them_on(tmp_path):
    """A checkpoint at a phase's end (its last step, a plateau stop, a reset on demand) resumes into the next phase:
    a change to the ended phase's settings was accepted, recorded and had no effect before 2026-11-29. A longer
    `max_steps` continues a phase that ran to its length, and then its other changes apply from the resumed step."""
    from prorl_trl.recipe.changes import Change, ChangedRecipeError, refuse_finished_phase_changes

    temperature = Change("phases.0.temperature", 1.0, 1.3, True)
    ended = {"phase_index": 0, "phase_complete": True, "phase_end_reason": "max_steps", "phase_global_step": 4}
    with pytest.raises(ChangedRecipeError, match=r"(?s)resumes into phase 1.*phases\.0\.temperature: 1\.0 -> 1\.3"):
        refuse_finished_phase_changes([temperature], ended, tmp_path)
    longer = Change("phases.0.max_steps", 4, 6, True)
    refuse_finished_phase_changes([temperature, longer], ended, tmp_path)  # the phase goes on: both apply
    plateau = {**ended, "phase_end_reason": "plateau: no improvement"}
    with pytest.raises(ChangedRecipeError):  # a plateau stop stays a stop, longer or not
        refuse_finished_phase_changes([temperature, longer], plateau, tmp_path)
    refuse_finished_phase_changes([temperature], {**ended, "phase_complete": False}, tmp_path)  # inside the phase
