"""The output folder's state and what `train` does with it (recipe/output_folder.py, trainer/manifest.py), mostly
without training: a used folder is refused, `--overwrite` deletes exactly what the run recorded in its manifest (and,
for a run from before manifests, its outputs by their exact names) and never deletes through a symlink out of the run
folder, a folder holding other files needs `--allow-other-files`, the filesystem root and `$HOME` are never used,
`--resume` picks the latest complete checkpoint, resuming from an older one un-commits the later ones; the
command-line flags and the printed resume command. One slow test runs the audit's cases through `prorl-trl`."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

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
from prorl_trl.trainer.manifest import MANIFEST_NAME, read_manifest, record_outputs


def fake_run(folder, checkpoints=((0, 1), (0, 2), (1, 1)), finished=False):
    """The files a run leaves (checkpoint folders with their commit record), plus a file of the user's."""
    for phase, step in checkpoints:
        checkpoint = folder / f"phase-{phase}" / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        state = {"phase_index": phase, "phase_name": f"p{phase}", "global_step": 2 * phase + step, "resets": phase,
                 "phase_global_step": step, "global_step_offset": 2 * phase}  # fmt: skip
        (checkpoint / PRORL_STATE_NAME).write_text(json.dumps(state))
    (folder / "phase-1" / "checkpoint-2").mkdir()  # an interrupted save: no commit record
    (folder / "recipe.yaml").write_text("x: 1\n")
    (folder / "runs" / "May01_host").mkdir(parents=True)
    (folder / "runs" / "May01_host" / "events.out.tfevents.1.host").write_bytes(b"")
    (folder / "prorl_trackers.json").write_text(json.dumps({"tensorboard": str(folder / "runs" / "May01_host")}))
    (folder / "runs" / "other-run").mkdir()  # not TensorBoard events of this run
    (folder / "notes.txt").write_text("mine")
    if finished:
        (folder / "final").mkdir()
        (folder / "final" / PRORL_STATE_NAME).write_text(json.dumps({"finished": True, "global_step": 3, "resets": 1}))


def test_a_new_or_empty_folder_starts_and_one_with_other_files_needs_the_flag(tmp_path):
    assert plan_start(tmp_path / "new").resume is None
    assert plan_start(tmp_path).resume is None  # an existing empty folder
    (tmp_path / "notes.txt").write_text("mine")  # a folder with only the user's files holds no run...
    assert not inspect_output_folder(tmp_path).used
    with pytest.raises(OutputFolderError, match=r"holds files this run did not write: notes.txt.*--allow-other-files"):
        plan_start(tmp_path)  # ...and is not the run's to write into, unless the user says so
    with pytest.raises(OutputFolderError, match="allow-other-files"):
        plan_start(tmp_path, resume=True)  # nothing to resume: a fresh start, checked the same way
    assert plan_start(tmp_path, allow_other_files=True).resume is None
    (tmp_path / "README.md").write_text("# my notes")  # TRL writes its model card there: refused even then
    with pytest.raises(OutputFolderError, match="README.md, named like outputs this run writes"):
        plan_start(tmp_path, allow_other_files=True)
    (tmp_path / "README.md").unlink()
    (tmp_path / "completions").mkdir()  # written only with log_completions (`run_writes`)
    assert plan_start(tmp_path, allow_other_files=True).resume is None
    with pytest.raises(OutputFolderError, match="completions/, named like outputs"):
        plan_start(tmp_path, allow_other_files=True, writes=["completions/"])


@pytest.mark.parametrize("where", ["root", "home", "above home"])
def test_the_filesystem_root_and_home_are_never_used(tmp_path, monkeypatch, where):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    folder = {"root": Path("/"), "home": home, "above home": tmp_path}[where]
    for flags in ({}, {"allow_other_files": True}, {"overwrite": True, "allow_other_files": True}, {"resume": True}):
        with pytest.raises(OutputFolderError, match="not even with --allow-other-files"):
            plan_start(folder, **flags)


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


