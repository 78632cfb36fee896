"""Stopping a run cleanly: SIGINT/SIGTERM finish the current optimizer step, write a checkpoint, then stop.

Schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill a job; Ctrl-C sends SIGINT. Either is turned
into `ProRLTrainer.request_stop`, which the trainer's own callback reads at the end of every step (agreed across
processes, so every rank stops at the same step and writes the same checkpoint). `ProRLTrainer.train` then raises
`RunInterrupted` naming that checkpoint. A second Ctrl-C stops at once (KeyboardInterrupt).

`prorl-trl train` installs the handlers before its start-up (loading the model and data, building the trainer, ~20 s):
a signal then stops the start-up at once with `StartupInterrupted` (nothing trained), except inside the few steps that
write (`SignalStop.deferred`), which finish first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


class RunInterrupted(Exception):
    """Training stopped on request (a signal) after writing `checkpoint`; resume from it to continue exactly."""

    def __init__(self, reason: str, checkpoint: Path, global_step: int):
        self.reason, self.checkpoint, self.global_step = reason, Path(checkpoint), global_step
        super().__init__(f"training stopped ({reason}) at global step {global_step}; checkpoint: {checkpoint}")


class StartupInterrupted(BaseException):
    """A stop signal arrived before training started: nothing was trained.

    A `BaseException`, as `KeyboardInterrupt` is, so library code that catches `Exception` while loading does not
    swallow it.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"{reason} received during start-up")


class SignalStop:
    """Where SIGINT/SIGTERM go: before `attach`, they stop the start-up (`StartupInterrupted`); after it, they ask the
    trainer to stop after the current step (`request_stop`)."""

    def __init__(self, trainer: Any = None):
        self.trainer = trainer
        self.reason: str | None = None  # a request that arrived before a trainer was attached
        self._deferring = 0

    def attach(self, trainer: Any) -> None:
        """From now on signals stop `trainer` after its current step; a request that came during start-up stops here."""
        self.check()
        self.trainer = trainer

    def check(self) -> None:
        """Raise `StartupInterrupted` if a signal arrived during start-up (and was deferred)."""
        if self.reason is not None and self.trainer is None:
            raise StartupInterrupted(self.reason)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A start-up step that writes (deleting old outputs, ...): a signal during it stops right after it, never
        halfway through."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring:
            self.check()

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        trainer = self.trainer
        if trainer is None:
            if self.reason is not None:  # a second signal during start-up
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                return
            self.reason = name
            if not self._deferring:
                raise StartupInterrupted(name)
            return
        if trainer.stop_requested is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # e.g. the launcher forwarding the same SIGTERM: already stopping
        trainer.request_stop(name)
        if trainer.accelerator.is_main_process:
            print(
                f"\n{name} received: finishing the current step, then writing a checkpoint "
                "(Ctrl-C again stops at once, without a checkpoint).",
                file=sys.stderr,
                flush=True,
            )


@contextlib.contextmanager
def stop_on_signals(trainer: Any = None) -> Iterator[SignalStop]:
    """Within the block, SIGINT and SIGTERM ask `trainer` to stop after the current step (see module doc).

    Without a trainer (start-up), they raise `StartupInterrupted` until one is attached with `SignalStop.attach`.
    Only the main thread can own signal handlers; elsewhere this installs nothing. The previous handlers come back on
    exit. Under `accelerate launch` with one process, the launcher does not forward SIGTERM to the training process,
    so the training process also asks the kernel for SIGTERM when its launcher dies (Linux `PR_SET_PDEATHSIG`).
    """
    stop = SignalStop(trainer)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop.handle)
    _term_when_launcher_dies()
    try:
        yield stop
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _term_when_launcher_dies() -> None:
    """SIGTERM this process when its parent `accelerate launch` dies (it dies on SIGTERM without forwarding it), or
    its `prorl-trl launch` (which names itself in PRORL_LAUNCH_ARGV) is killed."""
    launched = "accelerate" in parent_command_line(" ") or os.environ.get("PRORL_LAUNCH_ARGV")
    if not sys.platform.startswith("linux") or not launched:
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def parent_command_line(separator: str | None = None) -> Any:
    """The parent process's argv (Linux `/proc`), `[]` elsewhere; joined with `separator` when given."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    argv = [part for part in argv if part]
    return separator.join(argv) if separator is not None else argv
