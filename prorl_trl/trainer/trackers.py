"""Experiment trackers (`report_to`) across a multi-phase run.

HF's tracker callbacks (`transformers.integrations`) assume one `train()` call per run: they open the run in
`on_train_begin`, close it in `on_train_end` (MLflow ends it, trackio finishes it, TensorBoard closes its writer) and
plot against `state.global_step`. A ProRL run calls `train()` once per phase and HF's step restarts at 0 each time,
so left alone MLflow would record one run per phase and every tracker would draw the phases on top of each other.
`TrackerSpan` makes each tracker callback see one run: `on_train_begin` once, `on_train_end` once (when the whole run
ends, stops on a signal or fails), and `on_log` at the run's continuous step (`prorl_global_step`). Resuming
continues the tracker's run where the tracker can: TensorBoard writes into the same folder and hides the steps the
killed process logged after its checkpoint (`purge_step`); trackio, W&B and MLflow get the run name / id recorded in
`<output_dir>/prorl_trackers.json` by the first process.

The callbacks keep their class (so `trainer.pop_callback(TensorBoardCallback)` still works): only three bound
methods of each instance are wrapped. Text entries (the merged checkpoint's folder at a phase start) reach TensorBoard
as text and W&B/trackio as values; MLflow, whose metrics are numbers, gets them as run tags.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers.integrations import INTEGRATION_TO_CALLBACK

from .manifest import TRACKER_IDS_NAME, read_tracker_ids, tensorboard_folder_in

_TRACKER_CLASSES = tuple(INTEGRATION_TO_CALLBACK.values())


def is_tracker(callback: Any) -> bool:
    return isinstance(callback, _TRACKER_CLASSES)


class TrackerSpan:
    """One tracker run per ProRL run (see module doc). `trainer` needs `prorl_global_step`, `args`, `accelerator`."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.resumed_at: int | None = None  # continuous step of the checkpoint a resume starts from
        self._begun: list[tuple[Any, Any]] = []  # (callback, its own on_train_end)
        self._wrapped: set[int] = set()

    def attach(self, callbacks: list[Any]) -> None:
        for callback in callbacks:
            if is_tracker(callback) and id(callback) not in self._wrapped:
                self._wrapped.add(id(callback))
                self._wrap(callback)

    def _wrap(self, callback: Any) -> None:
        begin, end, log = callback.on_train_begin, callback.on_train_end, callback.on_log

        def on_train_begin(args, state, control, **kwargs):
            if any(done is callback for done, _ in self._begun):
                return None
            self._begun.append((callback, end))
            before = _folder_entries(getattr(callback, "logging_dir", None))  # a TensorBoard folder that exists
            with self._continue_tracker_run(callback, args):
                result = begin(args, state, control, **kwargs)
            self._record_ids(callback, args, before)
            return result

        def on_train_end(args, state, control, **kwargs):
            return None  # the run ends in `end()`, not at the end of each phase

        def on_log(args, state, control, logs=None, **kwargs):
            view = copy.copy(state)
            view.global_step = self.trainer.prorl_global_step
            if logs and type(callback).__name__ == "MLflowCallback":
                logs = _text_as_mlflow_tags(callback, logs, view.global_step)
            return log(args, view, control, logs=logs, **kwargs)

        callback.on_train_begin, callback.on_train_end, callback.on_log = on_train_begin, on_train_end, on_log

    def end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close every tracker run that was opened (end of the run, a stop on a signal, or a failure)."""
        begun, self._begun = self._begun, []
        view = copy.copy(state)
        view.global_step = self.trainer.prorl_global_step
        for _, on_train_end in begun:
            on_train_end(args, view, control, **kwargs)

    # ----------------------------------------------------------------------------------- continuing a tracker run
    def _ids_file(self, args: Any) -> Path:
        return Path(args.output_dir) / TRACKER_IDS_NAME

    def _saved_ids(self, args: Any) -> dict[str, Any]:
        return read_tracker_ids(args.output_dir) if self.resumed_at is not None else {}

    @contextlib.contextmanager
    def _continue_tracker_run(self, callback: Any, args: Any) -> Iterator[None]:
        name = type(callback).__name__
        saved = self._saved_ids(args)
        env: dict[str, str] = {}
        if name == "TensorBoardCallback" and self.resumed_at is not None:
            folder = tensorboard_folder_in(args.output_dir, saved.get("tensorboard"))  # outside: the recipe's own
            _reopen_tensorboard(callback, args, folder and str(folder), purge_step=self.resumed_at + 1)
        elif name == "WandbCallback" and saved.get("wandb"):
            env = {"WANDB_RUN_ID": saved["wandb"], "WANDB_RESUME": "allow"}
        elif name == "MLflowCallback" and saved.get("mlflow"):
            env = {"MLFLOW_RUN_ID": saved["mlflow"]}
        elif name == "TrackioCallback" and saved.get("trackio"):
            args.run_name = args.run_name or saved["trackio"]
        previous = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _record_ids(self, callback: Any, args: Any, before: set[str] | None = None) -> None:
        """What a resumed process needs to continue this tracker's run (main process, first phase only)."""
        if not self.trainer.accelerator.is_main_process:
            return
        from ..reset.provenance import run_relative
        name = type(callback).__name__
        ids = {}
        with contextlib.suppress(Exception):  # a tracker that did not open a run has nothing to record
            if name == "TensorBoardCallback" and callback.logging_dir:
                folder = Path(callback.logging_dir)
                inside = folder.resolve().is_relative_to(Path(args.output_dir).resolve())  # a moved run finds its own
                ids["tensorboard"] = run_relative(folder, args.output_dir) if inside else str(folder)
            elif name == "WandbCallback" and callback._wandb.run is not None:
                ids["wandb"] = callback._wandb.run.id
            elif name == "MLflowCallback" and callback._ml_flow.active_run() is not None:
                ids["mlflow"] = callback._ml_flow.active_run().info.run_id
            elif name == "TrackioCallback":  # the name trackio generated when `run_name` is not set
                ids["trackio"] = callback._trackio.context_vars.current_run.get().name
        if name == "TensorBoardCallback" and getattr(callback, "logging_dir", None):  # its event folder is the run's
            from .manifest import record_outputs

            folder = os.path.relpath(os.path.abspath(callback.logging_dir), os.path.abspath(args.output_dir))
            if before is None:  # the writer made the folder: all of it is the run's
                record_outputs(args.output_dir, [folder + "/"], created=True)  # outside the run folder: not recorded
            else:  # a folder that was there (`TENSORBOARD_LOGGING_DIR`, other experiments in it): only the run's files
                added = sorted(_folder_entries(callback.logging_dir) - before)
                record_outputs(args.output_dir, [f"{folder}/{entry}" for entry in added], created=True)
        if ids:
            from ..reset.checkpoint import write_json

            write_json(self._ids_file(args), {**read_tracker_ids(args.output_dir), **ids})


