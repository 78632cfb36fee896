"""Shared fixtures. Tests run on CPU, offline, with tiny models built in-process (`prorl_trl.tiny`)."""

import gc
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# The GPU stays hidden unless the caller names one (`CUDA_VISIBLE_DEVICES=0 pytest ...`); then the CUDA tests run.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# Most of the suite's time is processes that each import torch, transformers and TRL (a CLI run, a launch, a worker).
# Where the environment forbids bytecode caches (PYTHONDONTWRITEBYTECODE), every one of them compiled this project's
# modules from source again: about 1 s of each 8-9 s start on 2 cores. Caches are written under the clone's
# __pycache__ folders (ignored by git).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# One intra-op thread for torch (and OpenBLAS) in the pytest processes and in every process they start (CLI runs, the
# fork server of _cli_fork.py and its children, launches and their ranks). The suite's models are tiny and CI runs two
# xdist workers on two cores: a second OpenMP thread has no free core to run on, and it spin-waits at every parallel
# region. A tiny `train` run (tests/recipes/tiny_gsm8k.yaml, 6 steps) took 35-46 CPU-s with torch's default of 2
# threads and 10.5 CPU-s with 1, on this machine while both cores were busy, and ended on the same weights bit for bit.
# The demo and the benchmarks' CPU workers already ran on one thread for that reason. Set here, at import, so that the
# fork server and the runs it serves agree (_cli_fork.IMPORT_TIME_VARIABLES); a caller's own value is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
# The shared data sets live beside the project, never inside it (see ../shared/data/README.md).
SHARED_DATA = Path(os.environ.get("PRORL_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


PLAIN_INSTALL = Path(__file__).resolve().parent / "_plain_install"


@pytest.fixture(scope="session", autouse=True)
def started_processes_see_a_plain_install():
    """Processes started by tests import as a plain install would (`_plain_install/sitecustomize.py`: the dev extras'
    bitsandbytes and trackers unseen, 2.2 CPU-s less per start); the pytest process keeps them for their own tests.
    A session fixture runs only where tests run (each xdist worker), never in the xdist controller."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLAIN_INSTALL), before]))
    yield
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module", autouse=True)
def live_objects_leave_the_cyclic_collector():
    """Collect the previous module's garbage, then `gc.freeze()` what is still alive: mostly the ~0.5M objects that
    importing torch, transformers, TRL and the rest created. The collector stops scanning them at every collection
    after this, automatic or explicit (HF's `Trainer.train` calls `gc.collect()` through accelerate's `free_memory`,
    DeepSpeed at each defragment), where each full pass had cost ~0.5 s. tests/test_parity.py on one thread: 26.7
    CPU-s, 10.9 of them in the collector, before this. Objects created by the tests themselves are collected as
    before; a frozen one that turns into cyclic garbage later stays in memory until the worker exits."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set PRORL_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny model + tokenizer saved with `save_pretrained`, loadable by path."""
    from prorl_trl.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def tiny():
    """A fresh `(model, tokenizer)` pair; seed 0."""
    from prorl_trl.tiny import build_tiny

    return build_tiny(seed=0)
