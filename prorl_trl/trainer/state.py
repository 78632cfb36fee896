"""The trainer's own callback: the phase-start log entry, pending resets at step start, stop requests at step end, the
phase plateau rule, and `prorl_state.json` in every checkpoint (what a resume needs beyond TRL's checkpoint);
`resume_state` reads it back, or makes it up for a plain TRL checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..reset.checkpoint import (
    PRORL_STATE_NAME,
    in_phase_dir,
    json_text,
    latest_checkpoint,
    prune_committed_checkpoints,
    read_prorl_state,
    record_checkpoint_hashes,
    write_text_atomically,
)
from ..reset.provenance import run_relative
from .callbacks import HardResetCallback, PlateauTracker


def find_checkpoint(output_dir: str | os.PathLike) -> Path:
    """`resume_from_checkpoint=True`: the latest ProRL checkpoint, else the latest plain TRL one (`checkpoint-<n>`)."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None and os.path.isdir(output_dir):
        plain = get_last_checkpoint(output_dir)
        checkpoint = Path(plain) if plain is not None and (Path(plain) / TRAINER_STATE_NAME).is_file() else None
    if checkpoint is None:
        raise ValueError(
            f"No checkpoint to resume from in {output_dir}: neither a ProRL one (phase-*/checkpoint-*/"
            f"{PRORL_STATE_NAME}) nor a TRL one (checkpoint-*/{TRAINER_STATE_NAME})."
        )
    return checkpoint


def resume_state(checkpoint: Path, first_phase: Any) -> dict[str, Any]:
    """The ProRL state to resume `checkpoint` with: its `prorl_state.json`, or, for a plain `GRPOTrainer` checkpoint,
    phase 0 with no resets so far at the checkpoint's step (its log history becomes phase 0's).

    A TRL checkpoint further than phase 0's `max_steps` is refused: HF would train no step and the run would start
    phase 1 from weights that already trained past phase 0's plan.
    """
    checkpoint = Path(checkpoint)
    written_by_prorl = in_phase_dir(checkpoint) or (checkpoint / PRORL_STATE_NAME).is_file()
    if written_by_prorl or not (checkpoint / TRAINER_STATE_NAME).is_file():
        return read_prorl_state(checkpoint)  # a ProRL checkpoint without it was interrupted mid-save: refused there
    trainer_state = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())
    step = int(trainer_state["global_step"])
    if 0 < first_phase.max_steps < step:
        raise ValueError(
            f"{checkpoint} is a TRL checkpoint at step {step}, past phase 0 ({first_phase.name}), which has "
            f"max_steps={first_phase.max_steps}. Make phase 0 at least {step} steps long to continue that run."
        )
    planned = first_phase.max_steps if first_phase.max_steps > 0 else int(trainer_state.get("max_steps", 0))
    history = [
        {**entry, "prorl/phase": 0, "prorl/resets": 0, "prorl/global_step": entry.get("step", 0),
         "prorl/phase_step": entry.get("step", 0)}
        for entry in trainer_state.get("log_history", [])
    ]
    return {
        "phase_index": 0,
        "resets": 0,
        "global_step_offset": 0,
        "phase_global_step": step,
        "phase_complete": step >= planned,  # epochs: the TRL run's own length (the same settings give the same)
        "log_history": history,
    }


class PhaseLengthError(ValueError):
    """A resume whose phase is now shorter than the steps it has already trained. The CLI prints the message and exits
    2 (nothing was trained)."""

    exit_status = 2


