"""`prorl-trl launch` (prorl_trl/launch.py) and multi-node runs, as users run them.

- Ctrl-C (SIGINT to the launch process, as the terminal sends it) under `recipes/accelerate/cpu.yaml`: no traceback,
  the resume line last, exit 75; the printed command's `--resume` ends on the uninterrupted weights.
- Two nodes simulated on one host (two `prorl-trl launch --config_file recipes/accelerate/multi_node.yaml
  --num_machines 2 --machine_rank 0/1 --main_process_ip 127.0.0.1` on CPU, one process each, gloo), two phases with a
  hard reset, SIGTERM to both nodes after the reset, relaunch with `--resume`: final weights equal, tensor for tensor,
  to a one-node run of the same global batch (2 processes).
Every run goes through tests/_kill_launcher.py (`launch` whose training processes inject the fault). Cost: 7 CLI runs.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_resume_cli import LAUNCHER, RECIPE, SHAPE, assert_same_weights, cli, history

from prorl_trl.launch import (
    INTERRUPTED,
    LaunchUsageError,
    launch_status,
    split_launch_argv,
)
from prorl_trl.recipe.output_folder import resume_command

REPO = Path(__file__).resolve().parent.parent


def _accelerate_parser():
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def test_launch_splits_accelerate_options_from_the_train_command():
    parser = _accelerate_parser()
    tokens = [
        "--config_file",
        "c.yaml",
        "--num_processes=2",
        "--machine_rank",
        "1",
        "train",
        "r.yaml",
        "--resume",
    ]
    assert split_launch_argv(tokens, parser) == (
        tokens[:5],
        ["train", "r.yaml", "--resume"],
    )
    assert split_launch_argv(["--cpu", "--", "train", "r.yaml"], parser) == (
        ["--cpu"],
        ["train", "r.yaml"],
    )
    # A value that reads `train` is the option's value, not the start of the train command.
    assert split_launch_argv(["--main_training_function", "train", "train", "r"], parser)[1] == ["train", "r"]
    for wrong, why in (
        (
            ["--config_file", "c.yaml", "-m", "prorl_trl", "train", "r"],
            "always `-m prorl_trl`",
        ),
        (["--nope", "train", "r"], "not an option of `accelerate launch`"),
        (["--config_file", "c.yaml", "validate", "r"], "expected `train RECIPE"),
        (["--cpu", "train"], "expected `train RECIPE"),
    ):
        with pytest.raises(LaunchUsageError, match=why):
            split_launch_argv(wrong, parser)


def test_exit_status_says_interrupted_and_resumable_only_for_stopped_runs():
    assert launch_status([0, 0], stopped=False) == 0
    assert launch_status([143, 143], stopped=True) == INTERRUPTED == 75
    assert launch_status([130], stopped=False) == INTERRUPTED  # the processes stopped on a signal sent to them
    assert launch_status([143, -signal.SIGTERM], stopped=True) == INTERRUPTED  # one killed before its handler
    assert launch_status([-signal.SIGTERM], stopped=False) == 1  # killed by someone else: not known to be clean
    assert launch_status([143, 1], stopped=True) == 1  # a real failure is never "resumable"
    assert launch_status([-signal.SIGKILL], stopped=True) == 1


def test_resume_command_names_the_launch_command(monkeypatch):
    launched = [
        "prorl-trl",
        "launch",
        "--config_file",
        "c.yaml",
        "train",
        "r.yaml",
        "--overwrite",
        "--lr",
        "1",
    ]
    monkeypatch.setenv("PRORL_LAUNCH_ARGV", json.dumps(launched))
    expected = "prorl-trl launch --config_file c.yaml train r.yaml --lr 1 --resume"
    assert resume_command(["python", "-m", "accelerate.commands.launch", "x"]) == expected


def test_launch_with_a_bad_command_line_exits_2_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "prorl_trl", "launch", "--config_file", "c.yaml", "-m", "prorl_trl", "train", "r"],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "always `-m prorl_trl`" in result.stderr and "Traceback" not in result.stderr


def launch(*accelerate_options: str) -> list[str]:
    return LAUNCHER + ["launch", *accelerate_options]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1].strip()


@pytest.mark.slow
def test_ctrl_c_under_launch_prints_no_traceback_exits_75_and_the_printed_command_resumes_exactly(
    tiny_dir, shared_data, tmp_path
):
    reference, out = tmp_path / "reference", tmp_path / "run"
    done = cli(reference, tiny_dir, shared_data)
    assert done.returncode == 0, done.stderr[-3000:]

    cpu = launch("--config_file", "recipes/accelerate/cpu.yaml")
    result = cli(
        out,
        tiny_dir,
        shared_data,
        env={"PRORL_TEST_INT_AT": "on_step_begin:0:2"},
        launcher=cpu,
    )
    assert result.returncode == INTERRUPTED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr, result.stderr[-3000:]
    assert "SIGINT received" in result.stderr
    assert "stopped by SIGINT at global step 2; checkpoint written:" in result.stdout
    assert "interrupted by SIGINT; every training process stopped (exit status 75" in result.stdout
    command = last_line(result.stdout)  # the resume line is the last one
    argv = shlex.split(command)
    assert argv[1:4] == ["-m", "prorl_trl", "launch"] and argv[-1] == "--resume", command
    assert argv[4:7] == ["--config_file", "recipes/accelerate/cpu.yaml", "train"]
    assert result.stdout.count(command) == 1  # once, by `launch` (the training process leaves it to launch)
    assert not (out / "final").exists()

    # The printed command, with the test's fault-injecting script in place of `-m prorl_trl` (its reward).
    resumed = cli(out, tiny_dir, shared_data, "--resume", launcher=cpu)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_same_weights(out, reference)
    assert history(out) == history(reference)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(out: Path, tiny_dir: Path, shared_data: Path, *extra: str, env: dict | None = None):
    """Node 0 and node 1 of `recipes/accelerate/multi_node.yaml` on this host, one process each; (status, stdout,
    stderr) per node."""
    port, nodes = str(free_port()), []
    environment = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PRORL_SHARED_DATA": str(shared_data),
        **(env or {}),
    }
    for rank in (0, 1):
        command = launch(
            "--config_file", "recipes/accelerate/multi_node.yaml", "--num_machines", "2", "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--num_processes", "2",
        ) + ["train", RECIPE, "--model.name_or_path", str(tiny_dir), "--training.output_dir", str(out), *SHAPE,
             "--training.use_cpu", "true", *extra]  # fmt: skip
        nodes.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    ended = [node.communicate(timeout=600) for node in nodes]
    return [(node.returncode, stdout, stderr) for node, (stdout, stderr) in zip(nodes, ended)]


@pytest.mark.slow
def test_two_nodes_reset_stop_and_resume_end_on_the_one_node_weights(tiny_dir, shared_data, tmp_path):
    reference, out = tmp_path / "one-node", tmp_path / "two-nodes"
    one_node = launch("--config_file", "recipes/accelerate/multi_node.yaml", "--num_machines", "1",
                      "--num_processes", "2", "--main_process_port", str(free_port()))  # fmt: skip
    done = cli(
        reference,
        tiny_dir,
        shared_data,
        "--training.use_cpu",
        "true",
        launcher=one_node,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    # SIGTERM to both nodes' launch processes in phase 2, after the hard reset.
    stopped = two_nodes(out, tiny_dir, shared_data, env={"PRORL_TEST_TERM_AT": "on_step_begin:1:2"})
    for rank, (status, stdout, stderr) in enumerate(stopped):
        assert status == INTERRUPTED, f"node {rank}: {stderr[-3000:]}"
        assert "Traceback" not in stderr, f"node {rank}: {stderr[-3000:]}"
        assert "--machine_rank" in last_line(stdout) and last_line(stdout).endswith("--resume")
    assert "stopped by SIGTERM at global step 5; checkpoint written:" in stopped[0][1]
    state = json.loads((out / "phase-1" / "checkpoint-2" / "prorl_state.json").read_text())
    assert state["global_step"] == 5 and state["resets"] == 1
    assert not (out / "phase-1" / "checkpoint-3").exists() and not (out / "final").exists()

    resumed = two_nodes(out, tiny_dir, shared_data, "--resume")
    for rank, (status, _, stderr) in enumerate(resumed):
        assert status == 0, f"node {rank}: {stderr[-3000:]}"
    assert "resuming from" in resumed[0][1]
    assert_same_weights(out, reference)
    assert history(out) == history(reference)
