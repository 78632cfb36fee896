"""Hard resets under 2-process DDP (gloo on CPU): replicas hold identical weights after every reset.

Runs tests/_ddp_worker.py with torchrun (a real GRPOTrainer, real DDP). The worker also records the state right
after an unseeded re-init *without* broadcast: the replicas must differ there, which shows the check can fail.
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


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "results.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(WORKER), str(out),
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(out.read_text())


def test_unbroadcast_reinit_desynchronises_replicas(ddp_results):
    assert ddp_results["after_phase_1"]["equal"]
    assert not ddp_results["reset_without_broadcast"]["equal"]
    assert ddp_results["reset_without_broadcast"]["max_diff"] > 1e-3


def test_replicas_identical_after_every_reset_and_phase(ddp_results):
    for key in ("reset_with_broadcast", "after_phase_2", "reshape_with_broadcast", "after_phase_3"):
        assert ddp_results[key] == {"equal": True, "max_diff": 0.0}, key


def test_rank_change_between_train_calls_trains_the_new_adapter(ddp_results):
    assert ddp_results["shape_changed"] is True
    assert ddp_results["phase_3_trained_new_adapter"] is True
