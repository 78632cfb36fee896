"""The trainer's own callback: the phase-start log entry, pending resets at step start, stop requests at step end, the
phase plateau rule, and `prorl_state.json` in every checkpoint (what a resume needs beyond TRL's checkpoint).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..reset.checkpoint import PRORL_STATE_NAME, write_json
from .callbacks import HardResetCallback, PlateauTracker


class ProRLStateCallback(TrainerCallback):
    """Internal: phase-start entry, pending resets, stop requests, the phase plateau rule, `prorl_state.json`."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.phase_tracker: PlateauTracker | None = None

    def start_phase(self, phase: Any) -> None:
        args = self.trainer.args
        self.phase_tracker = (
            PlateauTracker(phase.plateau_patience, phase.plateau_min_delta, args.plateau_mode)
            if phase.plateau_patience > 0
            else None
        )

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._on_train_begin()  # after HF built this call's engine: a carried DeepSpeed optimizer goes in
        if not self.trainer._resumed_inner_call:
            self.trainer.log_phase_start()
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer._pending_reset:
            self.trainer.hard_reset(reason=self.trainer._pending_reset)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._agree_on_stop():  # a signal: finish this step with a checkpoint, then stop
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.phase_tracker is not None and logs and args.plateau_metric in logs:
            if self.phase_tracker.update(logs[args.plateau_metric]):
                control.should_training_stop = True
                self.trainer._phase_end_reason = (
                    f"{args.plateau_metric} plateau: no improvement > {self.phase_tracker.min_delta} in "
                    f"{self.phase_tracker.patience} evaluations"
                )
        return control

    def on_save(self, args, state, control, **kwargs):
        """Commit the checkpoint HF just wrote: the run's log history first, then `prorl_state.json` (the commit record
        `latest_checkpoint` looks for), so a checkpoint that has one is complete."""
        trainer = self.trainer
        trainer._save_log_history()
        if not trainer.accelerator.is_main_process:
            return control
        checkpoint = os.path.join(trainer._get_output_dir(None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")  # as HF
        write_json(
            os.path.join(checkpoint, PRORL_STATE_NAME),
            {
                "phase_index": trainer.current_phase.index,
                "phase_name": trainer.current_phase.name,
                "phase_global_step": state.global_step,
                # The phase ends with this step (its last step, or a plateau stop): a resume goes to the next phase.
                "phase_complete": state.global_step >= state.max_steps or trainer._phase_end_reason != "max_steps",
                "phase_end_reason": trainer._phase_end_reason,
                "global_step_offset": trainer._global_step_offset,
                "global_step": trainer.prorl_global_step,
                "resets": trainer.prorl_resets,
                "merged_base": trainer.prorl_merged_path,
                "pending_reset": trainer._pending_reset,
                "scheduler_horizon": trainer._scheduler_horizon,
                "sampling": trainer.sampling,
                "callbacks": self.state_dict(),
            },
        )
        return control

    def _reset_callbacks(self) -> list[HardResetCallback]:
        return [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, HardResetCallback)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase_plateau": self.phase_tracker.state_dict() if self.phase_tracker else None,
            "reset_plateau": [cb.tracker.state_dict() if cb.tracker else None for cb in self._reset_callbacks()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.phase_tracker is not None and state.get("phase_plateau"):
            self.phase_tracker.load_state_dict(state["phase_plateau"])
        for cb, saved in zip(self._reset_callbacks(), state.get("reset_plateau") or []):
            if cb.tracker is not None and saved:
                cb.tracker.load_state_dict(saved)
