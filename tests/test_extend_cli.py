"""Extending a finished run (issue 39) through `prorl-trl train --resume --allow-changes`, as users run it.

The tiny recipe of tests/test_resume_cli.py (its `cli` helper: `token_hash` reward, a checkpoint every step,
validation every 2 steps) with a constant learning rate, so that a phase given more steps trains its first ones at
the rates a run planned that long from the start has, and TensorBoard on. The run under test finishes with phases of
3 and 1 steps, gets a second step in its last phase, then a third phase appended on the command line; a run that had
phases of 3, 2 and 2 steps from the start is the reference: the same weights bit for bit, the same log step for step.
Refusals run through the CLI where the message is the point, else through `plan_extension` on a copy of the run.
Cost: 5 training CLI processes and 3 refused ones, shared by every test (2026-11-28, commit 486b6a3: 3 min of CPU;
8.3 min wall on the shared 2-core machine under a load of 6-11).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from test_resume_cli import RECIPE, assert_same_weights, cli, history, snapshot

COMMON = ["--training.lr_scheduler_type", "constant", "--training.report_to", "tensorboard"]
SHORT = [*COMMON, "--phases.1.max_steps", "1"]  # finishes at global step 4
LONGER = [*COMMON, "--phases.1.max_steps", "2"]  # its last phase extended: global step 5
THIRD = ["--phases.2.name", "third", "--phases.2.max_steps", "2", "--phases.2.temperature", "0.9"]  # appended


@pytest.fixture(scope="module")
def runs(tiny_dir, shared_data, tmp_path_factory):
    """The reference run, and the run extended twice with the output of each step kept for the tests."""
    root = tmp_path_factory.mktemp("extend")
    reference, out = root / "reference", root / "run"
    done = cli(reference, tiny_dir, shared_data, *LONGER, *THIRD)
    assert done.returncode == 0, done.stderr[-3000:]
    short = cli(out, tiny_dir, shared_data, *SHORT)
    assert short.returncode == 0, short.stderr[-3000:]
    finished = root / "finished"  # the run as it first finished, for the refusals
    shutil.copytree(out, finished, symlinks=True)
    before = snapshot(out)
    unconfirmed = cli(out, tiny_dir, shared_data, *LONGER, "--resume")
    assert snapshot(out) == before
    longer = cli(out, tiny_dir, shared_data, *LONGER, "--resume", "--allow-changes")
    assert longer.returncode == 0, longer.stderr[-3000:]
    appended = cli(out, tiny_dir, shared_data, *LONGER, *THIRD, "--resume", "--allow-changes")
    assert appended.returncode == 0, appended.stderr[-3000:]
    return {"reference": reference, "out": out, "finished": finished, "unconfirmed": unconfirmed, "longer": longer,
            "appended": appended, "tiny_dir": tiny_dir, "shared_data": shared_data}  # fmt: skip


def test_extended_run_ends_on_the_weights_and_log_of_a_run_planned_that_long(runs):
    out, reference = runs["out"], runs["reference"]
    assert "extending the run finished at global step 4: phase 1 'second' 1 -> 2 steps" in runs["longer"].stdout
    assert "appended phase 2 'third' (2 steps)" in runs["appended"].stdout
    assert_same_weights(out, reference)
    steps = [entry["prorl/global_step"] for entry in history(out) if "loss" in entry]
    assert steps == [1, 2, 3, 4, 5, 6, 7]  # never repeated, never restarted at 0
    assert history(out) == history(reference)  # every entry: losses, validations, phase starts, phase summaries
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 7 and json.loads((out / "final" / "prorl_state.json").read_text())["global_step"] == 7
    assert "in 3 phases with 2 hard reset(s), 7 steps" in (out / "final" / "README.md").read_text()


def test_each_earlier_final_model_is_kept_under_the_phase_and_step_it_ended(runs):
    out = runs["out"]
    for name, step in (("final-phase1-step4", 4), ("final-phase1-step5", 5)):
        assert json.loads((out / name / "prorl_state.json").read_text())["global_step"] == step
        assert (out / name / "model.safetensors").is_file()
    # the extensions trained: the weights moved past each kept final (so the equality above compares moved weights)
    from safetensors.torch import load_file

    kept, final = (load_file(out / name / "model.safetensors") for name in ("final-phase1-step4", "final"))
    assert any(not kept[key].equal(final[key]) for key in kept)
    manifest = json.loads((out / ".prorl_manifest.json").read_text())["paths"]
    assert {"final-phase1-step4/", "final-phase1-step5/", "phase-2/"} <= set(manifest)  # the run's: --overwrite deletes


def test_resume_history_records_each_extension(runs):
    history = yaml.safe_load((runs["out"] / "resume_history.yaml").read_text())
    assert [entry["extended"] for entry in history] == [
        {"finished_at_global_step": 4, "previous_final": "final-phase1-step4/",
         "last_phase": {"index": 1, "name": "second", "max_steps": {"old": 1, "new": 2}}},
        {"finished_at_global_step": 5, "previous_final": "final-phase1-step5/",
         "appended_phases": [{"index": 2, "name": "third", "max_steps": 2}]},
    ]  # fmt: skip
    assert {"key": "phases.1.max_steps", "old": 1, "new": 2, "alters_training": True} in history[0]["changes"]
    assert {"key": "phases.2.temperature", "new": 0.9, "alters_training": True} in history[1]["changes"]
    assert history[1]["checkpoint"].endswith("phase-1/checkpoint-2")


def test_tensorboard_continues_on_the_run_steps(runs):
    """One event folder holding every scalar the reference has, at its steps. Known difference: the summary entry
    HF logged when phase 1 first ended (`train/train_loss`, and the `prorl/*` keys it carries) stays at step 4 (an event
    file keeps what it was given; a resume can only hide whole steps after its checkpoint), and is logged again where
    the phase ends now. An appended phase adds no such point."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(run):
        [folder] = {path.parent for path in (run / "runs").rglob("events.out.tfevents.*")}
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        return {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    got, want = scalars(runs["out"]), scalars(runs["reference"])
    assert got["train/loss"] == want["train/loss"] == [1, 2, 3, 4, 5, 6, 7]
    assert got.keys() == want.keys()
    for tag, steps in want.items():
        extra = list(got[tag])
        for step in steps:
            extra.remove(step)  # every step of the reference is there
        assert extra in ([], [4]), (tag, got[tag], steps)
    assert got["train/train_loss"] == [3, 4, 5, 7] and want["train/train_loss"] == [3, 5, 7]


def test_without_allow_changes_a_finished_run_is_not_extended_and_the_message_says_how(runs):
    result = runs["unconfirmed"]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "holds a finished run" in result.stderr and "phase 1 'second' 1 -> 2 steps" in result.stderr
    assert "pass --allow-changes with --resume" in result.stderr and "lora_r" not in result.stdout  # nothing loaded


def test_the_finished_run_resumed_as_it_is_has_nothing_to_do(runs):
    out = runs["out"]
    before = snapshot(out)
    again = cli(out, runs["tiny_dir"], runs["shared_data"], *LONGER, *THIRD, "--resume")
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-2000:]
    assert snapshot(out) == before


