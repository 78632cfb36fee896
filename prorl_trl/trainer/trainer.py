"""`ProRLTrainer`: TRL's `GRPOTrainer` run as a sequence of phases with hard resets (ProRL, arXiv 2505.24864).

How it fits TRL 1.16 (see ../shared/notes/trl-internals.md):
* A phase is one inner `GRPOTrainer.train()` call: TRL fixes the group size, the generation batch and the sampler
  seed when it builds the dataloader (once per `train()`), so those, and a LoRA shape change, only move between calls.
* Sampling settings are pushed into the objects TRL baked them into at init (`generation_config`,
  `generation_kwargs`, `vllm_generation`, and the fused LM head's temperature) by `apply_sampling` (`.sampling`),
  which phases (`.phase_switch`) and `SamplingScheduleCallback` share.
* A hard reset (`hard_reset`) keeps the LoRA delta as frozen factors (or merges it into the base in place,
  `lora_reset_mode`), re-initialises the adapter, clears the optimizer state and moves the KL reference, without
  ever replacing the PeftModel. This class decides *when* and which switches apply; `.hard_reset` applies the plain
  functions of `prorl_trl.reset` to the trainer, and `.saves` writes what a reset and the run's end keep.
* Under FSDP2 and DeepSpeed ZeRO-2/3 (`reset.engine_of`) the same reset edits the engine's storage
  (`reset.sharded`), a LoRA shape change is the active part of a superset adapter allocated before TRL wraps the
  model (`_plan_sharded_adapter`), merged saves gather to rank 0, and under DeepSpeed each phase's `train()` gets a
  new engine (HF destroys the old one) with a kept optimizer carried into it
  (`phase_switch.keep_optimizer_for_next_call`).
* A resume (`.resume`) restores the ProRL side of a checkpoint (phase, counters, earlier deltas) before HF's part.

TRL methods overridden, and why (each relies on the private attribute named; guard tests in
tests/test_trainer_internals.py):
* `train`: runs the phases; the HF loop itself is untouched.
* `log`: adds `prorl/*` keys and keeps `prorl_log_history` across phases (HF recreates `state.log_history` per call);
  HF's end-of-call summary is dropped when a stop request ends the call mid-phase, and its `train_loss` after a
  mid-phase resume covers the whole phase (HF privates `_total_loss_scalar`, `_tr_loss`; see `_phase_loss_sum`).
* `_get_output_dir`: checkpoints go to `<output_dir>/phase-<i>/` because HF names them by the per-call step.
* `_save_checkpoint`: un-commits a checkpoint folder before HF rewrites it in place (see `reset.checkpoint`).
* `create_scheduler`: keeps the LR-schedule horizon of an in-loop reset across a resume.
* `_load_optimizer_and_scheduler` (HF): a resume with changed schedule settings (rate, phase length, warmup, type)
  goes on at the rates a fresh run with them has (the loaded states carry the old schedule's rate).
* `_calculate_rewards` / `_generate_and_score_completions`: dynamic sampling (`DynamicSamplingMixin`; no hook exists
  in TRL).
* `_compute_loss` / `_get_per_token_logps_and_entropies`: minibatch early stop (`MinibatchEarlyStopMixin`) needs the
  policy log-probs TRL computes inside the loss and does not return; `kl_clamp` (`KLClampMixin`) bounds the KL term
  as verl's `low_var_kl` does, by editing the reference log-probs between the two reads.
* `_load_from_checkpoint` (HF): keeps the trainable parameters' dtype across a resume (PEFT's `load_adapter` casts a
  QLoRA adapter, which TRL keeps in bf16, back to float32).
* `_generate_single_turn`: with `rollout_engine`, TRL's transformers branch (left-pad, `generate`, cut after the first
  EOS) runs `prorl_trl.rollout`'s CUDA-graph decode loop instead of `generate` (`generate_completions`, same return
  value); vLLM, multimodal inputs and settings the engine does not implement go to TRL's code.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

import rewards

from .. import reset as reset_ops
from ..attention import install_cudnn_attention_guard
from ..config import ProRLConfig, ResolvedPhase, resolve_phases
from ..console import announce, quiet_console
from ..reset.checkpoint import phase_dir_name, uncommit
from ..reset.provenance import base_model_identity
from ..reset.support import base_model_of
from ..rollout.trl_generation import attach_rollout_engine, generate_completions
from ..rollout.vllm_sync import stream_policy_weights
from .checks import check_before_init, check_launch, check_optimizer_hook, check_process_group, resets_possible
from .dynamic_sampling import DynamicSamplingMixin
from .early_stop import MinibatchEarlyStopMixin
from .finite import NonFiniteGuard
from .hard_reset import adapter_differs, reinit_adapter, run_hard_reset
from .interrupt import RunInterrupted
from .kl_clamp import KLClampMixin
from .manifest import record_outputs, trainer_outputs
from .on_demand import OnDemandResetCallback, next_phase_after
from .overlong import OverlongPenalty, unscored_rows_stay_unscored
from .phase_switch import announce_phase, apply_phase
from .placement import fsdp2_model_init_kwargs, move_stray_tensors_
from .progress import use_run_progress
from .replay import StepBatchesMixin
from .resume import match_loaded_schedule, prepare_resume, restore_finished_phase
from .reset_probe import save_probe_rows
from .sampling import SAMPLING_KEYS, apply_sampling
from .saves import save_final, save_log_history
from .state import ProRLStateCallback
from .trackers import TrackerSpan

logger = logging.getLogger("prorl_trl")


class ProRLTrainer(StepBatchesMixin, DynamicSamplingMixin, MinibatchEarlyStopMixin, KLClampMixin, GRPOTrainer):
    """`GRPOTrainer` with ProRL phases, hard resets, a phase-aware overlong penalty, dynamic sampling and early stop.

    Takes `GRPOTrainer`'s arguments, in its order; `args` is a [`ProRLConfig`] (None: a default one named after the
    model). With one phase it trains exactly as `GRPOTrainer` (tests/test_parity.py). Extra state, all readable:
    `phases` (resolved), `current_phase`, `prorl_global_step` (continuous across phases), `prorl_resets`,
    `prorl_log_history` (every log entry of the run, also saved to `<output_dir>/prorl_log_history.json`),
    `overlong_penalty` (the appended reward, or None), `sampling` (the settings in force), `prorl_on_demand_resets`
    (phases ended by a request file, `prorl-trl reset`: `trainer.on_demand`).
    """

    _tag_names = ["trl", "grpo", "prorl"]
    _name = "ProRL"
    # TRL's model card names the method's paper (GRPOTrainer's would say DeepSeekMath).
    _paper = {"title": "ProRL: Prolonged Reinforcement Learning Expands Reasoning Boundaries in Large Language Models",
              "id": "2505.24864"}  # fmt: skip

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: ProRLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Any] | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ):
        if args is None:  # as GRPOTrainer: a default config named after the model
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ProRLConfig(f"{model_name.split('/')[-1]}-ProRL")
        if not isinstance(args, ProRLConfig):
            raise TypeError(
                f"ProRLTrainer needs `args=ProRLConfig(...)`, got {type(args).__name__}. ProRLConfig accepts every "
                "GRPOConfig field plus phases/reset/overlong/dynamic-sampling options."
            )
        args = copy.copy(args)  # phases rewrite max_steps, seed, num_generations, ...: keep the caller's object intact
        self.phases: list[ResolvedPhase] = resolve_phases(args, peft_config, world_size=args.world_size)
        args.phases = [phase.to_phase_config() for phase in self.phases]  # trackers record the table as it runs
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
        self._num_user_rewards = len(reward_funcs)
        check_before_init(args, self.phases, model, peft_config, reward_funcs, list(callbacks or []), optimizers)
        check_process_group(args)
        # User-built objects are used as given; `hard_reset` refuses to rebuild a schedule it cannot (see checks).
        self._user_scheduler = optimizers[1] is not None
        # The engine (DDP, FSDP2, ZeRO-2/3) from args and `accelerate launch`'s environment: checked before any model
        # is loaded; `_check_after_init` re-reads it from the accelerator.
        self._engine = reset_ops.engine_of(args)
        if self._engine.kind == reset_ops.FSDP2 and not self._engine.ram_efficient_loading:  # see .placement
            args.model_init_kwargs = fsdp2_model_init_kwargs(args.model_init_kwargs, args.device)
        self._superset = self._plan_sharded_adapter(args, model, peft_config, list(callbacks or []))
        dataset_columns = getattr(train_dataset, "column_names", None)
        if dataset_columns is not None:  # a registry reward missing its gold column fails now, not after generation
            rewards.check_columns(reward_funcs, dataset_columns)

        self.overlong_penalty: OverlongPenalty | None = None
        if any(phase.overlong_buffer > 0 for phase in self.phases):
            first = self.phases[0]
            self.overlong_penalty = OverlongPenalty(
                first.max_completion_length, first.overlong_buffer, first.overlong_penalty_factor
            )
            reward_funcs.append(self.overlong_penalty)
            args.reward_weights = list(args.reward_weights or [1.0] * self._num_user_rewards) + [1.0]
            if reward_processing_classes is not None:
                listed = reward_processing_classes if isinstance(reward_processing_classes, list) else [reward_processing_classes]
                reward_processing_classes = listed + [None]

        self._base_seed = args.seed
        self.current_phase: ResolvedPhase = self.phases[0]
        self.prorl_resets = 0
        self.prorl_adapter_resets = 0  # resets that froze or merged the adapter (not those with reset_adapter=False)
        self.prorl_log_history: list[dict[str, Any]] = []
        self.prorl_merged_path: str | None = None
        self.prorl_merge_delta_lost: float | None = None  # the last reset's `MergeRounding.lost_fraction` (LoRA)
        self.prorl_frozen_path: str | None = None  # the last reset's frozen factors, relative to output_dir
        # sha256 of what a resume loads after the last reset (frozen factors, or the merged base), relative paths
        self.prorl_reset_hashes: dict[str, str] = {}
        self.prorl_reset_change: dict[str, float] = {}  # the last reset's `ResetProbe.measure` (LoRA, in a run)
        self._resumed_probe_rows: dict[str, torch.Tensor] | None = None  # for a reset before the resume's first step
        self._global_step_offset = 0
        self._in_training_loop = False
        self._pending_reset: str | None = None
        self._early_stopped = 0
        self._fused_forward_at_init: dict[int, Any] = {}
        self._phase_end_reason = "max_steps"
        self._scheduler_horizon: int | None = None
        self._scheduler_start = 0  # the phase step where the schedule started (an in-loop reset restarts it)
        self._compiled_generation = False
        self._stop_requested: str | None = None
        self._resumed_phase_step = 0
        self._resumed_phase_complete = False
        self._resumed_inner_call = False
        self._resumed_loss_sum: float | None = None  # the resumed phase's loss sum up to its checkpoint
        self._active_lora: dict[str, Any] | None = None  # the live part of a superset adapter (sharded engines)
        self._zero_carry: dict[str, Any] | None = None  # DeepSpeed optimizer carried into the next phase's engine
        self.prorl_nonfinite_skips: list[dict[str, Any]] = []  # steps skipped under `max_nonfinite_skips`
        self.prorl_on_demand_resets: list[dict[str, Any]] = []  # phases ended by `prorl-trl reset` (`on_demand`)
        # Called by `train()` once the checkpoint it resumes from has passed every check (at once for a start), before
        # anything in the run folder changes: the CLI records the run (and a resume's changes) there, so a refused
        # resume records nothing.
        self.on_resume_accepted: list[Callable[[], None]] = []

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=self._superset if self._superset is not None else peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        use_run_progress(self)  # one bar (or line per log) over all phases with rate and ETA, not a dict per log
        config = base_model_of(self.model).config  # a resume refuses another base (the deltas sit on this one)
        self.prorl_base_model = base_model_identity(
            getattr(config, "_name_or_path", "") or "", (args.model_init_kwargs or {}).get("revision"),
            getattr(config, "_commit_hash", None), Path(args.output_dir), getattr(self._tokenizer, "name_or_path", None),
        )  # fmt: skip

        self._check_after_init()
        # Before any training forward: cuDNN's SDPA backward returns NaN at some lengths (prorl_trl.attention).
        self.cudnn_attention_guard = install_cudnn_attention_guard(
            reset_ops.unwrap_model(self.model), args.cudnn_attention_guard, torch.float16 if args.fp16 else None
        )
        if self.cudnn_attention_guard.active or self.accelerator.device.type == "cuda":
            self.announce(self.cudnn_attention_guard.message)
        else:  # a CPU run: nothing to guard, nothing to show
            logger.info(self.cudnn_attention_guard.message)
        if self._engine.kind == reset_ops.FSDP2 and self.ref_model is not None:
            moved = move_stray_tensors_(self.ref_model, self.accelerator.device)
            if moved:
                logger.info("FSDP2: moved %d reference-model tensors to %s (%s, ...)", len(moved), self.accelerator.device, moved[0])
        if self.use_vllm and hasattr(reset_ops.unwrap_model(self.model), "peft_config"):
            stream_policy_weights(self.vllm_generation)  # every LoRA delta folded in, the live weights never written
        self.rollout_engine = attach_rollout_engine(self) if args.rollout_engine else None
        self.sampling: dict[str, Any] = {key: getattr(self, key) for key in SAMPLING_KEYS}
        self._state_callback = ProRLStateCallback(self)
        self.add_callback(self._state_callback)
        self.add_callback(OnDemandResetCallback(self))  # after the state callback: files a request once committed
        if args.stop_on_nonfinite:  # binds in `_bind_callbacks`: names the run's latest checkpoint when it stops
            self.add_callback(NonFiniteGuard())
        self._trackers = TrackerSpan(self)
        self._bind_callbacks()

    # ----------------------------------------------------------------------------------------------- validation
    def _plan_sharded_adapter(self, args: ProRLConfig, model: Any, peft_config: Any, callbacks: list) -> Any:
        """Refuse, before loading, a launch a reset cannot run under; under FSDP2/ZeRO return the superset LoraConfig
        that holds every phase's adapter (None when no phase changes the rank or targets, or not sharded).

        A sharded engine cannot take new Parameters after wrapping (`prorl_trl.reset.sharded`), so a LoRA shape
        change there is the active part of one adapter allocated at the largest rank on the union of targets.
        """
        engine = self._engine
        check_launch(args, engine, self.phases, model, peft_config, callbacks)
        if not engine.sharded or peft_config is None:
            return None
        shapes = [phase.lora_shape for phase in self.phases]
        return reset_ops.superset_lora_config(peft_config, shapes)

    def _check_after_init(self) -> None:
        self._engine = reset_ops.engine_of(self.args, self.accelerator)
        self._reset_support_checked = resets_possible(self.phases, self.callback_handler.callbacks)
        if self._reset_support_checked:
            reset_ops.check_reset_support(self.args, self.model, self.accelerator)
        if self.args.dynamic_sampling:
            name = self.args.dynamic_sampling_reward or self.reward_func_names[0]
            if name not in self.reward_func_names[: self._num_user_rewards]:
                raise ValueError(
                    f"dynamic_sampling_reward={name!r} is not one of the reward functions "
                    f"{self.reward_func_names[: self._num_user_rewards]}."
                )
            self._correctness_index = self.reward_func_names.index(name)
            if not hasattr(self.train_dataset, "__getitem__") or not hasattr(self.train_dataset, "__len__"):
                raise ValueError("dynamic_sampling needs a map-style train_dataset (refill prompts are drawn by index).")

    def _bind_callbacks(self) -> None:
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "bind") and callback is not self._state_callback:
                callback.bind(self)
        self._trackers.attach(self.callback_handler.callbacks)

    # ------------------------------------------------------------------------------------------------- sampling
    def apply_sampling(self, **settings: Any) -> None:
        """Make sampling settings reach generation (transformers or vLLM), the loss and the overlong penalty
        (`sampling.apply_sampling`: where TRL 1.16 baked each one in). Refuses an unknown setting, and one that
        `generation_kwargs` would shadow."""
        apply_sampling(self, **settings)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's, but text-only transformers-path generations go through `self.rollout_engine` when it is set.

        TRL 1.16 returns `(completion_ids, logprobs)` here; its transformers branch gives unpadded id lists cut after
        the first EOS and `logprobs=None`, and so does the engine (`prorl_trl.rollout.trl_generation`). Per-call
        fallback (None) for settings the engine does not implement.
        """
        if self.rollout_engine is not None and not self.use_vllm and images is None and not multimodal_fields:
            completion_ids = generate_completions(self, self.rollout_engine, prompt_ids)
            if completion_ids is not None:
                return completion_ids, None
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    # ---------------------------------------------------------------------------------------------------- phases
    @property
    def prorl_global_step(self) -> int:
        """Optimizer steps since the start of the run, continuous across phases (HF's restarts per phase)."""
        return self._global_step_offset + (self.state.global_step if self._in_training_loop else 0)

    def _apply_phase(self, phase: ResolvedPhase) -> None:
        """Point every phase-dependent setting at `phase` (before its inner `train()` call; `phase_switch`)."""
        apply_phase(self, phase)

    def _enter_phase(self, phase: ResolvedPhase) -> None:
        """Phase boundary: hard reset (or the adapter reshape a LoRA change forces), then the phase's settings."""
        reshape = adapter_differs(self, phase)
        if phase.index > 0 and (phase.hard_reset or reshape or self._pending_reset):
            if not phase.hard_reset:
                reason = self._pending_reset or "LoRA shape change"
                logger.warning("Phase %s: %s forces a hard reset (merge + fresh adapter).", phase.name, reason)
            self.hard_reset(reason=f"start of phase {phase.index} ({phase.name})", lora_phase=phase)
        elif reshape:  # first phase with another shape than peft_config: nothing to merge yet
            reinit_adapter(self, phase)
        self._pending_reset = None
        self._apply_phase(phase)
        announce_phase(self, phase)

    def announce(self, message: str, rule: bool = False) -> None:
        """Phase changes and resets, on the console (main process only, never cropped) and in the `prorl_trl` logger."""
        logger.info(message)
        if self.accelerator.is_main_process:
            announce(message, rule=rule)

    # ------------------------------------------------------------------------------------------- resume and saves

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """HF's, keeping each trainable parameter's dtype. GRPOTrainer casts a QLoRA adapter to bf16 at init; PEFT's
        `load_adapter`, which HF's resume calls, casts it back to float32 (`_cast_adapter_dtype`), so without this a
        resumed QLoRA run would train in another precision than the run it resumes, and end elsewhere."""
        target = model if model is not None else self.model
        dtypes = {name: p.dtype for name, p in target.named_parameters() if p.requires_grad}
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for name, param in target.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])

    def _restore_finished_phase(self, checkpoint: Path) -> None:
        """Resume from the checkpoint of a phase's last step without HF's `train()`, which would train one step more
        than the phase has (`resume.restore_finished_phase`)."""
        restore_finished_phase(self, checkpoint)

    def _save_log_history(self) -> None:
        """`<output_dir>/prorl_log_history.json` (`saves.save_log_history`)."""
        save_log_history(self)

    def _save_final(self) -> None:
        """`<output_dir>/final/`: the merged model, tokenizer and what was trained (`saves.save_final`)."""
        save_final(self)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's gathered rewards; with the overlong penalty, a completion no other reward scored stays unscored."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.overlong_penalty is not None:
            unscored_rows_stay_unscored(rewards)  # in place: dynamic sampling's kept copy sees it too
        return rewards

    def _on_train_begin(self) -> None:
        """After HF built this `train()` call's engine: put a carried DeepSpeed optimizer into it."""
        if self._zero_carry is not None:
            reset_ops.restore_zero_optimizer(self.optimizer, self._zero_carry)
            self._zero_carry = None
        if self._resumed_inner_call and self._resumed_loss_sum is not None:  # see `_phase_loss_sum`
            self._total_loss_scalar = self._resumed_loss_sum

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """HF's, but over the horizon of the last in-loop reset when there was one in this phase.

        After an in-loop reset the schedule restarts over the phase's *remaining* steps; a checkpoint stores only the
        scheduler's `state_dict` (a LambdaLR keeps no horizon), and on resume HF rebuilds the schedule over the whole
        phase. `_scheduler_horizon` (saved in `prorl_state.json`) makes the rebuilt schedule the same one.
        """
        if self._scheduler_horizon is not None:
            num_training_steps = self._scheduler_horizon
        return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """HF's, then the LR schedule of this run's settings at the checkpoint's step (`resume.match_loaded_schedule`).

        HF builds the scheduler from this run's settings and loads the checkpoint's state into it, which carries the
        old schedule's rate: a resume that changed a schedule setting (`learning_rate`, the resumed phase's
        `max_steps`, warmup, `lr_scheduler_type` or its kwargs; `--allow-changes`) would train its first step at the
        old rate and the next ones on the new schedule, a rate that rises in the middle of a decay.
        """
        fresh_rates = list(getattr(self.lr_scheduler, "base_lrs", None) or [])  # built from this run's settings
        super()._load_optimizer_and_scheduler(checkpoint)
        match_loaded_schedule(self, checkpoint, fresh_rates)

    # --------------------------------------------------------------------------------------------------- reset
    def request_hard_reset(self, reason: str = "requested") -> None:
        """Ask for a hard reset at the start of the next step that generates (`at_generation_boundary`: no pending
        gradients, and no buffered micro-batches scored against the old reference); at a phase's end, if none is
        left in it, the next phase starts with it."""
        self._pending_reset = reason

    def hard_reset(self, reason: str = "manual", lora_phase: ResolvedPhase | None = None) -> None:
        """Keep the LoRA delta (frozen factors, or merged: `lora_reset_mode`), start a fresh adapter, reset optimizer
        and reference (per switches).

        With frozen factors the outputs are bitwise unchanged (`prorl_trl.reset.frozen`; saved to
        `<output_dir>/frozen/reset-<k>.safetensors` for a resume); a merge is exact only into a float32 base.
        `lora_phase` gives the fresh adapter's shape (default: the current phase). Saves the merged model under
        `<output_dir>/merged/reset-<k>/` when `save_merged_on_reset`. The mechanics: `hard_reset.run_hard_reset`.
        """
        run_hard_reset(self, reason, lora_phase)

    # ----------------------------------------------------------------------------------------------------- train
    @quiet_console()  # each warning once (TRL re-raises some at every save and validation), no save progress bars
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval: Any = None, **kwargs: Any) -> TrainOutput:
        """Run every phase (from the checkpoint's phase when resuming), hard-resetting at phase boundaries.

        `resume_from_checkpoint` defaults to `args.resume_from_checkpoint` (a path, or True for the latest complete
        checkpoint). Raises `RunInterrupted` after `request_stop` (a signal under `stop_on_signals`): the current step
        was finished and checkpointed, and resuming from that checkpoint continues exactly.
        """
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        self._bind_callbacks()
        check_optimizer_hook(self.optimizer_cls_and_kwargs, self.phases)
        if self.args.should_save:  # what this run creates in output_dir, recorded first (`--overwrite` deletes it)
            record_outputs(self.args.output_dir, trainer_outputs(self.args, len(self.phases)))
        checkpoint = prepare_resume(self, resume_from_checkpoint)  # runs `on_resume_accepted`
        start = self.current_phase.index if checkpoint else 0
        losses, outputs = [], []
        try:
            for phase in self.phases[start:]:
                if phase.index != start and phase.index < next_phase_after(self.prorl_on_demand_resets):
                    self.announce(f"ProRL phase '{phase.name}' skipped: a reset on demand went past it.")
                    continue
                resumed = checkpoint is not None and phase.index == start
                if resumed and self._resumed_phase_complete:
                    self._restore_finished_phase(checkpoint)
                    phase_steps = self._resumed_phase_step
                else:
                    output, phase_steps = self._train_phase(phase, checkpoint if resumed else None, trial, ignore_keys_for_eval, **kwargs)
                    whole = not resumed or self._resumed_loss_sum is not None  # the loss covers the whole phase
                    losses.append((output.training_loss, phase_steps - (0 if whole else self._resumed_phase_step)))
                    outputs.append(output)
                self._global_step_offset += phase_steps
                planned = phase.max_steps if phase.max_steps > 0 else self.state.max_steps  # epochs: HF's count
                reason = "num_train_epochs" if phase.max_steps < 1 and self._phase_end_reason == "max_steps" else self._phase_end_reason
                phase_done = phase_steps >= planned or self._phase_end_reason != "max_steps"
                if self._stop_requested is not None and not phase_done:
                    stopped = f"stopped by {self._stop_requested} after {phase_steps} of {planned} steps"
                    self.announce(f"ProRL phase '{phase.name}' {stopped}.")
                else:
                    self.announce(f"ProRL phase '{phase.name}' ended after {phase_steps} steps ({reason}).")
                self._save_log_history()
                if self._stop_requested is not None and (not phase_done or phase.index < len(self.phases) - 1):
                    raise RunInterrupted(self._stop_requested, self._stop_checkpoint, self._global_step_offset)
            self._save_final()
        finally:
            self._trackers.end(self.args, self.state, self.control, model=self.model, processing_class=self.processing_class)
        # HF recreates `state.log_history` per inner call; after the run it holds the whole run again.
        self.state.log_history = [dict(entry) for entry in self.prorl_log_history]
        total = sum(n for _, n in losses)
        if len(losses) == 1:  # one phase: TRL's own number, not a re-weighted copy of it
            loss = losses[0][0]
        else:
            loss = sum(l * n for l, n in losses) / total if total else float("nan")
        metrics = dict(outputs[-1].metrics) if outputs else {}
        metrics.update({"prorl/resets": self.prorl_resets, "prorl/global_step": self._global_step_offset})
        return TrainOutput(global_step=self._global_step_offset, training_loss=loss, metrics=metrics)

    def _train_phase(self, phase: ResolvedPhase, checkpoint: Path | None, trial: Any, ignore_keys_for_eval: Any, **kwargs: Any):
        """One inner `GRPOTrainer.train()` call: the phase from its start, or from `checkpoint` (resume)."""
        if checkpoint is None:
            self._enter_phase(phase)
            self._phase_end_reason = "max_steps"
        self._resumed_inner_call = checkpoint is not None
        self._in_training_loop = True
        try:
            output = super().train(
                resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:
            self._in_training_loop = False
        if self._resumed_inner_call and self._resumed_loss_sum is not None:  # the whole phase's loss, as `log` gave it
            loss = output.metrics.get("train_loss", output.training_loss)
            output = TrainOutput(output.global_step, loss, output.metrics)
        return output, self.state.global_step

    def request_stop(self, reason: str = "requested") -> None:
        """Stop after the current optimizer step: write a checkpoint, then `train()` raises `RunInterrupted`.

        Where one generation serves several optimizer steps (`steps_per_generation` above the accumulation steps,
        or `num_iterations` > 1), the stop waits for the end of that generation's steps, so that the checkpoint
        resumes exactly. Safe to call from a signal handler (it only sets a flag). Under several processes, a
        request on any rank stops every rank at the same step.
        """
        self._stop_requested = reason

    @property
    def stop_requested(self) -> str | None:
        """The reason given to `request_stop`, or None."""
        return self._stop_requested

    def at_generation_boundary(self) -> bool:
        """Whether TRL's next micro-batch generates anew: its `_step` counts micro-batches since the phase (or the
        resumed call) began, and it generates every `steps_per_generation * num_iterations` of them. A checkpoint
        is only exact here: the buffer of generated inputs and `_step` are not saved, so a resume from inside a cycle
        generates afresh and then stays out of step with the uninterrupted run."""
        return self._step % (self.args.steps_per_generation * self.num_iterations) == 0

    def _agree_on_stop(self) -> bool:
        """Whether any process asked to stop (a collective: every rank calls it at every step end)."""
        wanted = self._stop_requested is not None
        if self.accelerator.num_processes > 1:
            flag = torch.tensor([1.0 if wanted else 0.0], device=self.accelerator.device)
            wanted = bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)
            if wanted and self._stop_requested is None:
                self._stop_requested = "stop requested on another process"
        return wanted

    def _nonfinite_guard(self) -> NonFiniteGuard | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, NonFiniteGuard)), None)

    def _clip_grad_norm(self, model: Any) -> Any:
        """transformers' clipping, after `NonFiniteGuard` has noted which gradients are not finite: a NaN total norm
        makes every clipped gradient NaN, so the guard's message would otherwise name all of them."""
        guard = self._nonfinite_guard()
        if guard is not None and self.accelerator.distributed_type != "DEEPSPEED":
            guard.before_clipping(self.optimizer)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """transformers' norm of the step; under DeepSpeed `NonFiniteGuard` checks it at every step (the engine has
        applied the update; nothing is counted, logged or saved yet), not only at logging steps."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        guard = self._nonfinite_guard()
        if guard is not None and self.accelerator.distributed_type == "DEEPSPEED":
            engine = self.model_wrapped  # an fp16 overflow the engine's loss scaler skipped landed nothing: no stop
            landed = not hasattr(engine, "was_step_applied") or engine.was_step_applied()
            guard.check_landed_norm(self.args, self.state, grad_norm if landed else None)
        return grad_norm

    @property
    def _stop_checkpoint(self) -> Path:
        return Path(self._get_output_dir(None)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's, after removing the folder's commit record: HF writes into `checkpoint-<step>` in place, and that folder
        may hold a complete save from before a resume (see `reset.checkpoint.uncommit`). Adds the reset probe's rows
        (`reset_probe.save_probe_rows`), before `ProRLStateCallback.on_save` commits the folder."""
        folder = Path(self._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            uncommit(folder)
        # HF prunes to `save_total_limit` at the end of its save, before the commit: a kill there could leave a phase
        # with no complete checkpoint. `ProRLStateCallback.on_save` prunes after the commit instead.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        save_probe_rows(self, folder)  # a reset right after a resume from here probes what it would have (LoRA)

    # ------------------------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log plus the `prorl/*` keys; every entry is also kept in `prorl_log_history` (whole run)."""
        if "train_runtime" in logs:  # HF's end-of-call summary (`_finalize_training`)
            if self._stop_requested is not None and not self._phase_over():
                return  # an interrupted call: the resumed call logs the phase's summary, as the uninterrupted run does
            if self._resumed_inner_call and self._resumed_loss_sum is not None:  # HF: the steps since the resume only
                logs["train_loss"] = self._total_loss_scalar / max(self.state.global_step, 0.001)
        self._add_prorl_keys(logs)
        if self.args.early_stop_importance_ratio is not None and self.model.training:
            logs["prorl/early_stopped_microbatches"] = self._early_stopped
            self._early_stopped = 0
        super().log(logs, start_time)
        self._keep_last_log_entry()

    def _phase_over(self) -> bool:
        """Whether this phase's inner call ends with its last step (or a plateau stop), not on a stop request."""
        return self.state.global_step >= self.state.max_steps or self._phase_end_reason != "max_steps"

    def _phase_loss_sum(self) -> float:
        """The sum of this phase's step losses so far, saved in every checkpoint (`prorl_state.json`).

        HF keeps it in `_total_loss_scalar` (logged steps) plus `_tr_loss` (steps since the last log), zeroes both at
        every `train()` call and divides by that call's steps only, so after a mid-phase resume its `train_loss` would
        average the steps since the resume; `_on_train_begin` puts this sum back instead.
        """
        pending = getattr(self, "_tr_loss", None)
        return getattr(self, "_total_loss_scalar", 0.0) + (float(pending.item()) if pending is not None else 0.0)

    def log_phase_start(self) -> None:
        """One log entry where a phase starts: `prorl/phase_start` (its index) and, after a reset, the merged save's
        folder (`merged_checkpoint`: text, so it stays out of the numeric `prorl/*` keys), so trackers and `prorl_log_history.json` show the boundaries.

        Goes through HF's `Trainer.log`, not TRL's, which would flush TRL's metric buffers and completions table.
        """
        logs: dict[str, Any] = {"prorl/phase_start": self.current_phase.index}
        if self.prorl_merged_path:
            logs["merged_checkpoint"] = self.prorl_merged_path
        self.log_event(logs)

    def log_event(self, logs: dict[str, Any]) -> None:
        """An entry of its own (a phase start, a reset on demand) with the `prorl/*` keys, kept in the run's history."""
        self._add_prorl_keys(logs)
        super(GRPOTrainer, self).log(logs)
        self._keep_last_log_entry()

    def _add_prorl_keys(self, logs: dict[str, Any]) -> None:
        logs["prorl/phase"] = self.current_phase.index
        logs["prorl/resets"] = self.prorl_resets
        logs["prorl/global_step"] = self.prorl_global_step
        if self.prorl_nonfinite_skips:  # only once a step was skipped: a clean run logs exactly as before
            logs["prorl/nonfinite_skips"] = len(self.prorl_nonfinite_skips)

    def _keep_last_log_entry(self) -> None:
        """Keep HF's last entry in the run's history with the run's continuous step as `step` (HF's restarts every
        phase; it is kept as `prorl/phase_step`). No phase name: it is on the console and in the phase table."""
        if self.state.log_history:
            entry = dict(self.state.log_history[-1])
            if "step" in entry:
                entry["prorl/phase_step"] = entry["step"]
                entry["step"] = entry.get("prorl/global_step", entry["step"])
            self.prorl_log_history.append(entry)

    def _get_output_dir(self, trial: Any) -> str:
        """Checkpoints per phase (`<output_dir>/phase-<i>/checkpoint-<step>`): HF's step restarts every phase."""
        return os.path.join(super()._get_output_dir(trial), phase_dir_name(self.current_phase.index))