def test_overwrite_of_a_run_from_before_manifests_deletes_its_exact_names(tmp_path):
    """No manifest: the outputs are the exact names such a run wrote; user files named like them are kept."""
    fake_run(tmp_path, finished=True)
    for name in ("phase-1-plan.md", "final-notes.txt", "README.md"):  # README.md: not TRL's model card
        (tmp_path / name).write_text("mine")
    for name in ("completions", "distill", "completions-old", "phase-2-drafts"):  # the recipe wrote neither
        (tmp_path / name / "x").mkdir(parents=True)
    (tmp_path / ".recipe.yaml.tmp").write_text("x")  # a write of the run's, killed
    with pytest.raises(OutputFolderError, match="README.md, named like outputs"):
        plan_start(tmp_path, overwrite=True, allow_other_files=True)
    (tmp_path / "README.md").unlink()
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    with pytest.raises(OutputFolderError, match="did not write: completions/, completions-old/, distill/"):
        plan_start(tmp_path, overwrite=True)
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")} == before  # refused: nothing changed
    plan = plan_start(tmp_path, overwrite=True, allow_other_files=True)
    deleted, kept = delete_run_outputs(plan.state)
    expected = {"phase-0/", "phase-1/", "final/", "recipe.yaml", "prorl_trackers.json", "runs/May01_host/"}
    assert set(deleted) == expected | {".recipe.yaml.tmp"} and kept == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "completions", "completions-old", "distill", "final-notes.txt", "notes.txt", "phase-1-plan.md",
        "phase-2-drafts", "runs",
    ]  # fmt: skip
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["other-run"]


def test_a_trackers_file_naming_runs_dot_dot_never_empties_the_run_folder(tmp_path):
    """Audit finding: a run without a manifest whose `prorl_trackers.json` said `"tensorboard": "runs/.."` made
    `--overwrite --allow-other-files` delete the whole run folder, user files included, then crash."""
    fake_run(tmp_path, finished=True)
    (tmp_path / "prorl_trackers.json").write_text(json.dumps({"tensorboard": "runs/.."}))
    plan = plan_start(tmp_path, overwrite=True, allow_other_files=True)
    assert not any(".." in name for name in plan.state.outputs)
    deleted, kept = delete_run_outputs(plan.state)
    assert "runs/../" not in deleted and (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "runs" / "May01_host").is_dir()  # no longer named by the trackers file: not the run's
    state = inspect_output_folder(tmp_path)  # whoever names `..` or the folder itself, nothing above is deleted
    state.outputs[:] = ["runs/../", "../", "./"]
    deleted, kept = delete_run_outputs(state)
    assert deleted == [] and sorted(kept) == ["../", "./", "runs/../"] and (tmp_path / "notes.txt").is_file()


def test_overwrite_deletes_the_manifest_paths_and_never_through_a_symlink(tmp_path):
    """`runs/` linked into a shared TensorBoard folder: the run's own event folder there is kept, other people's
    runs are untouched; user files named like outputs (never recorded: they existed first) survive."""
    run, shared = tmp_path / "run", tmp_path / "shared-tb"
    (shared / "other-experiment").mkdir(parents=True)
    (shared / "other-experiment" / "events.out.tfevents.1.a").write_text("theirs")
    run.mkdir()
    (run / "runs").symlink_to(shared)
    (run / "completions").mkdir()
    (run / "phase-1-plan.md").write_text("mine")
    record_outputs(run, ["recipe.yaml", "phase-0/", "final/", "completions/", "distill/"])  # before creating them
    assert read_manifest(run) == ["distill/", "final/", "phase-0/", "recipe.yaml"]  # completions/ existed: not ours
    for name in ("phase-0/checkpoint-1", "final", "distill"):
        (run / name).mkdir(parents=True)
    (run / "recipe.yaml").write_text("x: 1\n")
    (run / "runs" / "May01_host").mkdir()  # TensorBoard's writer creates it (through the link), then it is recorded
    record_outputs(run, ["runs/May01_host/", "../elsewhere/", str(tmp_path / "abs")], created=True)
    assert "runs/May01_host/" in read_manifest(run) and len(read_manifest(run)) == 5  # nothing outside the folder

    state = inspect_output_folder(run)
    assert state.foreign == ["completions/", "phase-1-plan.md", "runs/"]  # the symlink is the user's
    with pytest.raises(OutputFolderError, match="did not write: completions/, phase-1-plan.md, runs/"):
        plan_start(run, overwrite=True)
    deleted, kept = delete_run_outputs(plan_start(run, overwrite=True, allow_other_files=True).state)
    assert set(deleted) == {"distill/", "final/", "phase-0/", "recipe.yaml"} and kept == ["runs/May01_host/"]
    assert sorted(p.name for p in run.iterdir()) == ["completions", "phase-1-plan.md", "runs"]  # manifest gone too
    assert sorted(p.name for p in shared.iterdir()) == ["May01_host", "other-experiment"]
    assert (run / "runs").is_symlink() and (shared / "other-experiment" / "events.out.tfevents.1.a").exists()


