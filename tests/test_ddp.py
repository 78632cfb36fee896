"""Hard resets under 2-process DDP (gloo on CPU): replicas hold identical weights after every reset.

Runs tests/_ddp_worker.py with torchrun (a real 3-phase ProRLTrainer run, real DDP). The worker also records the
state right after an unseeded re-init *without* broadcast: the replicas must differ there, which shows the check
can fail.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_ddp_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_processes(script: str | Path, *script_args: str, timeout: int) -> None:
    """Run `script` under torchrun as 2 CPU processes (gloo); fail with the tail of its stderr if it fails."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(script), *script_args,
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]


def two_process_results(tmp_path_factory, script: Path, name: str, *extra: str, timeout: int = 240) -> dict:
    """Run a worker that writes its measurements to the JSON file given as its argument; return them."""
    out = tmp_path_factory.mktemp(name) / "results.json"
    run_two_processes(script, str(out), *extra, timeout=timeout)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return two_process_results(tmp_path_factory, WORKER, "ddp")


def test_replicas_identical_after_every_reset_and_phase(ddp_results):
    records = ddp_results["records"]
    assert [(r["label"], r["resets"]) for r in records] == [
        ("start of phase 0", 0),
        ("end of phase 0", 0),
        ("start of phase 1", 1),  # phase boundary with a LoRA rank change: new Parameters, new DDP wrapper
        ("in-loop reset at global step 4", 2),  # HardResetCallback: same Parameters, optimizer state cleared in the loop
        ("end of phase 1", 2),
        ("start of phase 2", 3),
        ("end of phase 2", 3),
    ]
    for record in records:
        assert record["equal"] and record["max_diff"] == 0.0, record


def test_frozen_factors_are_identical_on_every_rank_and_never_broadcast(ddp_results):
    """The replica comparison above includes the frozen LoRA factors of every reset; a DDP wrapper built after a reset
    (the rank change re-wraps) leaves them out of its per-forward buffer broadcast."""
    assert ddp_results["frozen_buffers"] > 0
    assert ddp_results["ddp_knew_frozen_buffers"] is True  # built after reset 1: its factors were there, and ignored
    assert ddp_results["ddp_broadcasts_no_frozen_buffer"] is True


def test_rank_change_trained_the_new_adapter(ddp_results):
    assert ddp_results["final_rank"] == 8
    assert ddp_results["lora_b_trained"] is True


def test_unbroadcast_reinit_would_desynchronise_replicas(ddp_results):
    assert not ddp_results["reset_without_broadcast"]["equal"]
    assert ddp_results["reset_without_broadcast"]["max_diff"] > 1e-3


def test_rollout_engine_under_ddp_generates_on_every_rank_and_replicas_stay_identical(tmp_path_factory):
    """Issue 14: under DDP each rank generates with its own engine, through the rank change (new Parameters) and the
    in-loop reset; the replicas stay identical as with TRL's path."""
    results = two_process_results(tmp_path_factory, WORKER, "ddp_engine", "--rollout-engine")
    generation_batches = 2 + 4 + 2  # one per optimizer step (steps_per_generation = gradient accumulation = 1)
    assert results["engine_generations_per_rank"] == [generation_batches, generation_batches]
    assert results["resets"] == 3 and results["final_rank"] == 8
    for record in results["records"]:
        assert record["equal"] and record["max_diff"] == 0.0, record
