"""Pieces of `ProRLTrainer` kept apart to keep each module short: the loop overrides for dynamic sampling and
minibatch early stop (`ProRLLoopMixin`), and the internal callback that runs pending resets, the phase plateau rule
and writes `prorl_state.json` into every checkpoint (`ProRLStateCallback`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from prorl_trl.callbacks import HardResetCallback, PlateauTracker
from prorl_trl.dynamic_sampling import RefillSampler, dynamic_sampling_step
from prorl_trl.resume import PRORL_STATE_NAME, write_json


class ProRLLoopMixin:
    """Overrides of TRL 1.16 internals; each says why TRL's own behaviour is not enough."""

    _last_rewards_per_func: torch.Tensor | None = None
    _capture_logps = False
    _captured_logps: torch.Tensor | None = None
    _refill_samplers: dict | None = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Keep TRL's gathered (all-rank) rewards: dynamic sampling keys on one function's column, which TRL folds
        into advantages without returning it."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards
        return rewards

    def _generate_and_score_completions(self, inputs):
        """TRL's generation + scoring, then (training, `dynamic_sampling=True`) drop uniform-correctness groups and
        refill them with fresh prompts. Wrapping this method keeps TRL's buffering (`_buffered_inputs`), shuffling and
        splitting in `_prepare_inputs` untouched: the combined output has the same rows per rank as TRL's."""
        output = super()._generate_and_score_completions(inputs)
        if not self.args.dynamic_sampling or not self.model.training:
            return output
        column = self._correctness_index
        sampler = self._refill_sampler()
        local_rows = len(inputs)
        rank = self.accelerator.process_index

        def generate_round():
            indices = sampler.next_batch()[rank * local_rows : (rank + 1) * local_rows]
            fresh = [self.train_dataset[int(i)] for i in indices]
            round_output = super(ProRLLoopMixin, self)._generate_and_score_completions(fresh)
            return round_output, self._last_rewards_per_func[:, column]

        combined, stats = dynamic_sampling_step(
            output,
            self._last_rewards_per_func[:, column],
            generate_round,
            num_generations=self.num_generations,
            process_index=rank,
            num_processes=self.accelerator.num_processes,
            max_extra_rounds=self.args.dynamic_sampling_max_rounds,
            pad_token_id=self._tokenizer.pad_token_id,
        )
        loss_mask = combined["completion_mask"]
        if "tool_mask" in combined:
            loss_mask = loss_mask * combined["tool_mask"]
        combined["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        for key, value in stats.items():
            self._metrics["train"][key].append(value)
        return combined

    def _refill_sampler(self) -> RefillSampler:
        """One refill stream per phase (the group size may change), seeded apart from TRL's own sampler."""
        self._refill_samplers = self._refill_samplers or {}
        phase = self.current_phase
        if phase.index not in self._refill_samplers:
            self._refill_samplers[phase.index] = RefillSampler(
                len(self.train_dataset),
                self.num_generations,
                self.args.generation_batch_size // self.num_generations,
                seed=self.args.seed + 100_003,
                shuffle=self.args.shuffle_dataset,
            )
        return self._refill_samplers[phase.index]

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Unchanged, but remembers the log-probs while `_compute_loss` runs (early stop needs them)."""
        result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if self._capture_logps:
            self._captured_logps = result[0]
        return result

    def _compute_loss(self, model, inputs):
        """RLinf minibatch early stop: zero the micro-batch loss (keeping the graph, so DDP still all-reduces) when the
        token-masked mean importance ratio pi_new/pi_old, averaged over ranks, exceeds the threshold. TRL's
        `off_policy_mask_threshold` masks sequences by KL instead and has no whole-micro-batch rule."""
        threshold = self.args.early_stop_importance_ratio
        if threshold is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        self._capture_logps = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_logps = False
        logps, self._captured_logps = self._captured_logps, None
        old = inputs.get("old_per_token_logps")
        if old is None:  # on-policy micro-batch: TRL uses the detached current log-probs, so the ratio is exactly 1
            return loss
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        ratio = torch.exp(logps.detach() - old) * mask
        mean_ratio = ratio.sum() / mask.sum().clamp(min=1)
        mean_ratio = self.accelerator.gather(mean_ratio.reshape(1).float()).mean().item()  # one device sync
        self._metrics["train"]["prorl/importance_ratio"].append(mean_ratio)
        if mean_ratio > threshold:
            self._early_stopped += 1
            loss = loss * 0.0
        return loss


class ProRLStateCallback(TrainerCallback):
    """Internal: pending resets at step start, the phase plateau rule, and `prorl_state.json` in each checkpoint."""

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

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer._pending_reset:
            self.trainer.hard_reset(reason=self.trainer._pending_reset)
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
        trainer = self.trainer
        if not trainer.accelerator.is_main_process:
            return control
        checkpoint = os.path.join(trainer._get_output_dir(None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")  # as HF
        write_json(
            os.path.join(checkpoint, PRORL_STATE_NAME),
            {
                "phase_index": trainer.current_phase.index,
                "phase_name": trainer.current_phase.name,
                "phase_global_step": state.global_step,
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
        trainer._save_log_history()
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
