"""`prorl-trl train --resume` as users run it: CLI processes killed with SIGKILL at eight exact points, a SIGTERM under
`accelerate launch` and under a 2-process torchrun, a resume on more processes than the run's, a full disk, and a
second `train` into a used folder.

Every run goes through `tests/_kill_launcher.py` (the real CLI; the launcher only injects the fault named by an
environment variable and registers the `token_hash` reward, which varies inside every group so every step moves the
weights). The recipe is tests/recipes/tiny_gsm8k.yaml with two phases of 3 steps, a LoRA reshape and hard reset
between them, validation every 2 steps and a checkpoint every step. One uninterrupted run is the reference for all.
Cost: ~14 CLI processes of ~7 s each on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import _cli_fork
import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, str(REPO / "tests" / "_kill_launcher.py")]
RECIPE = str(REPO / "tests" / "recipes" / "tiny_gsm8k.yaml")
SHAPE = [
    "--rewards", "[token_hash]", "--training.save_strategy", "steps", "--training.save_steps", "1",
    "--phases.0.max_steps", "3", "--phases.1.max_steps", "3", "--validation.eval_steps", "2",
]  # fmt: skip

# The chain of kills, each followed by `--resume` (the next entry's run is that resume, killed at its own point).
KILL_POINTS = [
    ("on_step_begin:0:1", "before the first checkpoint"),
    ("on_save:0:2", "during a checkpoint save (files written, not committed)"),
    ("on_step_begin:0:3", "mid-phase"),
    ("on_train_end:0:3", "at the last step of a phase (its checkpoint committed)"),
    ("save:reset-1:0:0", "during the merged save of the reset (second kill in a row without a new checkpoint)"),
    ("on_step_begin:1:1", "right after the reset"),
    ("on_step_begin:1:3", "mid-phase after the reset"),
    ("save:final:0:0", "during the save of final/"),
]


def cli(
    out: Path, tiny_dir: Path, shared_data: Path, *extra: str, env: dict | None = None, launcher=None,
    group_timeout: int | None = None,
):  # fmt: skip
    """The CLI on the test recipe; with `group_timeout`, in a session of its own, killed whole when it runs longer."""
    command = (launcher or LAUNCHER) + [
        "train", RECIPE, "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out), *SHAPE, *extra,
    ]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data), **(env or {})}
    if group_timeout is not None:
        return run_as_group(command, environment, group_timeout)
    return _cli_fork.run(command, cwd=REPO, env=environment, timeout=300)  # forked from a server that has imported


def run_as_group(command: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Run `command` in a new session and fail the test if it outlives `timeout`, after killing the whole session: a
    rank left waiting in a collective the others skipped must not outlive its launcher (torchrun's workers would)."""
    with subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"still running after {timeout} s (a hang in a collective?), killed:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def final_weights(out: Path) -> dict:
    return load_file(out / "final" / "model.safetensors")