def test_overwrite_reports_a_recorded_path_that_became_a_symlink_as_unlinked_not_deleted(tmp_path):
    """Audit finding (issue 37): a recorded output replaced by a symlink lost only the link, but the message listed it
    as deleted. The link goes, its target and everything in it stays, and the message says which happened."""
    run, elsewhere = tmp_path / "run", tmp_path / "archive"
    (elsewhere / "checkpoint-9").mkdir(parents=True)
    (elsewhere / "checkpoint-9" / "weights").write_text("kept")
    run.mkdir()
    record_outputs(run, ["phase-0/", "recipe.yaml"])
    (run / "phase-0").symlink_to(elsewhere, target_is_directory=True)
    (run / "recipe.yaml").write_text("x: 1\n")
    deleted, kept = delete_run_outputs(plan_start(run, overwrite=True).state)
    assert sorted(deleted) == ["phase-0/ (a symlink: the link removed and its target kept)", "recipe.yaml"] and not kept
    assert not (run / "phase-0").exists() and (elsewhere / "checkpoint-9" / "weights").read_text() == "kept"


def test_a_manifest_never_names_anything_outside_the_run_folder(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / MANIFEST_NAME).write_text(json.dumps({"format": 1, "paths": ["../precious.txt", str(outside), "a.txt"]}))
    (run / "a.txt").write_text("run's")
    assert read_manifest(run) == ["a.txt"]
    deleted, _ = delete_run_outputs(plan_start(run, overwrite=True).state)
    assert deleted == ["a.txt"] and outside.read_text() == "keep" and list(run.iterdir()) == []


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
    assert split_run_flags(["--overwrite", "--allow-other-files", "--x", "2"]) == (None, True, ["--x", "2"])


def test_resume_command_repeats_the_launch_with_resume():
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "-m", "prorl_trl",
                "train", "r.yaml", "--training.learning_rate", "1e-6", "--overwrite"]  # fmt: skip
    command = shlex.split(resume_command(launcher, argv=["ignored"]))
    assert command == launcher[:-1] + ["--resume"]
    own = shlex.split(resume_command([], argv=["/usr/bin/prorl-trl", "train", "r y.yaml", "--resume", "p/c-1"]))
    assert own == ["prorl-trl", "train", "r y.yaml", "--resume"]
    # `train --resume RECIPE` resumes RECIPE (`--resume` takes a checkpoint only after RECIPE): the recipe is kept
    first = ["/usr/bin/prorl-trl", "train", "--resume", "r.yaml", "--phases.1.max_steps", "4"]
    assert shlex.split(resume_command([], argv=first)) == ["prorl-trl", "train", "r.yaml", "--phases.1.max_steps", "4",
                                                             "--resume"]  # fmt: skip
    started = ["/usr/bin/prorl-trl", "train", "r.yaml", "--allow-other-files", "--overwrite"]  # a resume needs neither
    assert shlex.split(resume_command([], argv=started)) == ["prorl-trl", "train", "r.yaml", "--resume"]
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
    checkpoint = "p/checkpoint-2"
    assert parsed("r.yaml", "--resume", checkpoint, "--x", "1") == ("r.yaml", checkpoint, False, ["--x", "1"])
    assert parsed("r.yaml", "--resume", "--x", "1") == ("r.yaml", True, False, ["--x", "1"])
    assert parsed("--overwrite", "r.yaml", "--lr", "2") == ("r.yaml", None, True, ["--lr", "2"])


