"""A small pool of killable math-verify worker processes with a per-item time limit, fair to concurrent threads.

Why processes: math-verify bounds its work with `signal.alarm`, which only fires on the main thread, and TRL may score
on another thread; a thread cannot be interrupted, but a process can be killed. Each item gets at most
`timeout_seconds` from the moment it is its turn, worker start-up included: the pool keeps `size` (3) warm workers,
one in use and two spares, so after a timeout the next item runs on a spare at once while the killed worker's
replacement warms up in the background (about 2 s). Only a run of more timeouts than spares within that start-up
time leaves an item waiting for a worker, and then it times out too (None, counted): the bound holds either way.

Fairness: items, not batches, take turns. A caller holds a worker for one item and queues again for the next, so
threads grading at once interleave in arrival order instead of waiting for each other's whole batch.

Processes: workers are plain scripts run with `sys.executable` (no `multiprocessing`: the user's training script is
never re-imported, torch/CUDA state never inherited), in their own session (Ctrl-C stops training, not them), and they
die with this process even on SIGKILL (see `_verify_worker.py`). They are started from one long-lived thread because
Linux's parent-death signal follows the thread that forked. After `os.fork()` (datasets' `map(num_proc=...)`,
DataLoader workers) the child forgets the parent's pool, whose locks a thread of the parent may have held at the fork,
and starts its own on first use.
"""

from __future__ import annotations

import atexit
import collections
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
TIMEOUT = "timeout"  # the result of an item that ran out of time (or found no working worker)
_DIED = object()  # the worker exited or wrote something that is not a result
_POLL_SECONDS = 0.05
_MAX_START_FAILURES = 3


class _Worker:
    """One child process and the bytes read from it that do not yet form a line."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-u", str(WORKER_SCRIPT), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.buffer = b""
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid

    def read_line(self, deadline: float):
        """The next JSON document, TIMEOUT if none came by `deadline`, or _DIED."""
        stdout = self.process.stdout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TIMEOUT
            readable, _, _ = select.select([stdout], [], [], remaining)
            if not readable:
                return TIMEOUT
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                return _DIED
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return _DIED

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def forget(self) -> None:
        """Close this process's copies of the pipes in a forked child (the worker belongs to the parent)."""
        for stream in (self.process.stdin, self.process.stdout):
            try:
                os.close(stream.fileno())
            except (OSError, ValueError):
                pass
        self.process.returncode = 0  # never waited on or killed from here