def test_a_change_to_a_phase_that_trained_is_refused_with_what_can_be_extended(runs):
    folder = runs["finished"]
    before = snapshot(folder)
    result = cli(folder, runs["tiny_dir"], runs["shared_data"], *LONGER, "--phases.0.temperature", "1.3",
                 "--resume", "--allow-changes")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "phases of" in result.stderr and "that already trained" in result.stderr
    assert "phases.0.temperature: (not set) -> 1.3" in result.stderr
    assert "`--phases.1.max_steps N`, N > 1" in result.stderr and "`--phases.2.max_steps N`" in result.stderr
    assert snapshot(folder) == before


def finished_recipe(runs, folder: Path, monkeypatch, *overrides: str):
    """The recipe of the finished run in `folder` as `cli` gives it, plus `overrides`, read in this process."""
    from test_malformed_inputs import register_token_hash

    from prorl_trl.recipe.load import load_recipe

    register_token_hash(monkeypatch)
    return load_recipe(RECIPE, ["--model.name_or_path", str(runs["tiny_dir"]), "--training.output_dir", str(folder),
                                "--rewards", "[token_hash]", "--phases.0.max_steps", "3", "--validation.eval_steps",
                                "2", *COMMON, *overrides])  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--phases.1.max_steps", "1", "--training.learning_rate", "1e-3"], "adds no step"),
        (["--phases.0.max_steps", "4"], "phases.0.max_steps: 3 -> 4"),  # only the last phase can grow
        (["--phases", "[{name: first, max_steps: 3}]"], "trained 2 phases and this recipe has 1"),
    ],
)  # fmt: skip
def test_what_a_continuation_cannot_honour_is_refused_before_anything_is_loaded(runs, overrides, message, monkeypatch):
    from prorl_trl.recipe.changes import ChangedRecipeError
    from prorl_trl.recipe.extend import plan_extension
    from prorl_trl.recipe.output_folder import inspect_output_folder

    folder = runs["finished"]
    recipe = finished_recipe(runs, folder, monkeypatch, *overrides)
    before = snapshot(folder)
    with pytest.raises(ChangedRecipeError) as refused:
        plan_extension(inspect_output_folder(folder), recipe, allow_changes=True)
    assert message in refused.value.render() and "Nothing" in refused.value.render()
    assert snapshot(folder) == before