def test_validate_tells_what_train_would_do_with_the_output_folder(tmp_path, capsys):
    """`validate` refuses a used folder exactly as `train` would (exit 2, nothing changed), and with the same
    `--resume` / `--overwrite` passes and says what `train` would do."""
    from pathlib import Path

    from prorl_trl.cli import main

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "demo_tiny.yaml"
    fake_run(tmp_path)
    (tmp_path / "recipe.yaml").write_text(recipe.read_text())  # the run was started from this recipe
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    base = ["validate", str(recipe), "--training.output_dir", str(tmp_path), "--no-machine-checks"]
    assert main(base) == 2
    assert "holds an unfinished run" in capsys.readouterr().err
    assert main(base + ["--resume"]) == 0  # output_dir differs from the recorded one: not a change that needs a flag
    assert "resuming from" in capsys.readouterr().err
    assert main(base + ["--overwrite"]) == 2  # the user's notes.txt and runs/other-run/ are there too
    assert "holds files this run did not write: notes.txt, runs/other-run/" in capsys.readouterr().err
    assert main(base + ["--overwrite", "--allow-other-files"]) == 0
    assert "would delete the outputs" in capsys.readouterr().err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # validate never changes the folder


def test_validate_and_train_refuse_the_filesystem_root_and_home(tmp_path, monkeypatch, capsys, tiny_dir):
    """`output_dir: /` and `$HOME` (also written `~`) exit 2 before anything is loaded, whatever the flags."""
    from prorl_trl.cli import main

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "demo_tiny.yaml"
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for folder in ("/", str(home), "~/"):  # (a bare `~` is YAML for null: refused as no folder)
        for command in (["validate", "--no-machine-checks"], ["train", "--model.name_or_path", str(tiny_dir)]):
            argv = [command[0], str(recipe), *command[1:], "--training.output_dir", folder, "--allow-other-files"]
            assert main(argv) == 2
            error = capsys.readouterr().err
            assert "not even with --allow-other-files" in error and "Nothing was changed" in error, error
    assert list(home.iterdir()) == []


@pytest.mark.slow
def test_audit_cases_through_the_cli(tiny_dir, shared_data, tmp_path):
    """As the audit ran them: `HOME=X prorl-trl train R --training.output_dir '~/run'` twice (the second exits 2 and
    changes nothing); then, with `runs/` linked into a shared TensorBoard folder and user files named like outputs,
    `--overwrite` exits 2 naming them, and `--overwrite --allow-other-files` deletes the run's own outputs only."""
    repo = Path(__file__).resolve().parent.parent
    program = Path(sys.executable).with_name("prorl-trl")
    home = tmp_path / "home"
    home.mkdir()
    environment = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data)}
    command = [
        str(program) if program.exists() else sys.executable, *([] if program.exists() else ["-m", "prorl_trl"]),
        "train", str(repo / "tests" / "recipes" / "tiny_gsm8k.yaml"), "--model.name_or_path", str(tiny_dir),
        "--training.output_dir", "~/run", "--training.report_to", "tensorboard", "--validation.enabled", "false",
    ]  # fmt: skip

    def train(*extra):
        run = [*command, *extra]
        return subprocess.run(run, check=False, capture_output=True, text=True, cwd=repo, env=environment, timeout=300)

    def files(folder):
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))

    first = train()
    assert first.returncode == 0, first.stderr[-3000:]
    run = home / "run"
    assert (run / "final" / "config.json").is_file() and not (repo / "~").exists()
    (tensorboard,) = [p for p in read_manifest(run) if p.startswith("runs/")]
    assert f"TensorBoard:  {run / tensorboard.rstrip('/')}/" in first.stdout  # where the events are (issue 39)
    assert (run / tensorboard).is_dir()
    # one line for the model load (LoRA: no second copy for the reference), not a "Loading weights" bar per load
    assert first.stderr.count(f"loading {tiny_dir}: policy ...") == 1 and "Loading weights" not in first.stderr
    before = files(run)
    second = train()
    assert second.returncode == 2 and "holds a finished run" in second.stderr, second.stderr[-2000:]
    assert files(run) == before

    shared = tmp_path / "shared-tb"  # the user moves TensorBoard's runs into a shared folder and links it
    (run / "runs").rename(shared)
    (run / "runs").symlink_to(shared)
    (shared / "other-experiment").mkdir()
    (shared / "other-experiment" / "events.out.tfevents.1.b").write_text("theirs")
    for folder in ("completions", "distill"):
        (run / folder).mkdir()
        (run / folder / "mine.txt").write_text("mine")
    (run / "phase-1-plan.md").write_text("mine")
    (run / "final" / "sentinel").write_text("the old run's")
    refused = train("--overwrite")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "did not write: completions/, distill/, phase-1-plan.md, runs/" in refused.stderr
    assert (run / "final" / "sentinel").exists()

    archived = tmp_path / "archived_summary.json"  # a recorded output the user replaced by a link to their copy
    (run / "run_summary.json").rename(archived)
    (run / "run_summary.json").symlink_to(archived)
    overwritten = train("--overwrite", "--allow-other-files")
    assert overwritten.returncode == 0, overwritten.stderr[-3000:]
    deleted = overwritten.stdout.split("--overwrite: deleted ")[1].split(" in ")[0].split(", ")
    assert {"final/", "recipe.yaml", "prorl_log_history.json"} <= set(deleted)
    assert "run_summary.json (a symlink: the link removed and its target kept)" in deleted and archived.is_file()
    assert not {"completions/", "distill/", "phase-1-plan.md", "runs/"} & set(deleted)
    assert f"--overwrite: kept {tensorboard}" in overwritten.stdout  # through the link: left where it is
    assert not (run / "final" / "sentinel").exists() and (run / "final" / "config.json").is_file()
    assert all((run / folder / "mine.txt").read_text() == "mine" for folder in ("completions", "distill"))
    assert (run / "phase-1-plan.md").exists() and (run / "runs").is_symlink()
    assert (shared / "other-experiment" / "events.out.tfevents.1.b").read_text() == "theirs"
    assert (shared / Path(tensorboard).name).is_dir()