def resumed_phase_complete(
    state: dict[str, Any], phase: Any, checkpoint: Path, length: int | None = None, steps_per_epoch: int | None = None
) -> bool:
    """Whether the checkpoint's phase is over under this run's settings (a resume then goes to the next phase).

    A phase that ran to its length is measured against the phase length this run asks for, not the recorded one:
    a longer phase trains on to its new end, one whose new end is the checkpoint's step ends there. A phase already
    past its new end is refused: the steps it trained cannot be taken back, and ending it there would leave a phase
    longer than asked. The length is the phase's `max_steps`, or for a phase of `num_train_epochs` (`max_steps` < 1)
    `length`, the steps HF derives from the epochs (`epoch_phase_length`; `steps_per_epoch` names the rate in the
    refusal). A plateau stop stays a stop; an epoch-based phase whose length is not given, plain TRL checkpoints
    and ProRL ones that recorded no `phase_end_reason` (a plateau stop cannot be told from a length) keep the
    recorded answer.
    """
    step, reason = state["phase_global_step"], state.get("phase_end_reason")
    if reason is not None and reason != "max_steps":
        return True
    epochs = phase.max_steps < 1
    planned = length if epochs else phase.max_steps
    if reason is None or planned is None or planned < 1:
        return bool(state.get("phase_complete", 0 < phase.max_steps <= step))
    if step > planned:
        if epochs:
            rate = f" ({steps_per_epoch} steps per epoch)" if steps_per_epoch else ""
            least = f"{math.ceil(step / steps_per_epoch)}" if steps_per_epoch else "more epochs"
            raise PhaseLengthError(
                f"{checkpoint} has trained {step} steps of phase {phase.index} ({phase.name}), and this run makes that "
                f"phase {planned} steps long (num_train_epochs={phase.num_train_epochs:g}{rate}): the steps already "
                f"trained cannot be taken back. Nothing was written. Resume with `--training.num_train_epochs {least}`"
                f" or more (or `--training.max_steps {step}` or more), or start a new run with the shorter phase."
            )
        raise PhaseLengthError(
            f"{checkpoint} has trained {step} steps of phase {phase.index} ({phase.name}), and this run makes that "
            f"phase {phase.max_steps} steps long: the steps already trained cannot be taken back. Resume with "
            f"`--phases.{phase.index}.max_steps {step}` or more, or start a new run with the shorter phase."
        )
    return step >= planned


def resumed_phase(state: dict[str, Any], phases: list[Any], checkpoint: Path) -> Any:
    """The phase of this run's `phases` that the checkpoint (`state`: `resume_state`) is in; a run with fewer phases
    is refused: the checkpoint's phase has trained, and a phase cannot be taken out of a run that went through it."""
    index = state["phase_index"]
    if index >= len(phases):
        raise PhaseLengthError(
            f"{checkpoint} is in phase {index} (counted from 0), and this run has {len(phases)} phase(s): the phases "
            f"up to {index} have trained and cannot be removed. Resume with at least {index + 1} phases (the run's "
            "own `phases:` list), or start a new run with fewer."
        )
    return phases[index]


def resumed_log_history(entries: list[Any], phase_index: int, step: int, phase_continues: bool) -> list[dict[str, Any]]:
    """The entries of the run's saved log history a resume from the checkpoint at (`phase_index`, global `step`)
    keeps: those up to it. When the phase trains on past the checkpoint (its length was raised, as when a finished
    run's last phase is extended), the summary HF logged at the phase's earlier end (`train_runtime`, `train_loss`) is
    dropped too: the phase's call logs it again where the phase ends now, as an uninterrupted run logs it once."""
    kept = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        if (entry.get("prorl/phase", 0), entry.get("prorl/global_step", 0)) > (phase_index, step):
            continue
        if phase_continues and entry.get("prorl/phase", 0) == phase_index and "train_runtime" in entry:
            continue
        kept.append(entry)
    return kept


def check_resumed_phase_length(checkpoint: str | os.PathLike, args: Any, peft_config: Any) -> None:
    """`resumed_phase` and `resumed_phase_complete`'s refusals, for the CLI to give before anything is loaded or
    written."""
    from ..config import resolve_phases

    phases = resolve_phases(args, peft_config, world_size=args.world_size)
    state = resume_state(Path(checkpoint), phases[0])
    resumed_phase_complete(state, resumed_phase(state, phases, Path(checkpoint)), Path(checkpoint))


