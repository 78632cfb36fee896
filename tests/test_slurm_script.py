"""recipes/slurm/prorl.sbatch, run by bash with stand-ins for SLURM's `srun` and `scontrol` and for `prorl-trl` on
PATH: `srun` runs its command once per node with that node's SLURM_NODEID (as one task per node would), `prorl-trl`
records its arguments and exits with a chosen status. The recorded command is then read by accelerate's own launch
parser and by ours; what runs on a real cluster is that command (tests/test_launch.py runs it on two simulated nodes).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from prorl_trl.cli import parse_command_line
from prorl_trl.launch import split_launch_argv

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "recipes" / "slurm" / "prorl.sbatch"

FAKES = {
    "scontrol": """#!/bin/bash
case "$1" in
  show) printf 'gpu-node-7\\ngpu-node-8\\n' ;;
  requeue) echo "$2" >> "$FAKE_LOG/requeued" ;;
esac
""",
    "srun": """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done   # srun's own options
status=0
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node "$@"; code=$?
  [ $code -gt $status ] && status=$code
done
exit $status
""",
    "prorl-trl": """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_LOG/node$SLURM_NODEID"
exit "$FAKE_STATUS"
""",
}


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False, capture_output=True).returncode == 0


def run_script(tmp_path: Path, status: int, *arguments: str) -> subprocess.CompletedProcess:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environment = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "FAKE_STATUS": str(status),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-node-[7-8]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8",
    }  # fmt: skip
    environment.pop("PRORL_VENV", None)
    command = ["bash", str(SCRIPT), *arguments]
    return subprocess.run(command, check=False, capture_output=True, text=True, env=environment, cwd=REPO)


@pytest.mark.parametrize("status", [0, 75, 1])
def test_each_node_runs_prorl_trl_launch_with_its_rank_and_resume_and_only_75_requeues(tmp_path, status):
    from accelerate.commands.launch import launch_command_parser

    result = run_script(
        tmp_path,
        status,
        "recipes/demo_tiny.yaml",
        "--training.output_dir",
        "/shared/runs/demo",
    )
    assert result.returncode == status, result.stderr
    parser = launch_command_parser()
    for node in (0, 1):
        argv = (tmp_path / "log" / f"node{node}").read_bytes().decode().split("\0")[:-1]
        assert argv[0] == "launch"
        options, train = split_launch_argv(argv[1:], parser)
        accelerate = parser.parse_args([*options, "-m", "prorl_trl", *train])
        assert accelerate.config_file == "recipes/accelerate/multi_node.yaml"
        assert (
            accelerate.num_machines,
            accelerate.machine_rank,
            accelerate.num_processes,
        ) == (2, node, 16)
        assert (accelerate.main_process_ip, accelerate.main_process_port) == (
            "gpu-node-7",
            20000 + 4242,
        )
        assert accelerate.training_script_args == train
        _, args = parse_command_line(train)  # what `train` will read
        assert args.recipe == "recipes/demo_tiny.yaml" and args.resume is True
        assert args.overrides == ["--training.output_dir", "/shared/runs/demo"]
    requeued = tmp_path / "log" / "requeued"
    assert requeued.is_file() == (status == 75)
    if status == 75:
        assert requeued.read_text().split() == ["4242"]


def test_the_script_refuses_to_start_without_a_recipe(tmp_path):
    result = run_script(tmp_path, 0)
    assert result.returncode == 2 and "usage: sbatch" in result.stderr