class VerifyPool:
    """`size` math-verify workers shared by every `math_equivalence` of this process.

    `check(gold, answer, timeout_seconds)` -> True / False / None (gold not parseable) / TIMEOUT.
    """

    def __init__(self, size: int = 3, startup_timeout_seconds: float = 180.0) -> None:
        if size < 1:
            raise ValueError(f"a verify pool needs at least one worker, got size={size}")
        self.size, self.startup_timeout_seconds = size, startup_timeout_seconds
        self.owner_pid = os.getpid()
        self.timeouts = 0  # items cut off (for tests and logs)
        self.restarts = 0  # workers killed because an item ran out of time
        self._condition = threading.Condition()
        self._idle: list[_Worker] = []
        self._starting: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._to_start = 0  # requested, not yet launched
        self._launching = 0  # being launched by the starter thread (not yet in _starting)
        self._queue: collections.deque = collections.deque()
        self._ever_ready = False
        self._start_failures = 0
        self._error: str | None = None
        self._closed = False
        self.gave_up = False  # closed after repeated start-up failures (not replaced by shared_pool())
        self._starter: threading.Thread | None = None

    # -- public ---------------------------------------------------------------------------------------------------

    def check(self, gold: str, answer: str, timeout_seconds: float):
        worker, deadline = self._acquire(timeout_seconds)
        if worker is None:  # no worker was ready within the budget (counted by _acquire)
            return TIMEOUT
        try:
            worker.process.stdin.write((json.dumps([gold, answer]) + "\n").encode())
            worker.process.stdin.flush()
            result = worker.read_line(deadline)
        except (OSError, ValueError):  # the worker is gone (broken pipe)
            result = _DIED
        if result is TIMEOUT or result not in (True, False, None):
            self._discard(worker, timed_out=result is TIMEOUT)
            return TIMEOUT if result is TIMEOUT else False
        self._release(worker)
        return result

    def wait_until_warm(self, timeout_seconds: float = 180.0) -> bool:
        """Start the workers if needed and wait until all `size` are idle and ready (spares warm); False on timeout.
        For benchmarks and tests that measure the steady state, as between training steps."""
        deadline = time.monotonic() + timeout_seconds
        with self._condition:
            self._top_up()
            while not (len(self._idle) >= self.size and not self._starting and not self._to_start + self._launching):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or self._error is not None:
                    return False
                self._condition.wait(min(remaining, 0.5))
            return True

    def pids(self) -> list[int]:
        """Process ids of the workers alive now (idle, busy or starting)."""
        with self._condition:
            return [worker.pid for worker in (*self._idle, *self._busy, *self._starting)]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Kill the workers. The shared pool is replaced by a fresh one at its next use (`shared_pool()`)."""
        if self.owner_pid != os.getpid():
            return
        with self._condition:
            self._closed = True
            workers = [*self._idle, *self._busy, *self._starting]
            self._idle, self._starting, self._busy = [], [], set()
            self._condition.notify_all()
        for worker in workers:
            worker.kill()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's workers without touching its locks (a parent thread may hold them)."""
        for worker in (*self._idle, *self._busy, *self._starting):
            worker.forget()
        self._closed = True

    # -- turns ----------------------------------------------------------------------------------------------------

    def _acquire(self, timeout_seconds: float) -> tuple[_Worker | None, float]:
        """A ready worker for one item and that item's deadline; (None, _) when none was ready within the budget.

        The budget starts when the item is first in line. Only the very first start of the pool (importing sympy)
        waits longer, up to `startup_timeout_seconds`: it is a one-time cost, like loading a model.
        """
        ticket = object()
        with self._condition:
            self._queue.append(ticket)
            try:
                deadline, first_start = None, False
                while True:
                    if self._error is not None:
                        raise ImportError(f"math_equivalence needs math-verify: {self._error}")
                    if self._closed:
                        self.timeouts += 1
                        return None, 0.0
                    if self._queue[0] is ticket:
                        now = time.monotonic()
                        if deadline is None:
                            first_start = not self._ever_ready
                            deadline = now + (self.startup_timeout_seconds if first_start else timeout_seconds)
                        if self._idle:
                            worker = self._idle.pop()
                            self._busy.add(worker)
                            return worker, (now + timeout_seconds) if first_start else deadline
                        self._top_up()
                        if now >= deadline:
                            self.timeouts += 1
                            return None, 0.0
                        self._condition.wait(min(deadline - now, 1.0))
                    else:
                        self._condition.wait()
            finally:
                self._queue.remove(ticket)
                self._condition.notify_all()

    def _release(self, worker: _Worker) -> None:
        with self._condition:
            self._busy.discard(worker)
            self._make_idle(worker)

    def _make_idle(self, worker: _Worker) -> None:
        """Offer a ready worker to the next item in line (called with the condition held)."""
        if self._closed:
            worker.kill()
            return
        self._idle.append(worker)
        self._condition.notify_all()

    def _discard(self, worker: _Worker, timed_out: bool) -> None:
        worker.kill()
        with self._condition:
            self._busy.discard(worker)
            self.timeouts += timed_out
            self.restarts += timed_out
            self._top_up()
            self._condition.notify_all()

    def _top_up(self) -> None:
        """Ask the starter thread for enough workers to have `size` (called with the condition held)."""
        alive = len(self._idle) + len(self._busy) + len(self._starting) + self._to_start + self._launching
        missing = self.size - alive
        if missing > 0 and not self._closed:
            self._to_start += missing
            if self._starter is None or not self._starter.is_alive():
                self._starter = threading.Thread(target=self._start_workers, name="math-verify-starter", daemon=True)
                self._starter.start()
            self._condition.notify_all()

    # -- the starter thread ---------------------------------------------------------------------------------------

    def _start_workers(self) -> None:
        """Lives as long as the process: starts workers (so their parent-death signal follows a thread that never
        ends early) and moves each to the idle list once it reports ready."""
        while True:
            with self._condition:
                while not self._to_start and not self._starting and not self._closed:
                    self._condition.wait()
                if self._closed:
                    return
                count, self._to_start = self._to_start, 0
                self._launching += count
            started = []
            for _ in range(count):
                try:
                    started.append(_Worker())
                except OSError as error:
                    self._start_failed(f"could not start the math-verify worker: {error}")
            with self._condition:
                self._launching -= count
                if self._closed:
                    for worker in started:
                        worker.kill()
                    return
                self._starting.extend(started)
                starting = list(self._starting)
            try:
                streams = [worker.process.stdout for worker in starting]
                readable = select.select(streams, [], [], _POLL_SECONDS)[0] if streams else []
            except (OSError, ValueError):  # close() shut a worker's pipe meanwhile
                continue
            for worker in starting:
                if worker.process.stdout in readable:
                    try:
                        message = worker.read_line(time.monotonic() + 1.0)
                    except (OSError, ValueError):
                        message = _DIED
                    if message == "ready":
                        self._became_ready(worker)
                        continue
                    if message is TIMEOUT:
                        continue
                    worker.kill()
                    self._forget_starting(worker)
                    if isinstance(message, dict) and "error" in message:
                        self._fail(str(message["error"]))
                    else:
                        self._start_failed("the math-verify worker exited during start-up")
                elif time.monotonic() - worker.started > self.startup_timeout_seconds:
                    worker.kill()
                    self._forget_starting(worker)
                    self._start_failed("the math-verify worker did not start in time")

    def _became_ready(self, worker: _Worker) -> None:
        with self._condition:
            if worker not in self._starting:  # close() took it meanwhile
                worker.kill()
                return
            self._starting.remove(worker)
            self._ever_ready, self._start_failures = True, 0
            self._make_idle(worker)

    def _forget_starting(self, worker: _Worker) -> None:
        with self._condition:
            if worker in self._starting:
                self._starting.remove(worker)

    def _start_failed(self, reason: str) -> None:
        if self._closed:  # the pool is shutting down: its starting workers were killed on purpose
            return
        warnings.warn(f"math_equivalence: {reason}; its symbolic checks count as timeouts", stacklevel=2)
        with self._condition:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                self._closed = self.gave_up = True  # stop retrying; every symbolic item becomes a timeout
            else:
                self._top_up()
            self._condition.notify_all()

    def _fail(self, error: str) -> None:
        with self._condition:
            self._error = error
            self._condition.notify_all()


_shared_pool: VerifyPool | None = None
_shared_lock = threading.Lock()
_forgotten_pools: list[VerifyPool] = []  # kept referenced in forked children so nothing is garbage-collected there


def shared_pool() -> VerifyPool:
    """The process-wide pool, created on first use (so `import rewards` starts no process) and again after `close()`
    (a benchmark or test that frees the workers does not leave later rewards without any)."""
    global _shared_pool
    with _shared_lock:
        if _shared_pool is None or (_shared_pool.closed and not _shared_pool.gave_up):
            _shared_pool = VerifyPool()
            atexit.register(_shared_pool.close)
        return _shared_pool


def _after_fork_in_child() -> None:
    global _shared_pool, _shared_lock
    _shared_lock = threading.Lock()
    if _shared_pool is not None:
        _shared_pool.forget_after_fork()
        _forgotten_pools.append(_shared_pool)
    _shared_pool = None


os.register_at_fork(after_in_child=_after_fork_in_child)
