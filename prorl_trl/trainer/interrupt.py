"""Stopping a run cleanly: SIGINT/SIGTERM finish the current optimizer step, write a checkpoint, then stop.

Schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill a job; Ctrl-C sends SIGINT. Either is turned
into `ProRLTrainer.request_stop`, which the trainer's own callback reads at the end of every step (agreed across
processes, so every rank stops at the same step and writes the same checkpoint). `ProRLTrainer.train` then raises
`RunInterrupted` naming that checkpoint. A second Ctrl-C stops at once (KeyboardInterrupt).
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


@contextlib.contextmanager
def stop_on_signals(trainer: Any) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM ask `trainer` to stop after the current step (see module doc).

    Only the main thread can own signal handlers; elsewhere this does nothing. The previous handlers come back on
    exit. Under `accelerate launch` with one process, the launcher does not forward SIGTERM to the training process,
    so the training process also asks the kernel for SIGTERM when its launcher dies (Linux `PR_SET_PDEATHSIG`).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
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

    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)
    _term_when_launcher_dies()
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _term_when_launcher_dies() -> None:
    """SIGTERM this process when its parent `accelerate launch` dies (it dies on SIGTERM without forwarding it)."""
    if not sys.platform.startswith("linux") or "accelerate" not in parent_command_line(" "):
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
