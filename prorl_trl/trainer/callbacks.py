"""Callbacks that act on a running `ProRLTrainer`: hard resets inside a phase and sampling schedules.

Convention: `ProRLTrainer` calls `callback.bind(trainer)` on every callback that has a `bind` method, because HF
callbacks only receive the model/optimizer/scheduler, while a reset or a temperature change needs the trainer (its
generation config, fused LM head, reference model, optimizer and LR schedule). The callbacks only decide *when*; the
trainer's `hard_reset` / `request_hard_reset` / `apply_sampling` do the work, so a phase boundary and a callback go
through exactly the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import TrainerCallback


class ProRLTrainerHandle(Protocol):
    """What the callbacks use of the `ProRLTrainer` that binds them (they never import the trainer module)."""

    args: Any

    @property
    def prorl_global_step(self) -> int: ...

    def hard_reset(self, reason: str = "manual", lora_phase: Any = None) -> None: ...

    def request_hard_reset(self, reason: str = "requested") -> None: ...

    def apply_sampling(self, **settings: Any) -> None: ...

    def at_generation_boundary(self) -> bool: ...


@dataclass
class PlateauTracker:
    """Counts evaluations without an improvement of at least `min_delta`; `update` says when `patience` is reached.

    >>> tracker = PlateauTracker(patience=2)
    >>> [tracker.update(v) for v in (0.5, 0.6, 0.6, 0.6)]
    [False, False, False, True]
    """

    patience: int
    min_delta: float = 0.0
    mode: str = "max"
    best: float | None = None
    bad_evaluations: int = 0

    def update(self, value: float) -> bool:
        if value is None:
            return False
        value = float(value)  # a numpy or tensor scalar too: a NaN of those kinds must not become the best
        if math.isnan(value):
            return False
        if self.best is None or self._improves(value):
            self.best = value
            self.bad_evaluations = 0
            return False
        self.bad_evaluations += 1
        return self.patience > 0 and self.bad_evaluations >= self.patience

    def _improves(self, value: float) -> bool:
        """By at least `min_delta`, up to float rounding: one more problem of 100 solved is a gain of 0.01 that
        float subtraction gives as 0.00999... in 20 of the 99 steps from k/100 to (k+1)/100."""
        gain = (value - self.best) if self.mode == "max" else (self.best - value)
        if self.min_delta <= 0:
            return gain > 0
        return gain >= self.min_delta - 1e-9 * max(1.0, abs(self.best))

    def restart_patience(self) -> None:
        """Give the metric `patience` new evaluations (after a reset) while keeping the best value seen."""
        self.bad_evaluations = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_evaluations = state.get("best"), state.get("bad_evaluations", 0)


class _BoundCallback(TrainerCallback):
    trainer: ProRLTrainerHandle | None = None

    def bind(self, trainer: ProRLTrainerHandle) -> None:
        self.trainer = trainer

    def _require_trainer(self) -> ProRLTrainerHandle:
        if self.trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} needs a ProRLTrainer: pass it in `ProRLTrainer(callbacks=[...])` (the trainer "
                "binds its callbacks), or call `callback.bind(trainer)` yourself."
            )
        return self.trainer


@dataclass
class HardResetCallback(_BoundCallback):
    """Hard-reset inside a phase (same adapter shape): every `every_steps` optimizer steps and/or on a plateau.

    Args:
        every_steps: Reset when the continuous ProRL global step is a multiple of this (ProRL v2 used 200-500).
            A step that ends a phase is skipped (the phase boundary decides there).
        on_plateau: Reset when the validation metric `args.plateau_metric` (e.g. `eval_pass@1` from the
            ValidationCallback, or `eval_reward` from TRL's `evaluate()`) has not improved by `min_delta` for
            `patience` evaluations (ProRL v1's trigger). `True` uses `args.plateau_patience`/`plateau_min_delta`;
            an int is the patience. Every hard reset (this callback's, a phase boundary's, one on demand or by
            hand) gives the metric `patience` new evaluations.
        min_delta: Smallest improvement that counts (with an int `on_plateau`).

    The reset itself follows the trainer's switches (`reset_optimizer`, `reset_reference`, `save_merged_on_reset`).
    Plateau resets run at the start of the next step (evaluation happens after `on_step_end`).
    """

    every_steps: int | None = None
    on_plateau: bool | int = False
    min_delta: float | None = None
    tracker: PlateauTracker | None = field(default=None, init=False)

    def __post_init__(self):
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"HardResetCallback(every_steps=...) must be >= 1, got {self.every_steps}.")
        if not self.every_steps and not self.on_plateau:
            raise ValueError("HardResetCallback needs `every_steps=N` and/or `on_plateau=True` (or a patience).")

    def bind(self, trainer: ProRLTrainerHandle) -> None:
        super().bind(trainer)
        if self.on_plateau:
            args = trainer.args
            patience = args.plateau_patience if self.on_plateau is True else int(self.on_plateau)
            if patience < 1:
                raise ValueError(
                    "HardResetCallback(on_plateau=True) uses ProRLConfig.plateau_patience, which is 0; set "
                    "plateau_patience >= 1 or pass the patience directly: HardResetCallback(on_plateau=3)."
                )
            min_delta = args.plateau_min_delta if self.min_delta is None else self.min_delta
            if self.tracker is None:
                self.tracker = PlateauTracker(patience=patience, min_delta=min_delta, mode=args.plateau_mode)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._require_trainer()
        if self.every_steps and trainer.prorl_global_step % self.every_steps == 0 and state.global_step < state.max_steps:
            reason = f"every {self.every_steps} steps"
            if trainer.at_generation_boundary():
                trainer.hard_reset(reason=reason)  # restarts the plateau's patience
            else:  # inside a generation's steps: at the cycle's end (`request_hard_reset`), not on stale log-probs
                trainer.request_hard_reset(reason=reason)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.tracker is None or not logs or args.plateau_metric not in logs:
            return control
        if self.tracker.update(logs[args.plateau_metric]):
            self._require_trainer().request_hard_reset(reason=f"{args.plateau_metric} plateau")
        return control


SamplingSchedule = Callable[[int], dict[str, float]]


class SamplingScheduleCallback(_BoundCallback):
    """Change sampling settings inside a phase, e.g. a temperature ramp, at the steps that generate.

    Where one generation serves several optimizer steps (`steps_per_generation` above the accumulation steps, or
    `num_iterations` > 1), the schedule is read only at the step that generates: the steps after it train on
    completions sampled at that step's settings, and a new temperature there would make the loss's log-probs
    disagree with the ones the completions were sampled (and their old log-probs taken) with.

    Args:
        schedule: `schedule(global_step) -> {"temperature": ..., "top_p": ..., ...}` with the continuous ProRL global
            step; allowed keys: temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length.
            Settings reach generation (transformers or vLLM), the loss's log-prob temperature and the overlong
            penalty exactly like a phase's settings. Return `{}` to leave the phase's settings alone.
        keys: The settings `schedule` may return, if known (`linear` declares its one key). Declared keys are
            checked when the trainer is built: a key that `generation_kwargs` also sets is refused there (TRL
            applies generation_kwargs over it, so generation would never see the schedule). Undeclared keys get the
            same refusal when the schedule first changes them (before anything is applied).

    Example:
        >>> ramp = SamplingScheduleCallback.linear("temperature", start=1.0, end=1.2, num_steps=100)
        >>> ramp.schedule(0), ramp.schedule(50), ramp.schedule(500)
        ({'temperature': 1.0}, {'temperature': 1.1}, {'temperature': 1.2})
    """

    def __init__(self, schedule: SamplingSchedule, keys: tuple[str, ...] | list[str] | None = None):
        if not callable(schedule):
            raise TypeError("SamplingScheduleCallback(schedule) needs a callable: global_step -> dict of settings.")
        self.schedule = schedule
        self.keys = tuple(keys) if keys is not None else None
        self.trainer = None

    @classmethod
    def linear(cls, key: str, start: float, end: float, num_steps: int, start_step: int = 0) -> SamplingScheduleCallback:
        """Linear ramp of one setting from `start` (at `start_step`) to `end` (after `num_steps`), then constant."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}.")

        def schedule(step: int) -> dict[str, float]:
            fraction = min(max((step - start_step) / num_steps, 0.0), 1.0)
            value = start + (end - start) * fraction
            return {key: round(value, 10) if isinstance(value, float) else value}

        return cls(schedule, keys=(key,))

    def on_step_begin(self, args, state, control, **kwargs):
        trainer = self._require_trainer()
        if not trainer.at_generation_boundary():  # this step trains on an earlier step's generation
            return control
        settings = self.schedule(trainer.prorl_global_step)
        if settings:
            trainer.apply_sampling(**settings)
        return control