class ProRLStateCallback(TrainerCallback):
    """Internal: phase-start entry, pending resets, stop requests, the phase plateau rule, `prorl_state.json`."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.phase_tracker: PlateauTracker | None = None
        self._save_waiting = False  # a `save_steps` save asked for inside a generation's steps, made at its end

    def start_phase(self, phase: Any) -> None:
        self._save_waiting = False
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
        # Only where TRL generates anew: the micro-batches a generation buffered hold the old reference's log-probs
        # (`ref_per_token_logps`), which a reference reset inside the cycle would leave stale for its other steps.
        if self.trainer._pending_reset and self.trainer.at_generation_boundary():
            self.trainer.hard_reset(reason=self.trainer._pending_reset)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # A checkpoint inside a generation's steps would not resume exactly (`ProRLTrainer.at_generation_boundary`):
        # a stop, and a save that `save_steps` asks for, wait for its last step (or the phase's).
        boundary = self.trainer.at_generation_boundary() or state.global_step >= state.max_steps
        if self.trainer._agree_on_stop() and boundary:  # a signal: finish this step with a checkpoint, then stop
            control.should_save = True
            control.should_training_stop = True
        if control.should_save and not boundary:
            control.should_save, self._save_waiting = False, True
        elif self._save_waiting and boundary:
            control.should_save, self._save_waiting = True, False
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
        """Commit the checkpoint HF just wrote: the run's log history first, then the checkpoint's file hashes, then
        `prorl_state.json` (the commit record `latest_checkpoint` looks for), so a checkpoint that has one is complete
        and has its hashes."""
        trainer = self.trainer
        trainer._save_log_history()
        # HF's save has no barrier after each process writes its own files (rng_state_<rank>.pth, its shards): wait
        # for them, so the hashes and the commit record cover a checkpoint every process has finished writing.
        trainer.accelerator.wait_for_everyone()
        if not trainer.accelerator.is_main_process:
            return control
        checkpoint = os.path.join(trainer._get_output_dir(None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")  # as HF
        commit = json_text(
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
                "adapter_resets": trainer.prorl_adapter_resets,  # resets with deltas to restore (reset_adapter)
                "nonfinite_skips": trainer.prorl_nonfinite_skips,  # `max_nonfinite_skips` bounds the whole run
                "on_demand_resets": trainer.prorl_on_demand_resets,  # phase ends a resume rebuilds (`on_demand`)
                # paths relative to the run folder, so a moved or copied run finds its own files (`reset.provenance`)
                "merged_base": trainer.prorl_merged_path and run_relative(trainer.prorl_merged_path, args.output_dir),
                "frozen_factors": trainer.prorl_frozen_path,
                "reset_files_sha256": trainer.prorl_reset_hashes,  # what a resume loads after the last reset
                "base_model": trainer.prorl_base_model,  # the base the deltas sit on: a resume refuses another
                "lora_reset_mode": args.lora_reset_mode,
                "pending_reset": trainer._pending_reset,
                "scheduler_horizon": trainer._scheduler_horizon,
                "scheduler_start": trainer._scheduler_start,  # a resume puts the horizon over its phase length
                "phase_loss_sum": trainer._phase_loss_sum(),  # a resumed phase's `train_loss` covers the whole phase
                "refill_position": trainer.refill_position(),  # dynamic sampling's refill stream goes on from there
                "sampling": trainer.sampling,
                "world_size": trainer.accelerator.num_processes,  # a resume on another number changes the batch
                "callbacks": self.state_dict(),
            },
        )
        record_checkpoint_hashes(checkpoint, commit)  # what a resume checks (`verify_checkpoint`), before the commit
        write_text_atomically(os.path.join(checkpoint, PRORL_STATE_NAME), commit)
        prune_committed_checkpoints(os.path.dirname(checkpoint), args.save_total_limit, [state.best_model_checkpoint])
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
