"""A killable math-verify worker process with a per-item time limit, usable from any thread.

Why a process: math-verify bounds its work with `signal.alarm`, which only fires on the main thread, and TRL runs
async rewards on a worker thread. Threads cannot be interrupted, so a pathological answer (`9^{9^{9^{9}}}`) would
hang training. A child process can be killed: the parent waits at most `timeout_seconds` per item, kills the child
on a timeout (the item counts as not equivalent) and starts a fresh one at once, so it warms up while the rest of
the batch is scored. The child is a plain script run with `sys.executable` (not `multiprocessing`), so it never
re-imports the user's training script and never inherits torch or CUDA state.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("_verify_worker.py")


class VerifyWorker:
    """One math-verify child process, shared by all `math_equivalence` rewards of this process (guarded by a lock)."""

    def __init__(self, startup_timeout_seconds: float = 180.0) -> None:
        self.startup_timeout_seconds = startup_timeout_seconds
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        self._ready = False
        self._buffer = b""
        self.restarts = 0  # how many times a timeout killed the child (for tests and logs)

    def check(self, pairs: list[tuple[str, str]], timeout_seconds: float) -> list[bool | None]:
        """`verify(gold, answer)` for each pair; False for an item that ran past `timeout_seconds`."""
        with self._lock:
            return [self._check_one(gold, answer, timeout_seconds) for gold, answer in pairs]

    def close(self) -> None:
        if self._process is not None and self._owner_pid == os.getpid():
            self._process.kill()
            self._process.wait()
        self._process, self._ready, self._buffer = None, False, b""

    # -- internals (called with the lock held) --------------------------------------------------------------------

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-u", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal interrupts training, not this helper
        )
        self._owner_pid, self._ready, self._buffer = os.getpid(), False, b""

    def _ensure_ready(self) -> bool:
        if self._owner_pid != os.getpid():  # forked: the child belongs to the parent process, start our own
            self._process = None
        if self._process is None or self._process.poll() is not None:
            self._start()
        if not self._ready:
            message = self._read_line(self.startup_timeout_seconds)
            if message != "ready":
                self.close()
                if isinstance(message, dict) and "error" in message:
                    raise ImportError(f"math_equivalence needs math-verify: {message['error']}")
                warnings.warn("math_equivalence: the math-verify worker did not start; scoring as not equivalent")
                return False
            self._ready = True
        return True

    def _check_one(self, gold: str, answer: str, timeout_seconds: float) -> bool | None:
        if not self._ensure_ready():
            return False
        try:
            self._process.stdin.write((json.dumps([gold, answer]) + "\n").encode())
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            return False
        result = self._read_line(timeout_seconds)
        if result is _TIMEOUT:
            self.close()
            self.restarts += 1
            self._start()  # warm up the replacement now, not when the next slow item arrives
            return False
        return result if result in (True, False, None) else False

    def _read_line(self, timeout_seconds: float):
        deadline = time.monotonic() + timeout_seconds
        stdout = self._process.stdout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _TIMEOUT
            readable, _, _ = select.select([stdout], [], [], remaining)
            if not readable:
                return _TIMEOUT
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:  # the child died
                self.close()
                return False
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return False


_TIMEOUT = object()
_shared_worker: VerifyWorker | None = None
_shared_lock = threading.Lock()


def shared_worker() -> VerifyWorker:
    """The process-wide worker, created on first use (so `import rewards` starts no process)."""
    global _shared_worker
    with _shared_lock:
        if _shared_worker is None:
            _shared_worker = VerifyWorker()
            atexit.register(_shared_worker.close)
        return _shared_worker