def _folder_entries(folder: str | None) -> set[str] | None:
    """The names in `folder`, or None where there is no such folder."""
    if not folder or not os.path.isdir(folder):
        return None
    return set(os.listdir(folder))


def _reopen_tensorboard(callback: Any, args: Any, logging_dir: str | None, purge_step: int) -> None:
    """Point HF's TensorBoard callback at the resumed run's folder, hiding events at steps >= `purge_step` (those the
    killed process logged after the checkpoint the run resumes from; the resumed process logs them again)."""
    logging_dir = logging_dir or callback.logging_dir
    if logging_dir is None:
        return
    callback.logging_dir = logging_dir
    callback.tb_writer = callback._SummaryWriter(log_dir=logging_dir, purge_step=purge_step)


def _text_as_mlflow_tags(callback: Any, logs: dict[str, Any], step: int) -> dict[str, Any]:
    """MLflow metrics are numbers (HF drops text with a warning): text values (the merged-checkpoint path) become run
    tags `<key>@<step>` instead."""
    text = {key: value for key, value in logs.items() if isinstance(value, str)}
    if text and callback._ml_flow.active_run() is not None:
        callback._ml_flow.set_tags({f"{key}/step-{step}": value for key, value in text.items()})
    return {key: value for key, value in logs.items() if key not in text}