def test_a_users_own_files_named_like_a_runs_are_not_taken_for_an_earlier_run(tmp_path):
    """Without a manifest, names alone made a folder an earlier run's: a user's recipe.yaml beside nothing else was
    offered to --overwrite (which deleted it), and a --resume there trained among the user's files (a README.md
    rewritten by the model card). A run leaves a phase folder, final/ or its log history."""
    from prorl_trl.trainer.manifest import legacy_outputs, record_outputs

    (tmp_path / "recipe.yaml").write_text("# my recipe\nmodel: x\n")
    assert legacy_outputs(tmp_path) == []
    for flags in ({"overwrite": True}, {"resume": True}):
        with pytest.raises(OutputFolderError):
            plan_start(tmp_path, **flags)
    assert (tmp_path / "recipe.yaml").read_text() == "# my recipe\nmodel: x\n"
    attempt = tmp_path / "attempt"  # an attempt that wrote no checkpoint, and a user's README.md added since
    attempt.mkdir()
    record_outputs(attempt, ["recipe.yaml"])
    (attempt / "recipe.yaml").write_text("model: x\n")
    (attempt / "README.md").write_text("my notes")
    for flags in ({}, {"allow_other_files": True}):  # a name the run writes: never written over
        with pytest.raises(OutputFolderError, match="README.md"):
            plan_start(attempt, resume=True, **flags)
    (attempt / "README.md").rename(attempt / "notes.txt")  # a file it does not write: a resume goes on (the command
    assert plan_start(attempt, resume=True).note  # it prints drops --allow-other-files), starting again, said so


def test_leftovers_are_only_the_temporary_names_the_package_writes():
    """A user's `.final.old-keep-before-rerun/` beside the run's final/ was taken for a killed save's leftover and
    deleted by --overwrite without being listed."""
    from prorl_trl.trainer.manifest import is_leftover_of

    owned = ["final/", "recipe.yaml"]
    for name in (".final.old-4242", ".final.tmp-ab_3x9zq", ".recipe.yaml.tmp", MANIFEST_NAME):
        assert is_leftover_of(name, owned), name
    for name in (".final.old-keep-before-rerun", ".recipe.yaml.tmp-mynotes", ".other.old-12"):
        assert not is_leftover_of(name, owned), name


@pytest.mark.parametrize("kind", ["ablate", "distill"])
def test_train_never_takes_an_ablations_or_a_distillations_folder_for_a_run(tmp_path, kind):
    """Their manifests say which command wrote them: `train --overwrite` in an ablation's `--out` would otherwise
    delete its tables and variant runs as its own outputs."""
    output = {"ablate": "summary.csv", "distill": "distilled.jsonl"}[kind]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 1, "kind": kind, "paths": [output]}))
    (tmp_path / output).write_text("theirs")
    for flags in ({}, {"resume": True}, {"overwrite": True, "allow_other_files": True}):
        with pytest.raises(OutputFolderError, match=f"holds the outputs of `prorl-trl {kind}`.*--training.output_dir"):
            plan_start(tmp_path, **flags)
    assert (tmp_path / output).read_text() == "theirs"