def assert_same_weights(out: Path, reference: Path) -> None:
    want, got = final_weights(reference), final_weights(out)
    assert want.keys() == got.keys()
    different = [name for name in want if not want[name].equal(got[name])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run, e.g. {different[:3]}"


WALL_CLOCK = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")  # of one process


def history(out: Path) -> list[dict]:
    """The run's log, entry for entry with every key (the reset probe's, HF's per-call summaries with `train_loss`)
    but the wall-clock figures; a merged save's folder as `merged/<name>` (the log holds where it was written, which
    for a copied run folder is the original's place)."""
    entries = json.loads((out / "run_summary.json").read_text())["log_history"]
    kept = [{key: value for key, value in entry.items() if key not in WALL_CLOCK} for entry in entries]
    for entry in kept:
        if "merged_checkpoint" in entry:
            entry["merged_checkpoint"] = "/".join(Path(entry["merged_checkpoint"]).parts[-2:])
    return kept


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() + str(path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def reference(tiny_dir, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    result = cli(out, tiny_dir, shared_data)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_reference_run_trains(reference, tiny_dir):
    from safetensors.torch import load_file as load

    steps = [entry["prorl/global_step"] for entry in history(reference) if "loss" in entry]
    assert steps == [1, 2, 3, 4, 5, 6]
    start = load(tiny_dir / "model.safetensors")
    moved = {k: (final_weights(reference)[k] - v).abs().max().item() for k, v in start.items()}
    assert max(moved.values()) > 1e-4  # the comparison below is not between two untrained models


def test_sigkill_at_eight_points_then_resume_is_bit_identical(reference, tiny_dir, shared_data, tmp_path):
    out = tmp_path / "run"
    for point, where in KILL_POINTS:
        result = cli(out, tiny_dir, shared_data, "--resume", env={"PRORL_TEST_KILL_AT": point})
        assert result.returncode == -9, f"kill {where} ({point}) did not happen: {result.stderr[-2000:]}"
        assert "Traceback" not in result.stderr, result.stderr[-2000:]
    result = cli(out, tiny_dir, shared_data, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "phase 2 'second', global step 6" in result.stdout
    assert_same_weights(out, reference)
    assert history(out) == history(reference)  # same steps (no extra one), losses, validations, phase starts
    assert json.loads((out / "final" / "prorl_state.json").read_text())["global_step"] == 6

    # Resuming the finished run says so and changes nothing (no model is loaded: no recipe table printed).
    before = snapshot(out)
    result = cli(out, tiny_dir, shared_data, "--resume")
    assert result.returncode == 0 and "holds a finished run" in result.stdout and "nothing was changed" in result.stdout
    assert "phase " not in result.stdout.split("holds a finished run")[0]
    assert snapshot(out) == before


def test_a_resume_that_makes_the_reset_logs_what_the_uninterrupted_run_logged(reference, tiny_dir, shared_data, tmp_path):
    """Killed after phase 0's last checkpoint: the resume runs the reset between the phases, and its log has the reset
    probe's metrics (from the rows the checkpoint kept) and phase 0's summary with its `train_loss`, as the
    uninterrupted run's has."""
    out = tmp_path / "run"
    killed = cli(out, tiny_dir, shared_data, env={"PRORL_TEST_KILL_AT": "on_train_end:0:3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "phase-0" / "checkpoint-3" / "reset_probe_0.safetensors").is_file() and not (out / "phase-1").exists()
    resumed = cli(out, tiny_dir, shared_data, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert history(out) == history(reference)
    probed = [entry for entry in history(out) if "prorl/reset_logp_change" in entry]
    assert [entry["prorl/global_step"] for entry in probed] == [4] and "prorl/reset_effect_lost" in probed[0]
    summaries = [entry["prorl/global_step"] for entry in history(out) if "train_loss" in entry]
    assert summaries == [3, 6]


def test_second_train_into_a_used_folder_exits_2_and_changes_nothing(reference, tiny_dir, shared_data):
    before = snapshot(reference)
    result = cli(reference, tiny_dir, shared_data)
    assert result.returncode == 2
    assert "holds a finished run" in result.stderr and "--resume" in result.stderr and "--overwrite" in result.stderr
    assert "Traceback" not in result.stderr and "lora_r" not in result.stdout  # refused before the recipe table
    assert snapshot(reference) == before


def test_overwrite_with_a_lora_target_the_model_lacks_exits_2_and_deletes_nothing(reference, tiny_dir, shared_data):
    """The targets are checked (PEFT's matching, on a meta-device model) before `--overwrite` deletes: a typo there
    was found at model load, after the finished run had been deleted."""
    before = snapshot(reference)
    result = cli(reference, tiny_dir, shared_data, "--overwrite", "--phases.1.lora_target_modules", "[nope_proj]")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "phases.1.lora_target_modules" in result.stderr and "nope_proj" in result.stderr
    assert "Traceback" not in result.stderr and "--overwrite: deleted" not in result.stdout
    assert snapshot(reference) == before


def test_sigterm_under_accelerate_launch_checkpoints_and_prints_the_resume_command(
    reference, tiny_dir, shared_data, tmp_path
):
    """SIGTERM goes to the `accelerate launch` process (as `kill <pid>` would): the launcher dies without forwarding
    it, the training process gets it as its launcher's death signal, finishes its step, checkpoints and says how to
    resume; the printed command, run as is, ends on the uninterrupted weights."""
    out = tmp_path / "run"
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  "recipes/accelerate/single_gpu.yaml", "--cpu", str(REPO / "tests" / "_kill_launcher.py")]  # fmt: skip
    result = cli(out, tiny_dir, shared_data, env={"PRORL_TEST_TERM_AT": "on_step_begin:0:2"}, launcher=accelerate)
    assert "SIGTERM received" in result.stderr, result.stderr[-3000:]
    assert "stopped by SIGTERM at global step" in result.stdout, result.stdout[-2000:]
    checkpoint = result.stdout.split("checkpoint written: ")[1].split()[0].rstrip("/")
    assert Path(checkpoint, "prorl_state.json").is_file()
    command = result.stdout.split("resume with:\n")[1].strip().splitlines()[0]
    argv = shlex.split(command)
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and argv[-1] == "--resume"
    assert not (out / "final").exists()

    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data)}
    resumed = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=environment, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(out, reference)
    assert history(out) == history(reference)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(REPO / "tests" / "_kill_launcher.py")]  # fmt: skip


def test_processes_that_form_no_group_are_refused_before_anything_is_written(tiny_dir, shared_data, tmp_path):
    """Two torchrun workers on a CPU without `use_cpu` form no process group: each would train alone into one folder."""
    result = cli(tmp_path / "run", tiny_dir, shared_data, launcher=TORCHRUN)
    assert result.returncode != 0 and "did not form a process group" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_sigterm_under_torchrun_stops_both_ranks_at_one_step_and_the_printed_command_resumes_exactly(
    tiny_dir, shared_data, tmp_path
):
    """torchrun forwards SIGTERM to both workers: they finish the same step, write one checkpoint, print a resume
    command that relaunches both processes; running it ends on the weights and log of an uninterrupted 2-process run."""
    group = ("--training.use_cpu", "true")
    reference = tmp_path / "reference"
    done = cli(reference, tiny_dir, shared_data, *group, launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    result = cli(out, tiny_dir, shared_data, *group, env={"PRORL_TEST_TERM_AT": "on_step_begin:0:2"}, launcher=TORCHRUN)
    assert result.stdout.count("stopped by SIGTERM at global step 2; checkpoint written:") == 1, result.stderr[-3000:]
    assert json.loads((out / "phase-0" / "checkpoint-2" / "prorl_state.json").read_text())["global_step"] == 2
    assert not (out / "phase-0" / "checkpoint-3").exists() and not (out / "final").exists()
    argv = shlex.split(result.stdout.split("resume with:\n")[1].strip().splitlines()[0])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and argv[-1] == "--resume"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PRORL_SHARED_DATA": str(shared_data)}
    resumed = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=environment, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(out, reference)
    assert history(out) == history(reference)


def test_resume_on_more_processes_drops_the_reset_probe_rows_on_every_rank(reference, tiny_dir, shared_data, tmp_path):
    """Phase 0's last checkpoint of the 1-process run, resumed by 2 processes (`--allow-changes`): the reset between
    the phases comes before the first step, and the checkpoint has probe rows for process 0 only. Probing on rank 0
    alone mismatched the probe's collectives (gloo aborted the run; NCCL would hang): now no rank probes, the run is
    told why, and it trains phase 1 to the end. The gloo timeout and the session kill turn a hang into a failure."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    checkpoint = out / "phase-0" / "checkpoint-3"
    assert [path.name for path in checkpoint.glob("reset_probe_*")] == ["reset_probe_0.safetensors"]
    resumed = cli(
        out, tiny_dir, shared_data, "--training.use_cpu", "true", "--training.ddp_timeout", "60",
        "--resume", str(checkpoint), "--allow-changes", launcher=TORCHRUN, group_timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    console = resumed.stdout + resumed.stderr  # the CLI's announcements go to stderr
    assert "holds reset probe rows of 1 process(es) and this run has 2" in console
    assert "ProRL hard reset #1 at global step 3" in console
    assert [entry["prorl/global_step"] for entry in history(out) if "loss" in entry] == [1, 2, 3, 4, 5, 6]
    assert not [entry for entry in history(out) if "prorl/reset_logp_change" in entry]  # none taken, none mixed
    assert (out / "final" / "model.safetensors").is_file()


class FakeTrainer:
    """What `load_probe_rows` reads of a trainer: its process and the run's number of processes, and `announce`."""

    def __init__(self, process_index: int, num_processes: int):
        self.accelerator = type("Accelerator", (), {})()
        self.accelerator.process_index, self.accelerator.num_processes = process_index, num_processes
        self.accelerator.device = torch.device("cpu")
        self.notes: list[str] = []

    def announce(self, message: str) -> None:
        self.notes.append(message)


@pytest.mark.parametrize(
    ("written", "processes", "used"),
    [(1, 2, False), (2, 1, False), (2, 2, True), (1, 1, True), (0, 2, False)],
    ids=["more-processes", "fewer-processes", "same-two", "same-one", "no-rows"],
)
def test_probe_rows_are_used_only_with_one_file_per_process(tmp_path, written, processes, used):
    """Every rank decides alike from the folder's file list (no collective), and says why when rows are dropped."""
    from prorl_trl.trainer.reset_probe import PROBE_FILE, PROBE_KEYS, load_probe_rows

    for rank in range(written):
        save_file({key: torch.full((2, 3), rank) for key in PROBE_KEYS}, str(tmp_path / PROBE_FILE.format(rank)))
    for rank in range(processes):
        trainer = FakeTrainer(rank, processes)
        rows = load_probe_rows(trainer, tmp_path)
        assert (rows is not None) == used
        if used:
            assert set(rows) == set(PROBE_KEYS) and int(rows["prompt_ids"][0, 0]) == rank  # its own file
        assert bool(trainer.notes) == (written > 0 and not used)


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB tmpfs: phase 1's checkpoints fit, the merged save of the reset does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_gives_one_message_and_the_run_resumes_once_space_is_back(
    reference, tiny_dir, shared_data, small_disk
):
    out = small_disk / "run"
    result = cli(out, tiny_dir, shared_data)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    message = result.stderr[result.stderr.index("error: the disk holding"):]
    assert f"{out}/ is full" in message
    assert f"The last complete checkpoint is {out}/phase-0/checkpoint-3" in message and "--resume" in message
    assert not any(path.name.startswith(".reset-1.tmp") for path in (out / "merged").iterdir())  # space given back

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    result = cli(out, tiny_dir, shared_data, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(out, reference)
    assert history(out) == history(reference)


BF16_THREE_PHASES = [
    "--rewards", "[token_hash]", "--model.dtype", "bfloat16", "--training.learning_rate", "3e-5",
    "--training.save_strategy", "steps", "--training.save_steps", "1", "--validation.eval_steps", "100",
    "--phases", "[{name: first, max_steps: 2}, {name: second, max_steps: 2, lora_r: 2, lora_alpha: 4}, "
    "{name: third, max_steps: 2, temperature: 0.9}]",
]  # fmt: skip


def test_bf16_run_killed_after_two_resets_resumes_to_the_uninterrupted_weights(tiny_dir, shared_data, tmp_path):
    """A bf16 base (as the recipes load), three phases, a SIGKILL after the second reset, `--resume`: the earlier
    phases' deltas come back from their frozen factors (the base weights never moved) and `final/` is bit for bit the
    uninterrupted run's."""
    reference, out = tmp_path / "reference", tmp_path / "run"
    result = cli(reference, tiny_dir, shared_data, *BF16_THREE_PHASES)
    assert result.returncode == 0, result.stderr[-3000:]
    killed = cli(out, tiny_dir, shared_data, *BF16_THREE_PHASES, env={"PRORL_TEST_KILL_AT": "on_step_begin:2:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "frozen" / "reset-2.safetensors").is_file() and not (out / "final").exists()
    resumed = cli(out, tiny_dir, shared_data, *BF16_THREE_PHASES, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_same_weights(out, reference)
    state = json.loads((out / "phase-2" / "checkpoint-1" / "prorl_state.json").read_text())
    assert state["resets"] == 2 and state["frozen_factors"] == "frozen/reset-2.safetensors"
    start, final = load_file(tiny_dir / "model.safetensors"), final_weights(reference)
    moved = [k for k in start if not torch.equal(start[k].to(torch.bfloat16).float(), final[k].float())]
    assert any("q_proj" in k for k in moved)  # three phases' deltas are in final/: not a comparison of untrained runs


def test_resume_completes_a_run_stopped_right_after_final_was_written(reference, tiny_dir, shared_data, tmp_path):
    """A stop between `final/`'s rename and the files written after it leaves a finished run without
    `run_summary.json` and `final/README.md`: `--resume` writes them (from the saved log history, no model loaded)
    and changes nothing else."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "run_summary.json").unlink()
    (out / "final" / "README.md").unlink()
    before = snapshot(out)
    result = cli(out, tiny_dir, shared_data, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote its missing run_summary.json and final/README.md" in result.stdout
    assert history(out) == history(reference)
    assert (out / "final" / "README.md").read_text() == (reference / "final" / "README.md").read_text()
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing else touched


def test_an_extension_the_trainer_refuses_keeps_final_and_the_resume_history(
    reference, tiny_dir, shared_data, tmp_path
):
    """A finished run with a damaged log history, extended: the CLI's checks pass and the trainer refuses (exit 2).
    `final/` keeps its name and `resume_history.yaml` gets no entry: every refusal comes before the records (before
    the fix, final/ was renamed final-phase1-step6/ and the extension recorded, for a run that never trained on)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    log = out / "prorl_log_history.json"
    log.write_bytes(log.read_bytes()[:300])
    before = snapshot(out)
    result = cli(out, tiny_dir, shared_data, "--resume", "--allow-changes", "--phases.1.max_steps", "4")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "prorl_log_history.json" in result.stderr and "Traceback" not in result.stderr
    assert (out / "final" / "prorl_state.json").is_file() and not (out / "final-phase1-step6").exists()
    assert not (out / "resume_history.yaml").exists()
    after = snapshot(out)
    changed = {name for name in after.keys() | before.keys() if after.get(name) != before.get(name)}
    assert changed <= {".prorl_manifest.json"}, changed
