"""The output folder's state and what `train` does with it (recipe/output_folder.py), without training: a used folder
is refused, `--overwrite` deletes run outputs and nothing else, `--resume` picks the latest complete checkpoint,
resuming from an older one un-commits the later ones; the command-line flags and the printed resume command."""

import json
import shlex
import sys

import pytest

from prorl_trl.recipe.output_folder import (
    OutputFolderError,
    delete_run_outputs,
    inspect_output_folder,
    plan_start,
    resume_command,
    split_run_flags,
)
from prorl_trl.reset.checkpoint import PRORL_STATE_NAME, latest_checkpoint, supersede_after


def fake_run(folder, checkpoints=((0, 1), (0, 2), (1, 1)), finished=False):
    """The files a run leaves (checkpoint folders with their commit record), plus a file of the user's."""
    for phase, step in checkpoints:
        checkpoint = folder / f"phase-{phase}" / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        state = {"phase_index": phase, "phase_name": f"p{phase}", "global_step": 2 * phase + step, "resets": phase}
        (checkpoint / PRORL_STATE_NAME).write_text(json.dumps(state))
    (folder / "phase-1" / "checkpoint-2").mkdir()  # an interrupted save: no commit record
    (folder / "recipe.yaml").write_text("x: 1\n")
    (folder / "runs" / "May01_host").mkdir(parents=True)
    (folder / "runs" / "May01_host" / "events.out.tfevents.1.host").write_bytes(b"")
    (folder / "runs" / "other-run").mkdir()  # not TensorBoard events of this run
    (folder / "notes.txt").write_text("mine")
    if finished:
        (folder / "final").mkdir()
        (folder / "final" / PRORL_STATE_NAME).write_text(json.dumps({"finished": True, "global_step": 3, "resets": 1}))


def test_empty_or_missing_folder_starts(tmp_path):
    assert plan_start(tmp_path / "new").resume is None
    (tmp_path / "notes.txt").write_text("mine")  # a folder with only the user's files holds no run
    assert not inspect_output_folder(tmp_path).used and plan_start(tmp_path).resume is None


def test_used_folder_is_refused_and_resume_picks_the_latest_complete_checkpoint(tmp_path):
    fake_run(tmp_path)
    with pytest.raises(OutputFolderError, match="holds an unfinished run; latest complete checkpoint: .*checkpoint-1"):
        plan_start(tmp_path)
    plan = plan_start(tmp_path, resume=True)
    assert plan.resume == str(tmp_path / "phase-1" / "checkpoint-1") and not plan.finished
    assert plan_start(tmp_path, resume=str(tmp_path / "phase-0" / "checkpoint-2")).resume.endswith("checkpoint-2")
    with pytest.raises(OutputFolderError, match="not a complete ProRL checkpoint"):
        plan_start(tmp_path, resume=str(tmp_path / "phase-1" / "checkpoint-2"))
    with pytest.raises(OutputFolderError, match="contradict"):
        plan_start(tmp_path, resume=True, overwrite=True)


def test_finished_run_is_reported_finished(tmp_path):
    fake_run(tmp_path, finished=True)
    assert plan_start(tmp_path, resume=True).finished
    with pytest.raises(OutputFolderError, match="holds a finished run"):
        plan_start(tmp_path)


def test_overwrite_deletes_the_run_outputs_and_nothing_else(tmp_path):
    fake_run(tmp_path, finished=True)
    plan = plan_start(tmp_path, overwrite=True)
    removed = delete_run_outputs(plan.state)
    assert set(removed) == {"phase-0/", "phase-1/", "final/", "recipe.yaml", "runs/May01_host/"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "runs"]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["other-run"]


def test_resuming_from_an_older_checkpoint_uncommits_the_later_ones(tmp_path):
    fake_run(tmp_path, finished=True)
    changed = supersede_after(tmp_path, tmp_path / "phase-0" / "checkpoint-2")
    assert [p.relative_to(tmp_path).as_posix() for p in changed] == ["phase-1/checkpoint-1", "final"]
    assert latest_checkpoint(tmp_path) == tmp_path / "phase-0" / "checkpoint-2"
    assert not inspect_output_folder(tmp_path).finished
    assert supersede_after(tmp_path, tmp_path / "phase-0" / "checkpoint-2") == []  # now the latest: nothing after it


def test_run_flags_after_the_recipe():
    assert split_run_flags(["--lr", "1", "--resume"]) == (True, False, ["--lr", "1"])
    assert split_run_flags(["--resume", "a/ckpt", "--x", "2"]) == ("a/ckpt", False, ["--x", "2"])
    assert split_run_flags(["--resume=a/ckpt", "--overwrite"]) == ("a/ckpt", True, [])
    assert split_run_flags(["--resume", "--x", "2"]) == (True, False, ["--x", "2"])


def test_resume_command_repeats_the_launch_with_resume():
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "-m", "prorl_trl",
                "train", "r.yaml", "--training.learning_rate", "1e-6", "--overwrite"]  # fmt: skip
    command = shlex.split(resume_command(launcher, argv=["ignored"]))
    assert command == launcher[:-1] + ["--resume"]
    own = shlex.split(resume_command([], argv=["/usr/bin/prorl-trl", "train", "r y.yaml", "--resume", "p/c-1"]))
    assert own == ["prorl-trl", "train", "r y.yaml", "--resume"]
    module = shlex.split(resume_command(["/bin/bash"], argv=["/x/prorl_trl/__main__.py", "train", "r.yaml"]))
    assert module == [sys.executable, "-m", "prorl_trl", "train", "r.yaml", "--resume"]
    for torchrun in (["/venv/bin/torchrun"], [sys.executable, "-m", "torch.distributed.run"]):  # keep the processes
        launch = torchrun + ["--nproc_per_node", "4", "-m", "prorl_trl", "train", "r.yaml"]
        assert shlex.split(resume_command(launch, argv=["ignored"])) == launch + ["--resume"]


def test_train_takes_resume_and_overwrite_before_or_after_the_recipe():
    from prorl_trl.cli import parse_command_line

    def parsed(*argv):
        _, args = parse_command_line(["train", *argv])
        return args.recipe, args.resume, args.overwrite, args.overrides

    assert parsed("r.yaml", "--resume") == ("r.yaml", True, False, [])
    assert parsed("--resume", "r.yaml", "--x", "1") == ("r.yaml", True, False, ["--x", "1"])
    assert parsed("r.yaml", "--resume", "p/checkpoint-2", "--x", "1") == ("r.yaml", "p/checkpoint-2", False, ["--x", "1"])
    assert parsed("r.yaml", "--resume", "--x", "1") == ("r.yaml", True, False, ["--x", "1"])
    assert parsed("--overwrite", "r.yaml", "--lr", "2") == ("r.yaml", None, True, ["--lr", "2"])


def test_validate_tells_what_train_would_do_with_the_output_folder(tmp_path, capsys):
    """`validate` refuses a used folder exactly as `train` would (exit 2, nothing changed), and with the same
    `--resume` / `--overwrite` passes and says what `train` would do."""
    from pathlib import Path

    from prorl_trl.cli import main

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "demo_tiny.yaml"
    fake_run(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    base = ["validate", str(recipe), "--training.output_dir", str(tmp_path), "--no-machine-checks"]
    assert main(base) == 2
    assert "holds an unfinished run" in capsys.readouterr().err
    assert main(base + ["--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert main(base + ["--overwrite"]) == 0
    assert "would delete the outputs" in capsys.readouterr().err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # validate never changes the folder
