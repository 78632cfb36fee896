"""`RunProgress`: training progress with rate and ETA, in place of HF's `ProgressCallback` / `PrinterCallback`.

One bar over the whole run (every phase of a ProRL run, via `bind`), and one short line of the main metrics per log
instead of a dict of 30 keys (the full logs still reach trackers and `run_summary.json`). With `disable_tqdm` (log
files) the line carries the elapsed time, seconds per step and the ETA instead of a bar. A step that runs longer
than `heartbeat_seconds` (a long generation: thousands of tokens x a large group) gets a line every
`heartbeat_seconds` saying how long it has run against the mean step so far, so a slow run never looks hung.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..console import duration, metrics_line


def use_run_progress(trainer: Any) -> RunProgress:
    """Swap a trainer's HF progress callbacks (a bar per `train()` call, a dict per log) for a `RunProgress`.

    The trainer's `train` is wrapped so that the heartbeat stops when it returns or raises: HF calls no callback when
    a step raises, and a caller that catches the error (a notebook, a retry) would otherwise read "still running"
    lines about a step that ended long ago.
    """
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    progress = RunProgress()
    trainer.add_callback(progress)
    train = trainer.train

    @functools.wraps(train)
    def train_then_stop_heartbeat(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        finally:
            progress.stop_heartbeat()

    trainer.train = train_then_stop_heartbeat
    return progress


class RunProgress(TrainerCallback):
    """A progress bar (or, with `disable_tqdm`, a line per log) over the whole run, with rate and ETA.

    A plain HF trainer counts its own steps. A ProRL trainer calls `bind(trainer)`, and the bar then spans every
    phase (`trainer.phases`, `trainer.prorl_global_step`), so the ETA is the run's, not the current phase's.
    """

    def __init__(self, heartbeat_seconds: float = 60.0) -> None:
        self.heartbeat_seconds = heartbeat_seconds
        self._step_done: threading.Event | None = None
        self.bar: Any = None
        self.total: int | None = None
        self.global_step: Callable[[Any], int] = lambda state: state.global_step
        self.phase_name: Callable[[], str] = lambda: ""
        self.last_part: Callable[[], bool] = lambda: True  # does this `train()` call end the run?
        self.started: float | None = None
        self.first_step = 0

    def bind(self, trainer: Any) -> None:
        lengths = [phase.max_steps for phase in trainer.phases]  # -1: one phase as long as num_train_epochs (HF's)
        self.total = sum(lengths) if min(lengths) > 0 else None
        self.global_step = lambda state: trainer.prorl_global_step
        self.phase_name = lambda: trainer.current_phase.name
        self.last_part = lambda: trainer.current_phase.index == len(trainer.phases) - 1

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._start(args, state)

    def _start(self, args: Any, state: Any) -> None:
        """The clock and the bar, at the first `train()` call (or at a log that comes before it)."""
        if self.started is None:
            self.started, self.first_step = time.time(), self.global_step(state)
        if self.bar is None and not args.disable_tqdm:
            from tqdm.auto import tqdm

            total = self.total or state.max_steps
            self.bar = tqdm(total=total, initial=self.global_step(state), unit="step", dynamic_ncols=True, file=sys.stderr)
        if self.bar is not None:
            self.bar.set_description(self.phase_name() or None)

    def stop_heartbeat(self) -> None:
        """End the current step's heartbeat thread, if any (a step ended, or raised)."""
        if self._step_done is not None:
            self._step_done.set()

    def on_step_begin(self, args, state, control, **kwargs):
        self.stop_heartbeat()  # a step begun after one that raised inside the loop: one heartbeat at a time
        if state.is_world_process_zero and self.heartbeat_seconds > 0:
            self._step_done = threading.Event()
            step = self.global_step(state) + 1
            threading.Thread(target=self._heartbeat, args=(self._step_done, step, state), daemon=True).start()

    def _heartbeat(self, done: threading.Event, step: int, state: Any) -> None:
        began = time.time()
        while not done.wait(self.heartbeat_seconds):
            finished = step - 1 - self.first_step
            mean = (began - self.started) / finished if finished > 0 and self.started else None
            usual = f"; steps so far took {duration(mean)} on average" if mean else ""
            self._write(f"step {step}/{self.total or state.max_steps}{self._phase()}: still running after "
                        f"{duration(time.time() - began)} (generating and scoring){usual}")  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        self.stop_heartbeat()
        if self.bar is not None and state.is_world_process_zero:
            self.bar.update(self.global_step(state) - self.bar.n)

    def _phase(self) -> str:
        return f" [{self.phase_name()}]" if self.phase_name() else ""

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs or not metrics_line(logs):
            return
        self._start(args, state)  # validation before the first step logs before `on_train_begin` reaches us
        step, total = self.global_step(state), self.total or state.max_steps
        where = f"step {step}/{total}{self._phase()}"
        if self.bar is not None:  # the bar shows rate and ETA
            self._write(f"{where}: {metrics_line(logs)}")
            return
        elapsed, done = time.time() - self.started, step - self.first_step
        each = elapsed / done if done > 0 else float("nan")
        timing = f"{duration(elapsed)} elapsed, {each:.2f} s/step, ETA {duration(each * (total - step))}" if done > 0 else "starting"
        self._write(f"{where} ({timing}): {metrics_line(logs)}")

    def on_train_end(self, args, state, control, **kwargs):
        self.stop_heartbeat()
        if self.bar is not None and self.last_part():
            self.bar.close()
            self.bar = None
