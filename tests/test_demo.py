"""The offline demo: its recipe matches the shipped file and validates; `--smoke` runs the whole pipeline end to end
(tiny model, SFT warm start, 2 ProRL phases with a hard reset, validation, plots, report); bad arguments exit 2."""

import json
import re
from pathlib import Path

import pytest
import yaml

from prorl_trl.cli import main
from prorl_trl.demo import DEMO_RECIPE, demo_recipe
from prorl_trl.plots import phase_boundaries, plot_training_curves, series
from prorl_trl.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent


def test_shipped_recipe_is_the_embedded_default(tiny_dir):
    assert yaml.safe_load((REPO / "recipes" / "demo_tiny.yaml").read_text()) == DEMO_RECIPE
    recipe = load_recipe(REPO / "recipes" / "demo_tiny.yaml", [("model.name_or_path", str(tiny_dir))])
    phases = recipe.resolved_phases or []
    assert len(phases) >= 2 and any(phase.hard_reset for phase in phases[1:])
    assert recipe.data.builder == "synthetic_arithmetic" and recipe.rewards[0].name == "boxed_answer"


def test_demo_recipe_points_at_the_output_folder(tmp_path):
    raw = demo_recipe(tmp_path, smoke=True)
    assert raw["model"]["name_or_path"] == str(tmp_path / "warm_start")
    assert raw["training"]["output_dir"] == str(tmp_path / "run")
    assert DEMO_RECIPE["model"]["name_or_path"] != raw["model"]["name_or_path"], "the default must stay untouched"


def test_smoke_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--smoke", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    # Progress with rate and ETA over both phases (tqdm: "3/4 [00:08<00:02, 2.73s/step]"), a short line per log.
    assert re.search(r"4/4 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(s/step|step/s)\]", err), err[-2000:]
    assert "step 4/4 [sharpen]: " in err and "{'loss'" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["val_accuracy_before"] <= 1.0 and 0.0 <= summary["val_accuracy_after"] <= 1.0
    curve = summary["val_accuracy_curve"]
    assert curve["steps"][0] == 0 and curve["steps"][-1] == 4, "validated before RL and after the last step"
    assert summary["resets"] == 1 and [p["name"] for p in summary["phases"]] == ["explore", "sharpen"]
    for plot in ("validation", "reward", "completion_length", "entropy", "kl", "clip_ratio"):
        assert (out / "plots" / f"{plot}.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    assert "validation pass@1" in report and "plots/validation.png" in report
    history = json.loads((out / "run" / "run_summary.json").read_text())["log_history"]
    assert {entry.get("prorl/phase") for entry in history if "reward" in entry} == {0, 1}
    assert (out / "warm_start" / "config.json").is_file() and (out / "run" / "final").is_dir()


def test_a_second_demo_into_the_same_folder_changes_nothing_unless_overwrite(tmp_path, capsys):
    """Audit finding (issue 39): a second `prorl-trl demo` retrained and overwrote `warm_start/`, then exited 2 asking
    for a flag `demo` did not take. A finished demo's folder is now reported and left as it is; an interrupted one
    (or a folder of other files) is refused before anything changes; `--overwrite` runs the demo again."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--smoke", "--threads", "1"]) == 0
    first = json.loads((out / "summary.json").read_text())
    stamps = {path: path.stat().st_mtime_ns for path in out.rglob("*")}
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--smoke", "--threads", "1"]) == 0
    assert "holds a finished demo" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*")} == stamps
    (out / "summary.json").unlink()  # as an interrupted demo leaves it
    (out / "mine.txt").write_text("mine")
    assert main(["demo", "--out", str(out), "--smoke", "--threads", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err and not (out / "summary.json").exists()
    assert main(["demo", "--out", str(out), "--smoke", "--threads", "1", "--overwrite"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["val_accuracy_curve"] == first["val_accuracy_curve"] and (out / "mine.txt").read_text() == "mine"


def test_overwrite_never_deletes_a_users_files_that_carry_the_demos_names(tmp_path, capsys):
    """`--overwrite` deleted the demo's output names in any folder (a user's plots/, report.md, recipe.yaml), ran
    the warm start, and only then refused the run folder, saying nothing was changed. A folder the demo did not
    write is now refused first, whatever the flags."""
    out = tmp_path / "project"
    (out / "plots").mkdir(parents=True)
    mine = {"plots/fig1.png": "png", "report.md": "my report", "recipe.yaml": "mine: 1", "notes.txt": "notes"}
    for name, text in mine.items():
        (out / name).write_text(text)
    assert main(["demo", "--out", str(out), "--smoke", "--threads", "1", "--overwrite"]) == 2
    assert "was not written by the demo" in capsys.readouterr().err
    assert {name: (out / name).read_text() for name in mine} == mine
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt", "plots", "recipe.yaml", "report.md"]


@pytest.mark.parametrize("flag", [["--sft-steps", "-1"], ["--threads", "0"], ["--sft-learning-rate", "0"]])
def test_bad_arguments_exit_2_before_any_work(tmp_path, flag, capsys):
    out = tmp_path / "never"
    assert main(["demo", "--out", str(out), "--smoke", *flag]) == 2
    assert not out.exists()
    assert flag[0] in capsys.readouterr().err


def test_phase_boundaries_are_the_last_step_of_each_phase():
    history = [
        {"prorl/global_step": 5, "prorl/phase": 0, "reward": -1.0},
        {"prorl/global_step": 10, "prorl/phase": 0, "eval_pass@1": 0.2},
        {"prorl/global_step": 15, "prorl/phase": 1, "reward": 0.0},
        {"prorl/global_step": 20, "prorl/phase": 2, "reward": 0.5},
        {"step": 25, "reward": 0.7},  # no phase key: ignored for boundaries, still a point of the curve
    ]
    assert phase_boundaries(history) == [10.0, 15.0]
    assert series(history, ("reward",)) == ([5.0, 15.0, 20.0, 25.0], [-1.0, 0.0, 0.5, 0.7])


def test_plots_skip_metrics_the_run_did_not_log(tmp_path):
    history = [{"step": s, "reward": s / 10, "entropy": 1.0 - s / 20} for s in range(1, 6)]
    written = plot_training_curves(history, tmp_path, validation={"pass@1": ([0, 5], [0.1, 0.3])}, prefix="x_")
    assert sorted(p.name for p in written) == ["x_entropy.png", "x_reward.png", "x_validation.png"]


def test_home_is_refused_as_the_demos_folder_naming_its_option(tmp_path, monkeypatch, capsys):
    """`$HOME` (here an empty one) is never the demo's folder: refused before any work, the message naming `--out`."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert main(["demo", "--out", str(home), "--smoke"]) == 2
    err = capsys.readouterr().err
    assert f"--out {home} is" in err and "--training.output_dir" not in err
    assert list(home.iterdir()) == []
