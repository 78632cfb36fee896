"""Switching phases: a phase's settings written into the live attributes TRL reads (its `args`, the trainer's own
copies, the reward weights, sampling, the generation buffer), the optimizer carried into the next `train()` call,
and the phase's announcement.

`ProRLTrainer._enter_phase` (a boundary) and `resume.prepare_resume` decide when. TRL 1.16 copies several config
fields onto the trainer at init (`num_generations`, `beta`, `epsilon_low/high`, `reward_weights`), so each is set in
both places.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import reset as reset_ops
from ..config import ResolvedPhase
from ..rollout.vllm_sync import force_weight_sync
from .sampling import SAMPLING_KEYS


def apply_phase(trainer: Any, phase: ResolvedPhase) -> None:
    """Point every phase-dependent setting at `phase` (before its inner `train()` call)."""
    args = trainer.args
    trainer.current_phase = phase
    args.max_steps = phase.max_steps
    args.num_generations = trainer.num_generations = phase.num_generations
    args.generation_batch_size = phase.generation_batch_size
    args.steps_per_generation = phase.generation_batch_size // (args.per_device_train_batch_size * args.world_size)
    args.learning_rate = phase.learning_rate
    args.seed = trainer._base_seed + (phase.index if args.reseed_phases else 0)
    args.beta = trainer.beta = phase.beta
    args.epsilon = trainer.epsilon_low = phase.epsilon
    trainer.epsilon_high = phase.epsilon_high if phase.epsilon_high is not None else phase.epsilon
    # The functions after the user's (the overlong penalty, an environment's `get_reward`) keep weight 1, as in TRL.
    weights = list(phase.reward_weights or [1.0] * trainer._num_user_rewards)
    weights += [1.0] * (len(trainer.reward_funcs) - trainer._num_user_rewards)
    if trainer.overlong_penalty is not None:
        trainer.overlong_penalty.overlong_buffer = phase.overlong_buffer
        trainer.overlong_penalty.factor = phase.overlong_penalty_factor
    trainer.reward_weights = torch.tensor(weights, dtype=torch.float32)
    trainer.apply_sampling(**{key: getattr(phase, key) for key in SAMPLING_KEYS})
    trainer._scheduler_horizon, trainer._scheduler_start = None, 0  # each phase's schedule spans the phase
    # TRL privates: the generation buffer and its micro-step counter belong to the previous dataloader.
    trainer._buffered_inputs = None
    trainer._step = 0
    trainer._resumed_probe_rows = None
    force_weight_sync(trainer)  # HF's global_step restarts at 0: vLLM must get the weights at the first step
    trainer._state_callback.start_phase(phase)
    if trainer.optimizer is not None and phase.index > 0:  # the first phase uses the optimizer (and scheduler) as given
        keep_optimizer_for_next_call(trainer, phase.learning_rate)
    if trainer._engine.deepspeed:
        # HF destroys the DeepSpeed engine at the start of every `train()` call (`accelerator.free_memory()`) but
        # reuses `model_wrapped` when it is already wrapped: hand it the bare model so it builds a new engine.
        trainer.model_wrapped = trainer.model


def keep_optimizer_for_next_call(trainer: Any, learning_rate: float) -> None:
    """Carry the optimizer into the next `train()` call (no reset): unwrap accelerate's wrapper, new phase lr.

    DeepSpeed: HF builds a new engine and optimizer at every `train()` call (`deepspeed_init`), so the ZeRO
    optimizer's fp32 masters and Adam state are snapshotted here and put into the new one in `_on_train_begin`.
    """
    if trainer._engine.deepspeed:
        trainer._zero_carry = reset_ops.snapshot_zero_optimizer(trainer.optimizer)
        trainer.optimizer, trainer.lr_scheduler = None, None
        return
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    for group in inner.param_groups:
        group["lr"] = group["initial_lr"] = learning_rate
    trainer.optimizer = inner
    trainer.lr_scheduler = None


def announce_phase(trainer: Any, phase: ResolvedPhase) -> None:
    """The phase's start on the console and in the log: its length, group size, sampling and adapter shape."""
    length = f"max_steps={phase.max_steps}" if phase.max_steps > 0 else f"num_train_epochs={phase.num_train_epochs:g}"
    settings = ", ".join([length] + [f"{k}={getattr(phase, k)}" for k in ("num_generations",) + SAMPLING_KEYS])
    lora = f", lora r={phase.lora_r} targets={phase.lora_target_modules}" if phase.lora_r is not None else ""
    trainer.announce(
        f"ProRL phase {phase.index + 1}/{len(trainer.phases)} '{phase.name}' from global step "
        f"{trainer._global_step_offset} (resets so far: {trainer.prorl_resets}): {settings}{lora}",
        rule=True,
    )