def test_a_run_without_a_checkpoint_of_its_last_step_or_ended_on_a_plateau_is_not_extended(runs, tmp_path, monkeypatch):
    """A continuation needs the checkpoint of the run's last step (a run that saved none can only seed a new run), and
    a phase that ended on a plateau stays ended: more steps would not train; another phase can follow it."""
    from prorl_trl.recipe.changes import ChangedRecipeError
    from prorl_trl.recipe.extend import plan_extension
    from prorl_trl.recipe.output_folder import inspect_output_folder

    def recipe(folder, *overrides):
        return finished_recipe(runs, folder, monkeypatch, *overrides)

    unsaved = tmp_path / "unsaved"
    shutil.copytree(runs["finished"], unsaved, symlinks=True)
    shutil.rmtree(unsaved / "phase-1" / "checkpoint-1")
    with pytest.raises(ChangedRecipeError, match="no complete checkpoint of its last step") as refused:
        plan_extension(inspect_output_folder(unsaved), recipe(unsaved, "--phases.1.max_steps", "2"), True)
    assert f"--model.name_or_path {unsaved / 'final'}" in refused.value.render()
    assert plan_extension(inspect_output_folder(unsaved), recipe(unsaved, "--phases.1.max_steps", "1"), True) is None

    plateau = tmp_path / "plateau"
    shutil.copytree(runs["finished"], plateau, symlinks=True)
    state_file = plateau / "phase-1" / "checkpoint-1" / "prorl_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "phase_end_reason": "eval plateau"}))
    with pytest.raises(ChangedRecipeError, match="ended at step 1 by eval plateau.*append a phase instead"):
        plan_extension(inspect_output_folder(plateau), recipe(plateau, "--phases.1.max_steps", "2"), True)
    appended = plan_extension(inspect_output_folder(plateau), recipe(plateau, "--phases.1.max_steps", "1", *THIRD), True)
    assert appended.appended == [(2, "third", 2)] and appended.new_length is None
    assert appended.kept_final == "final-phase1-step4"


def test_an_override_one_past_the_last_phase_adds_a_phase_which_must_set_its_length(tiny_dir):
    from prorl_trl.recipe.load import load_recipe
    from prorl_trl.recipe.schema import RecipeError

    model = ["--model.name_or_path", str(tiny_dir)]
    recipe = load_recipe(RECIPE, [*model, *THIRD])
    assert [(p.name, p.max_steps, p.temperature) for p in recipe.resolved_phases][2] == ("third", 2, 0.9)
    with pytest.raises(RecipeError, match="phases.2: the overrides add phase 2 .* must set its length"):
        load_recipe(RECIPE, [*model, "--phases.2.temperature", "0.9"])  # meant for phase 1 (counted from 1)
