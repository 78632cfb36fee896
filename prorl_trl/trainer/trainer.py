"""`ProRLTrainer`: TRL's `GRPOTrainer` run as a sequence of phases with hard resets (ProRL, arXiv 2505.24864).

How it fits TRL 1.16 (see ../shared/notes/trl-internals.md):
* A phase is one inner `GRPOTrainer.train()` call: TRL fixes the group size, the generation batch and the sampler
  seed when it builds the dataloader (once per `train()`), so those, and a LoRA shape change, only move between calls.
* Sampling settings are pushed into the objects TRL baked them into at init (`generation_config`,
  `generation_kwargs`, `vllm_generation`, and the fused LM head's temperature) by `apply_sampling`, which phases and
  `SamplingScheduleCallback` share.
* A hard reset (`hard_reset`) merges the LoRA delta into the base in place, re-initialises the adapter, clears the
  optimizer state and moves the KL reference, without ever replacing the PeftModel (`prorl_trl.reset`).

TRL methods overridden, and why (each relies on the private attribute named; guard tests in
tests/test_trainer_internals.py). Resets/resume live in `trainer_reset.py`, loop overrides in `trainer_parts.py`:
* `train`: runs the phases; the HF loop itself is untouched.
* `log`: adds `prorl/*` keys and keeps `prorl_log_history` across phases (HF recreates `state.log_history` per call).
* `_get_output_dir`: checkpoints go to `<output_dir>/phase-<i>/` because HF names them by the per-call step.
* `create_scheduler` (trainer_reset.py): keeps the LR-schedule horizon of an in-loop reset across a resume.
* `_calculate_rewards` / `_generate_and_score_completions`: dynamic sampling (no hook exists in TRL).
* `_compute_loss` / `_get_per_token_logps_and_entropies`: minibatch early stop needs the policy log-probs TRL
  computes inside the loss and does not return.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import TrainOutput
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

import rewards
from prorl_trl import reset as reset_ops
from prorl_trl.callbacks import HardResetCallback
from prorl_trl.config import ProRLConfig, ResolvedPhase, resolve_phases
from prorl_trl.generation import configure_trainer_generation
from prorl_trl.overlong import OverlongPenalty
from prorl_trl.resume import phase_dir_name
from prorl_trl.trainer_parts import ProRLLoopMixin, ProRLStateCallback
from prorl_trl.trainer_reset import ProRLResetMixin
from prorl_trl.vllm_sync import (
    VLLM_SAMPLING_ATTRIBUTES,
    apply_vllm_sampling,
    force_weight_sync,
    shadowed_by_generation_kwargs,
)

logger = logging.getLogger("prorl_trl")

# The settings a phase or a schedule may change mid-run: the attributes TRL reads at every generation (both backends).
SAMPLING_KEYS = VLLM_SAMPLING_ATTRIBUTES
# GenerationConfig / generation_kwargs spell one of them differently.
_GENERATION_CONFIG_NAMES = {"max_completion_length": "max_new_tokens"}


class ProRLTrainer(ProRLResetMixin, ProRLLoopMixin, GRPOTrainer):
    """`GRPOTrainer` with ProRL phases, hard resets, a phase-aware overlong penalty, dynamic sampling and early stop.

    Takes exactly `GRPOTrainer`'s arguments; `args` must be a [`ProRLConfig`]. Extra state, all readable:
    `phases` (resolved), `current_phase`, `prorl_global_step` (continuous across phases), `prorl_resets`,
    `prorl_log_history` (every log entry of the run, also saved to `<output_dir>/prorl_log_history.json`),
    `overlong_penalty` (the appended reward, or None), `sampling` (the settings in force).
    """

    _tag_names = ["trl", "grpo", "prorl"]
    _name = "ProRL"

    def __init__(self, model: Any, reward_funcs: Any = None, args: ProRLConfig | None = None, **kwargs: Any):
        if not isinstance(args, ProRLConfig):
            raise TypeError(
                f"ProRLTrainer needs `args=ProRLConfig(...)`, got {type(args).__name__}. ProRLConfig accepts every "
                "GRPOConfig field plus phases/reset/overlong/dynamic-sampling options."
            )
        args = copy.copy(args)  # phases rewrite max_steps, seed, num_generations, ...: keep the caller's object intact
        peft_config = kwargs.get("peft_config")
        self.phases: list[ResolvedPhase] = resolve_phases(args, peft_config, world_size=args.world_size)
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
        self._num_user_rewards = len(reward_funcs)
        self._check_before_init(args, model, peft_config, reward_funcs, list(kwargs.get("callbacks") or []))
        dataset_columns = getattr(kwargs.get("train_dataset"), "column_names", None)
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
            processing = kwargs.get("reward_processing_classes")
            if isinstance(processing, list):
                kwargs["reward_processing_classes"] = processing + [None]

        self._base_seed = args.seed
        self.current_phase: ResolvedPhase = self.phases[0]
        self.prorl_resets = 0
        self.prorl_log_history: list[dict[str, Any]] = []
        self.prorl_merged_path: str | None = None
        self._global_step_offset = 0
        self._in_training_loop = False
        self._pending_reset: str | None = None
        self._early_stopped = 0
        self._fused_forward_at_init: dict[int, Any] = {}
        self._phase_end_reason = "max_steps"
        self._scheduler_horizon: int | None = None
        self._compiled_generation = False

        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)

        self._check_after_init()
        self.sampling: dict[str, Any] = {key: getattr(self, key) for key in SAMPLING_KEYS}
        self._state_callback = ProRLStateCallback(self)
        self.add_callback(self._state_callback)
        self._bind_callbacks()

    # ----------------------------------------------------------------------------------------------- validation
    def _check_before_init(self, args: ProRLConfig, model: Any, peft_config: Any, reward_funcs: list, callbacks: list) -> None:
        """Fail before any model is loaded for settings TRL would reject later or that a reset would break."""
        is_peft = peft_config is not None or hasattr(model, "peft_config")
        base_beta_zero = args.beta == 0.0
        for phase in self.phases:
            if (phase.beta == 0.0) != base_beta_zero:
                raise ValueError(
                    f"ProRLConfig phase {phase.index} ({phase.name}): beta={phase.beta} but the run starts with "
                    f"beta={args.beta}. TRL creates the reference model only when beta != 0 at init, so beta can change "
                    "between non-zero values but not to/from 0. Give the base config a non-zero beta."
                )
            if phase.reward_weights is not None and len(phase.reward_weights) != len(reward_funcs):
                raise ValueError(
                    f"ProRLConfig phase {phase.index} ({phase.name}): reward_weights has {len(phase.reward_weights)} "
                    f"entries for {len(reward_funcs)} reward functions (the overlong penalty is added separately)."
                )
        scheduled = shadowed_by_generation_kwargs(args.generation_kwargs, SAMPLING_KEYS)
        if scheduled:
            raise ValueError(
                f"generation_kwargs sets {scheduled}, which TRL applies after (and over) the phase settings. Set them "
                "as ProRLConfig / PhaseConfig fields instead (e.g. `temperature: 1.2`)."
            )
        if is_peft and args.beta != 0.0 and not args.reset_reference and self._resets_possible(callbacks):
            raise ValueError(
                "reset_reference=False with LoRA and beta > 0 is not supported: TRL's reference is the adapter-disabled "
                "base, and a hard reset merges the adapter into that base, so the reference moves with it. Either keep "
                "reset_reference=True (ProRL v1/v2 both reset the reference), use full fine-tuning (a separate "
                "reference model is kept), or disable hard resets."
            )
        longest = max(phase.max_completion_length for phase in self.phases)
        if args.use_vllm and args.vllm_max_model_length is not None and longest >= args.vllm_max_model_length:
            raise ValueError(
                f"A phase generates up to {longest} tokens but vllm_max_model_length={args.vllm_max_model_length} is "
                "fixed when vLLM starts; set vllm_max_model_length above the longest phase's prompt + completion."
            )
        if args.early_stop_importance_ratio is not None and args.early_stop_importance_ratio <= 0:
            raise ValueError(f"early_stop_importance_ratio must be > 0 (RLinf uses 5.0), got {args.early_stop_importance_ratio}.")
        if args.dynamic_sampling:
            world = args.world_size
            for phase in self.phases:
                local_rows = phase.generation_batch_size // world
                if local_rows % phase.num_generations:
                    raise ValueError(
                        f"dynamic_sampling needs whole groups on each process: phase {phase.index} ({phase.name}) has "
                        f"{local_rows} completions per process per generation batch, not a multiple of num_generations "
                        f"{phase.num_generations}. Make generation_batch_size / processes a multiple of num_generations."
                    )
            if not reward_funcs:
                raise ValueError("dynamic_sampling needs a correctness reward function; none was given.")

    def _resets_possible(self, callbacks: Any = None) -> bool:
        """Whether this run can hard-reset: a resetting phase boundary, a LoRA shape change, or a HardResetCallback."""
        shapes = [p.lora_shape for p in self.phases]
        reshapes = any(p.lora_r is not None and p.lora_shape != q for p, q in zip(self.phases[1:], shapes))
        callbacks = callbacks if callbacks is not None else self.callback_handler.callbacks
        return any(p.hard_reset for p in self.phases) or reshapes or any(isinstance(c, HardResetCallback) for c in callbacks)

    def _check_after_init(self) -> None:
        self._reset_support_checked = self._resets_possible()
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

    # ------------------------------------------------------------------------------------------------- sampling
    def apply_sampling(self, **settings: Any) -> None:
        """Make sampling settings reach generation (transformers or vLLM), the loss and the overlong penalty.

        Relies on TRL 1.16 privates: `generation_config` + `generation_kwargs` (transformers path) or
        `vllm_generation.<attr>` (vLLM), both read at every generation; the temperature is also baked into the fused
        LM head at init, so the policy (and reference) heads are re-patched.
        """
        unknown = sorted(set(settings) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"Unknown sampling settings {unknown}; allowed: {list(SAMPLING_KEYS)}.")
        changed = {k: v for k, v in settings.items() if getattr(self, k) != v}
        for key, value in changed.items():
            setattr(self, key, value)
            setattr(self.args, key, value)
            if self.use_vllm:
                apply_vllm_sampling(self.vllm_generation, **{key: value})
            else:
                name = _GENERATION_CONFIG_NAMES.get(key, key)
                setattr(self.generation_config, name, value)
                self.generation_kwargs[name] = value
        if "temperature" in changed:
            self._patch_fused_heads(changed["temperature"])
        if self.overlong_penalty is not None:
            self.overlong_penalty.max_completion_length = self.max_completion_length
        if self.args.compiled_generation and ("max_completion_length" in changed or not self._compiled_generation):
            # The static cache is sized from the cap, so it follows every cap change (one compilation per shape).
            self._compiled_generation = configure_trainer_generation(
                self, max_prompt_length=self.args.generation_max_prompt_length
            )
        self.sampling = {key: getattr(self, key) for key in SAMPLING_KEYS}

    def _patch_fused_heads(self, temperature: float) -> None:
        """Re-apply TRL's fused log-prob head with `temperature` (it is a closure constant set in `__init__`).

        The wrapper TRL installed at init is restored first, so repeated changes never stack more than one layer.
        """
        policy = reset_ops.unwrap_model(self.model)
        targets = [(policy.get_base_model() if hasattr(policy, "get_base_model") else policy, ("log_probs", "entropy"))]
        if self.ref_model is not None:
            targets.append((reset_ops.unwrap_model(self.ref_model), ("log_probs",)))
        for module, outputs in targets:
            module.forward = self._fused_forward_at_init.setdefault(id(module), module.forward)
            add_fused_lm_head(
                module, temperature=temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32, outputs=outputs
            )

    # ---------------------------------------------------------------------------------------------------- phases
    @property
    def prorl_global_step(self) -> int:
        """Optimizer steps since the start of the run, continuous across phases (HF's restarts per phase)."""
        return self._global_step_offset + (self.state.global_step if self._in_training_loop else 0)

    def _apply_phase(self, phase: ResolvedPhase) -> None:
        """Point every phase-dependent setting at `phase` (before its inner `train()` call)."""
        args = self.args
        self.current_phase = phase
        args.max_steps = phase.max_steps
        args.num_generations = self.num_generations = phase.num_generations
        args.generation_batch_size = phase.generation_batch_size
        args.steps_per_generation = phase.generation_batch_size // (args.per_device_train_batch_size * args.world_size)
        args.learning_rate = phase.learning_rate
        args.seed = self._base_seed + (phase.index if args.reseed_phases else 0)
        args.beta = self.beta = phase.beta
        args.epsilon = self.epsilon_low = phase.epsilon
        self.epsilon_high = phase.epsilon_high if phase.epsilon_high is not None else phase.epsilon
        weights = list(phase.reward_weights or [1.0] * self._num_user_rewards)
        if self.overlong_penalty is not None:
            weights.append(1.0)
            self.overlong_penalty.overlong_buffer = phase.overlong_buffer
            self.overlong_penalty.factor = phase.overlong_penalty_factor
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.apply_sampling(**{key: getattr(phase, key) for key in SAMPLING_KEYS})
        self._scheduler_horizon = None  # each phase's schedule spans the phase (see `create_scheduler`)
        # TRL privates: the generation buffer and its micro-step counter belong to the previous dataloader.
        self._buffered_inputs = None
        self._step = 0
        force_weight_sync(self)  # HF's global_step restarts at 0: vLLM must get the weights at the first step
        self._state_callback.start_phase(phase)
        if self.optimizer is not None:
            self._keep_optimizer_for_next_call(phase.learning_rate)

    def _keep_optimizer_for_next_call(self, learning_rate: float) -> None:
        """Carry the optimizer into the next `train()` call (no reset): unwrap accelerate's wrapper, new phase lr."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        for group in inner.param_groups:
            group["lr"] = group["initial_lr"] = learning_rate
        self.optimizer = inner
        self.lr_scheduler = None

    def _adapter_differs(self, phase: ResolvedPhase) -> bool:
        """Whether `phase` asks for another adapter than the live one (rank, wrapped modules or alpha).

        Compares wrapped modules, not spellings: PEFT rewrites `target_modules="all-linear"` into module names.
        An alpha change alone keeps the Parameters but rescales the delta, so it too needs a merge first.
        """
        model = reset_ops.unwrap_model(self.model)
        if phase.lora_r is None or not hasattr(model, "peft_config"):
            return False
        if reset_ops.adapter_needs_rebuild(model, r=phase.lora_r, target_modules=phase.lora_target_modules):
            return True
        return phase.lora_alpha is not None and phase.lora_alpha != model.peft_config["default"].lora_alpha

    def _enter_phase(self, phase: ResolvedPhase) -> None:
        """Phase boundary: hard reset (or the adapter reshape a LoRA change forces), then the phase's settings."""
        reshape = self._adapter_differs(phase)
        if phase.index > 0 and (phase.hard_reset or reshape or self._pending_reset):
            if not phase.hard_reset:
                reason = self._pending_reset or "LoRA shape change"
                logger.warning("Phase %s: %s forces a hard reset (merge + fresh adapter).", phase.name, reason)
            self.hard_reset(reason=f"start of phase {phase.index} ({phase.name})", lora_phase=phase)
        elif reshape:  # first phase with another shape than peft_config: nothing to merge yet
            self._reinit_adapter(phase)
        self._pending_reset = None
        self._apply_phase(phase)
        self._announce_phase(phase)

    def _announce_phase(self, phase: ResolvedPhase) -> None:
        settings = ", ".join(f"{k}={getattr(phase, k)}" for k in ("max_steps", "num_generations") + SAMPLING_KEYS)
        lora = f", lora r={phase.lora_r} targets={phase.lora_target_modules}" if phase.lora_r is not None else ""
        self.announce(
            f"ProRL phase {phase.index + 1}/{len(self.phases)} '{phase.name}' from global step "
            f"{self._global_step_offset} (resets so far: {self.prorl_resets}): {settings}{lora}",
            rule=True,
        )

    def announce(self, message: str, rule: bool = False) -> None:
        """Phase changes and resets, on the console (rich, main process only) and in the `prorl_trl` logger."""
        logger.info(message)
        if not self.accelerator.is_main_process:
            return
        from rich.console import Console

        console = Console(stderr=True)
        console.rule(f"[bold]{message}", align="left") if rule else console.print(f"[bold]{message}")

    # ----------------------------------------------------------------------------------------------------- train
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval: Any = None, **kwargs: Any) -> TrainOutput:
        """Run every phase (from the checkpoint's phase when resuming), hard-resetting at phase boundaries."""
        self._bind_callbacks()
        checkpoint = self._prepare_resume(resume_from_checkpoint)
        start = self.current_phase.index if checkpoint else 0
        losses, outputs = [], []
        for phase in self.phases[start:]:
            resumed = checkpoint is not None and phase.index == start
            if not resumed:
                self._enter_phase(phase)
            self._phase_end_reason = "max_steps"
            self._in_training_loop = True
            try:
                output = super().train(
                    resume_from_checkpoint=str(checkpoint) if resumed else None,
                    trial=trial,
                    ignore_keys_for_eval=ignore_keys_for_eval,
                    **kwargs,
                )
            finally:
                self._in_training_loop = False
            steps = self.state.global_step - (self._resumed_phase_step if resumed else 0)
            losses.append((output.training_loss, max(steps, 0)))
            outputs.append(output)
            self._global_step_offset += self.state.global_step
            self.announce(f"ProRL phase '{phase.name}' ended after {self.state.global_step} steps ({self._phase_end_reason}).")
            self._save_log_history()
        self._save_final()
        # HF recreates `state.log_history` per inner call; after the run it holds the whole run again.
        self.state.log_history = [dict(entry) for entry in self.prorl_log_history]
        total = sum(n for _, n in losses)
        loss = sum(l * n for l, n in losses) / total if total else float("nan")
        metrics = dict(outputs[-1].metrics) if outputs else {}
        metrics.update({"prorl/resets": self.prorl_resets, "prorl/global_step": self._global_step_offset})
        return TrainOutput(global_step=self._global_step_offset, training_loss=loss, metrics=metrics)

    # ------------------------------------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log plus the `prorl/*` keys; every entry is also kept in `prorl_log_history` (whole run)."""
        logs["prorl/phase"] = self.current_phase.index
        logs["prorl/resets"] = self.prorl_resets
        logs["prorl/global_step"] = self.prorl_global_step
        if self.args.early_stop_importance_ratio is not None and self.model.training:
            logs["prorl/early_stopped"] = self._early_stopped
            self._early_stopped = 0
        super().log(logs, start_time)
        if self.state.log_history:
            entry = dict(self.state.log_history[-1])
            entry["prorl/phase_name"] = self.current_phase.name
            self.prorl_log_history.append(entry)

    def _get_output_dir(self, trial: Any) -> str:
        """Checkpoints per phase (`<output_dir>/phase-<i>/checkpoint-<step>`): HF's step restarts every phase."""
        return os.path.join(super()._get_output_dir(trial), phase_dir_name(self.current_phase.index))
