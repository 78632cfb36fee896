"""Hard resets, merged saves and resume for `ProRLTrainer` (a mixin, kept apart to keep each module short).

The mechanics (merge in place, fresh adapter, optimizer state, reference copy, merged save) are plain functions in
`prorl_trl.reset`; this mixin decides what to call for the trainer's switches (`reset_optimizer`,
`reset_reference`, `save_merged_on_reset`) and whether it runs inside the HF loop (swap in place) or at a phase
boundary (let the next inner `train()` build what is missing).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prorl_trl import reset as reset_ops
from prorl_trl.config import ResolvedPhase
from prorl_trl.resume import LOG_HISTORY_NAME, latest_checkpoint, load_merged_base, read_prorl_state, write_json
from prorl_trl.vllm_sync import force_weight_sync

logger = logging.getLogger("prorl_trl")


class ProRLResetMixin:
    """`hard_reset`, `request_hard_reset`, merged saves and the ProRL side of resuming."""

    def _prepare_resume(self, resume_from_checkpoint: str | bool | None) -> Path | None:
        """Restore the ProRL side of a checkpoint (phase, merged base, adapter shape, counters) before TRL's part."""
        self._resumed_phase_step = 0
        if not resume_from_checkpoint:
            return None
        if resume_from_checkpoint is True:
            checkpoint = latest_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(f"No ProRL checkpoint (phase-*/checkpoint-*/prorl_state.json) in {self.args.output_dir}.")
        else:
            checkpoint = Path(resume_from_checkpoint)
        state = read_prorl_state(checkpoint)
        phase = self.phases[state["phase_index"]]
        if state.get("merged_base"):
            load_merged_base(self.model, state["merged_base"])
            if self.ref_model is not None and self.args.reset_reference:
                load_merged_base(self.ref_model, state["merged_base"])
        self.prorl_resets = state["resets"]
        self.prorl_merged_path = state.get("merged_base")
        self._global_step_offset = state["global_step_offset"]
        self._resumed_phase_step = state["phase_global_step"]
        self._pending_reset = state.get("pending_reset")
        if self._adapter_differs(phase):
            self._reinit_adapter(phase)
        self._apply_phase(phase)
        self._scheduler_horizon = state.get("scheduler_horizon")
        self._state_callback.load_state_dict(state.get("callbacks", {}))
        history = Path(self.args.output_dir) / LOG_HISTORY_NAME
        if history.is_file():
            entries = json.loads(history.read_text())
            step = self._global_step_offset + self._resumed_phase_step
            self.prorl_log_history = [e for e in entries if e.get("prorl/global_step", 0) <= step]
        self._announce_phase(phase)
        return checkpoint

    def _fresh_adapter(self, phase: ResolvedPhase) -> bool:
        """A fresh adapter of `phase`'s shape, identical on every rank; True when its Parameters are new objects."""
        new_params = reset_ops.reinit_adapter(
            self.model, r=phase.lora_r, lora_alpha=phase.lora_alpha, target_modules=phase.lora_target_modules, seed=self._reset_seed()
        )
        reset_ops.broadcast_adapter(self.model)
        return new_params

    def _reinit_adapter(self, phase: ResolvedPhase) -> None:
        """Outside the loop, before any merge (first phase, resume): new Parameters drop the optimizer for `train()`."""
        if self._fresh_adapter(phase):
            self.optimizer, self.lr_scheduler, self.model_wrapped = None, None, self.model

    def _reset_seed(self) -> int:
        """Seed of the k-th fresh adapter: deterministic, identical on all ranks, different per reset."""
        return self._base_seed * 1000 + 7919 * (self.prorl_resets + 1)

    def _save_log_history(self) -> None:
        if self.accelerator.is_main_process and self.args.should_save:
            write_json(Path(self.args.output_dir) / LOG_HISTORY_NAME, self.prorl_log_history)

    def _save_final(self) -> None:
        """`<output_dir>/final/`: the merged model + tokenizer, loadable with `from_pretrained`."""
        if self.accelerator.is_main_process and self.args.should_save:
            self._save_merged(Path(self.args.output_dir) / "final")
        self.accelerator.wait_for_everyone()

    def _save_merged(self, path: Path) -> None:
        model = reset_ops.unwrap_model(self.model)
        if hasattr(model, "peft_config"):
            reset_ops.save_merged_model(model, self.processing_class, path)
        else:
            model.save_pretrained(path)
            self.processing_class.save_pretrained(path)

    # --------------------------------------------------------------------------------------------------- reset
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """HF's, but over the horizon of the last in-loop reset when there was one in this phase.

        After an in-loop reset the schedule restarts over the phase's *remaining* steps; a checkpoint stores only the
        scheduler's `state_dict` (a LambdaLR keeps no horizon), and on resume HF rebuilds the schedule over the whole
        phase. `_scheduler_horizon` (saved in `prorl_state.json`) makes the rebuilt schedule the same one.
        """
        if self._scheduler_horizon is not None:
            num_training_steps = self._scheduler_horizon
        return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)

    def request_hard_reset(self, reason: str = "requested") -> None:
        """Ask for a hard reset at the start of the next step (safe point: no pending gradients, before generation)."""
        self._pending_reset = reason

    def hard_reset(self, reason: str = "manual", lora_phase: ResolvedPhase | None = None) -> None:
        """Merge the LoRA delta into the base, start a fresh adapter, reset optimizer and reference (per switches).

        The model's outputs are unchanged (fresh B = 0). `lora_phase` gives the fresh adapter's shape (default: the
        current phase). Saves the merged model under `<output_dir>/merged/reset-<k>/` when `save_merged_on_reset`.
        """
        if not self._reset_support_checked:  # manual calls in a run that had no reset planned at init
            reset_ops.check_reset_support(self.args, self.model, self.accelerator)
            self._reset_support_checked = True
        target = lora_phase or self.current_phase
        model = reset_ops.unwrap_model(self.model)
        new_params = False
        if hasattr(model, "peft_config"):
            reset_ops.merge_lora_in_place(model)
            new_params = self._fresh_adapter(target)
            if self.args.reset_reference:  # a TRL "ref" adapter (PeftModel given with beta > 0) -> the merged base
                reset_ops.reset_reference_adapter(model)
        elif self.args.reset_reference and self.ref_model is not None:
            reset_ops.sync_reference(self.ref_model, model)
        self._reset_optimizer(new_params)
        self.prorl_resets += 1
        self._pending_reset = None
        force_weight_sync(self)
        if self.args.save_merged_on_reset:
            path = Path(self.args.output_dir) / "merged" / f"reset-{self.prorl_resets}"
            if self.accelerator.is_main_process:
                self._save_merged(path)
            self.accelerator.wait_for_everyone()
            self.prorl_merged_path = str(path)
        self.announce(f"ProRL hard reset #{self.prorl_resets} at global step {self.prorl_global_step} ({reason}).")

    def _reset_optimizer(self, new_params: bool) -> None:
        """Fresh optimizer state / LR schedule after a reset; a new optimizer when the adapter has new Parameters.

        Outside the HF loop (phase boundary, manual call) a new adapter only drops the optimizer: the next `train()`
        builds and prepares one (and re-wraps DDP, `model_wrapped = model`). Inside the loop the optimizer and
        scheduler are swapped in place (`trainer.optimizer`/`lr_scheduler` are looked up every step, notes §5).
        """
        if self.optimizer is None:
            return
        if new_params and not self._in_training_loop:
            if not self.args.reset_optimizer:
                logger.warning("The LoRA shape changed: optimizer state cannot carry over to the new adapter.")
            self.optimizer, self.lr_scheduler, self.model_wrapped = None, None, self.model
            return
        if new_params:
            if self.accelerator.num_processes > 1:
                raise RuntimeError(
                    "A LoRA shape change inside a phase would desynchronise DDP replicas; change the adapter shape only "
                    "at a phase boundary (PhaseConfig.lora_r / lora_target_modules)."
                )
            stale = self.optimizer
            self.accelerator._optimizers = [o for o in self.accelerator._optimizers if o is not stale]
            self.optimizer = None
            self.create_optimizer()
            self.optimizer = self.accelerator.prepare(self.optimizer)
        elif self.args.reset_optimizer:
            reset_ops.reset_optimizer_state(self.optimizer)
        else:
            return
        if self._in_training_loop:
            self.lr_scheduler = None
            self._scheduler_horizon = max(self.state.max_steps - self.state.global_step, 1)
            self.create_scheduler(num_training_steps=self._scheduler_horizon, optimizer=self.optimizer)
            self.callback_handler.optimizer = self.optimizer
            self.callback_handler.lr_scheduler = self.lr_scheduler

