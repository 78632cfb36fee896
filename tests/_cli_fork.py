"""Test-only: `tests/_kill_launcher.py` runs forked from one process that has already imported the libraries.

A `prorl-trl` run of the suite started a fresh interpreter and spent 10-30 s of its time importing torch,
transformers, TRL, PEFT and datasets on the 2-core CI machine, and the suite starts about a hundred of them.
`run(command, ...)` is `subprocess.run(command, capture_output=True, text=True, ...)` for a command that starts with
`LAUNCHER`: the command goes to a server started once per test process (per xdist worker), which forks; the child
takes the command's environment, working directory and argv, writes its stdout/stderr to files and runs
`tests/_kill_launcher.py` as `__main__` (the real `prorl_trl.cli.main`, with the test faults), then leaves the
interpreter the normal way (atexit handlers, thread joins). The caller gets a `subprocess.CompletedProcess` as
`subprocess.run` gives it: a SIGKILL at a fault point reads `returncode == -9`, a timeout kills the run and raises
`subprocess.TimeoutExpired`.

The server only imports (no torch computation has started a thread pool), so forking it is safe. Environment
variables that a library reads when it is imported are the test process's, so runs that change such a variable
(`OMP_NUM_THREADS`, `HOME`, `HF_HUB_OFFLINE=0`) and runs whose property is the process start itself (the console
script, `python -m prorl_trl`, `accelerate launch`, signals sent by the test) keep `subprocess`.
`PRORL_TEST_NO_FORK=1` sends every command to `subprocess` (to check that the two agree).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

LAUNCHER = [sys.executable, str(Path(__file__).resolve().parent / "_kill_launcher.py")]
# read when imported: a run that sets one of these differently is sent to `subprocess`
IMPORT_TIME_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HOME", "HF_HOME", "HF_HUB_OFFLINE",
                         "HF_DATASETS_CACHE", "TRANSFORMERS_VERBOSITY", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")  # fmt: skip
# what a tiny `train` run imports (2026-11-28: ~1,900 modules after torch, transformers, TRL, PEFT and datasets,
# among them DeepSpeed, MLflow, W&B and Trackio, which accelerate and transformers' integrations load)
PRELOAD = ("torch", "transformers", "datasets", "accelerate", "peft", "trl", "trl.trainer.grpo_trainer",
           "transformers.models.qwen2.modeling_qwen2", "deepspeed", "wandb", "mlflow", "trackio", "scipy.stats",
           "prorl_trl.cli", "prorl_trl.recipe.run", "prorl_trl.trainer.trainer", "prorl_trl.evaluation.validation",
           "prorl_trl.rollout.engine", "prorl_trl.reset", "prorl_trl.data.builders", "rewards")  # fmt: skip
_server: subprocess.Popen | None = None


def _forkable(command: list[str], env: dict[str, str] | None) -> bool:
    if os.environ.get("PRORL_TEST_NO_FORK") or list(command[:2]) != LAUNCHER or not hasattr(os, "fork"):
        return False
    environment = os.environ if env is None else env
    return all(environment.get(name) == os.environ.get(name) for name in IMPORT_TIME_VARIABLES)


def _start_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        atexit.register(_server.kill)
        if _server.stdout.readline().strip() != "ready":
            raise RuntimeError("tests/_cli_fork.py: the fork server did not start")
    return _server


def run(command: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)`, forked when
    `command` runs the test launcher (see the module docstring)."""
    if not _forkable(command, env):
        return subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    server = _start_server()
    with tempfile.TemporaryDirectory(prefix="cli_fork_") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        request = {"argv": [str(part) for part in command[1:]], "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err)}  # fmt: skip
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        pid = int(server.stdout.readline())
        timed_out = []
        timer = None
        if timeout is not None:
            timer = threading.Timer(timeout, lambda: (timed_out.append(True), os.kill(pid, signal.SIGKILL)))
            timer.start()
        returncode = int(server.stdout.readline())
        if timer is not None:
            timer.cancel()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def _serve() -> None:
    """Import once, then fork a child per request line; answer with the child's pid, then its exit code."""
    import importlib

    # answers go to the pipe the client reads; anything a library prints (DeepSpeed's accelerator warning) to stderr
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library that is not installed: the run imports nothing either
            pass
    # What the imports created (~0.5M objects) leaves the cyclic collector, here and in every forked run: a full pass
    # over them cost ~0.5 s, and a run's collections (automatic ones, and the `gc.collect()` of every HF `train`
    # call) took 1.7 of a tiny run's 10.5 CPU-s. Frozen pages are also not copied into each child by the collector.
    gc.collect()
    gc.freeze()

    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(request)  # leaves the interpreter
        print(pid, file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=answers, flush=True)


def _child(request: dict) -> None:
    import runpy

    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        target = os.open(path, flags)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
