"""Stop a run at the first non-finite update, before it corrupts the weights.

A NaN or inf gradient, once the optimizer applies it, turns the adapter's weights to NaN: every later rollout is
garbage (reward at its floor, completions at the cap, entropy NaN) and every later checkpoint holds the broken
weights, while the run goes on for days looking alive. Gradient clipping does not help: the norm of a NaN gradient is
NaN, and so is the clipped gradient.

`NonFiniteGuard` looks at the gradients right before each optimizer step (`on_pre_optimizer_step`, after clipping):
if any is not finite it raises `NonFiniteUpdate` there, so the update is never applied and the latest checkpoint is
the last good state. Every process takes the same decision (the flag is reduced across them), so no rank is left
waiting in a collective. Where the gradients are not visible to callbacks (DeepSpeed keeps them in its own
partitions), the engine's global norm is checked at every step instead (`check_landed_norm`, from
`ProRLTrainer._get_grad_norm`; the logged `grad_norm` where that is not called), before the step is saved: that
update was applied, and the message says so. Skipping the step instead would not restore anything: Adam's moments
already hold the non-finite values.

The message says where: how many of the gradients are not finite, and the first names (all of them: the loss itself
was not finite; a few: one layer's computation), so a run that stops tells what to look at next. It suggests
`kl_clamp` only where the KL term is on and unbounded: round 3 of the prolonged study stopped 6 of 24 runs with it
on (benchmarks/results/prolonged_runs/round3.md); their cause was cuDNN's attention backward, which
`prorl_trl.attention` now guards against. Before the update is refused, the step's batches and
weights are written for a replay (`replay.py`), since the next attempt samples other rollouts.

A run of days needs to go on without a person: with `max_nonfinite_skips: N` the guard skips up to N such steps per
run (the gradients are dropped before the optimizer sees them, so the weights and Adam's moments stay exactly as
after the previous step; the LR schedule moves on), logs each one (`prorl/nonfinite_skips`, a warning, the run
summary), keeps its batches for a replay, and stops as above at the next one. Skipping beats rolling back to the last
checkpoint: the update never landed, so there is nothing to undo, and a rollback would redraw the same rollouts (a
resume is exact), the same NaN with them. Many skips mean a cause that does not go away (a learning rate too high),
which only a person can fix: hence the bound. Under DeepSpeed the update lands before the check, so skipping is
refused there (`checks.check_launch`).

Under fp16 mixed precision a loss scaler runs: gradients that overflow at its scale are routine, and the scaler itself
skips those steps (the update never lands, the LR schedule waits) and lowers the scale. The guard leaves them to it
and acts only once the scale is down to 1 (`scaler_takes_the_step`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..console import announce
from .replay import write_nonfinite_dump

logger = logging.getLogger("prorl_trl")


class NonFiniteUpdate(RuntimeError):
    """Training stopped at `global_step` because its gradients were not finite; `applied` tells whether that update
    reached the weights (False: the weights are as after the previous step). `checkpoint`: the latest checkpoint
    written before it, or None."""

    def __init__(
        self,
        global_step: int,
        norm: float,
        applied: bool,
        checkpoint: Path | None,
        phase: str | None,
        where: tuple[list[str], int] | None = None,
        unbounded_kl: bool = True,
        dump: Path | None = None,
        skipped: list[dict[str, Any]] | None = None,
    ):
        self.global_step, self.norm, self.applied, self.checkpoint = global_step, norm, applied, checkpoint
        self.nonfinite_names, self.gradients = where if where is not None else ([], 0)
        self.dump = dump
        step = f"global step {global_step}" + (f" (phase {phase!r})" if phase else "")
        names = self.nonfinite_names
        located = (
            f" It is not finite in {len(names)} of this process's {self.gradients} gradients ("
            + (
                "all: the loss itself was not finite"
                if len(names) == self.gradients
                else "only these: one part of the model"
            )
            + f"), first {', '.join(names[:3])}."
            if names
            else ""
        )
        kl = (
            "TRL's KL term overflowing on one token (set `kl_clamp: true`, verl's bounded term), "
            if unbounded_kl
            else ""
        )
        kept = (
            f" This step's batches (and, unless sharded, its weights) are in {dump}/: "
            "`prorl_trl.trainer.replay.replay_nonfinite` replays them and names the operation that made the NaN."
            if dump is not None
            else ""
        )
        state = (
            "That update was applied (DeepSpeed keeps its gradients out of reach until the step): the weights in "
            "memory are corrupt"
            if applied
            else "The update was not applied"
        )
        saved = (
            f"The latest checkpoint, {checkpoint}/, was written before it and is good."
            if checkpoint is not None
            else "No checkpoint was written before it."
        )
        earlier = (
            f" It is non-finite step {len(skipped) + 1} of this run: max_nonfinite_skips={len(skipped)} skipped the "
            f"earlier ones (global steps {', '.join(str(event['step']) for event in skipped)}), and a cause that "
            "comes back is not chance."
            if skipped
            else ""
        )
        super().__init__(
            f"Training stopped at {step}: the gradient norm is {norm} (not finite).{located}{earlier} {state}; "
            "nothing more "
            f"was saved. {saved}{kept} Usual causes: {kl}a learning rate too high for this model and dtype (bf16 "
            "activations overflowing), or a reward that returned NaN/inf. Change the setting (a resume needs "
            "`--allow-changes` for that) or fix the reward, then resume; `stop_on_nonfinite: false` turns this check "
            "off."
        )


def local_gradients(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(parameter, gradient)` for each of the optimizer's parameters that has one, the gradient as this process
    holds it (a DTensor's local shard)."""
    return [
        (parameter, grad.to_local() if hasattr(grad, "to_local") else grad)
        for group in getattr(optimizer, "param_groups", [])
        for parameter in group["params"]
        if (grad := parameter.grad) is not None
    ]


def local_gradient_norm(optimizer: Any) -> float:
    """The 2-norm of this process's share of the optimizer's gradients (a DTensor's local shard), 0.0 when it holds
    none; NaN or inf when any element is."""
    grads = [grad for _, grad in local_gradients(optimizer)]
    if not grads:
        return 0.0
    wide = [grad for grad in grads if grad.dtype != torch.float16]  # float16 norms overflow: summed in float32
    norms = [norm.float() for norm in torch._foreach_norm(wide)] if wide else []
    norms += [torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads if grad.dtype == torch.float16]
    return float(torch.linalg.vector_norm(torch.stack([norm.to(norms[0].device) for norm in norms])).item())


def nonfinite_flags(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(parameter, flag)` for each local gradient, the flag a device tensor, True where it holds a NaN or inf. Taken
    before clipping and read only when the step is not finite (no host sync on a good step): clipping by a NaN total
    norm multiplies every gradient by NaN, so after it all of them look broken and the message would lose where."""
    return [(parameter, ~torch.isfinite(grad).all()) for parameter, grad in local_gradients(optimizer)]


def nonfinite_gradients(
    model: Any, optimizer: Any, flags: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> tuple[list[str], int]:
    """The names (as `model.named_parameters()` gives them) of the optimizer's parameters whose local gradient holds a
    NaN or inf, and how many gradients there are; from `flags` (`nonfinite_flags` before clipping) where given."""
    names = {id(parameter): name for name, parameter in model.named_parameters()} if model is not None else {}
    if flags is None:
        flags = nonfinite_flags(optimizer)
    bad = [names.get(id(parameter), f"parameter {tuple(parameter.shape)}") for parameter, flag in flags if bool(flag)]
    return bad, len(flags)


def scaler_takes_the_step(scaler: Any) -> bool:
    """Whether fp16 loss scaling, not the guard, answers a non-finite step: an overflow of the scaled gradients is
    routine there (the scaler skips that step and halves its scale), so the guard acts only once the scale is down to
    1 or below, where the gradients are not finite unscaled either (from 65,536, 16 overflows in a row)."""
    return scaler is not None and scaler.is_enabled() and float(scaler.get_scale()) > 1.0


def agreed_nonfinite(value: float, device: torch.device) -> bool:
    """Whether `value` is not finite on any process (MAX-reduced where a process group runs; FSDP2 ranks hold
    different shards, so they must agree before one of them stops)."""
    bad = not math.isfinite(value)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item() > 0)
    return bad


class NonFiniteGuard(TrainerCallback):
    """Raise `NonFiniteUpdate` before an optimizer step whose gradients are not finite (see the module docstring).

    Added by `ProRLTrainer` when `stop_on_nonfinite` is on; usable with any `transformers.Trainer` (call `bind`
    with it to name its output folder's latest checkpoint in the message).
    """

    def __init__(self):
        self.trainer: Any = None
        self._checked_before_step = False  # the gradients were visible: the logged norm needs no second look
        self._flags_before_clipping: list | None = None  # `before_clipping`'s, for this step's message
        self._checked_landed = False  # `check_landed_norm` saw every step's norm: the logged one needs no look

    def before_clipping(self, optimizer: Any) -> None:
        """Note which gradients are not finite before clipping spreads a NaN norm to all of them (`ProRLTrainer` calls
        it from `_clip_grad_norm`; without it the message names the gradients as they are after clipping)."""
        self._flags_before_clipping = nonfinite_flags(optimizer)

    def bind(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        optimizer = optimizer if optimizer is not None else getattr(self.trainer, "optimizer", None)
        if getattr(getattr(self.trainer, "accelerator", None), "distributed_type", None) == "DEEPSPEED":
            return  # DeepSpeed holds the gradients in its partitions: `on_log` checks its norm
        norm = local_gradient_norm(optimizer)
        self._checked_before_step = True
        flags, self._flags_before_clipping = self._flags_before_clipping, None
        accelerator = getattr(self.trainer, "accelerator", None)
        device = getattr(accelerator, "device", torch.device("cpu"))
        if agreed_nonfinite(norm, device):
            if scaler_takes_the_step(getattr(accelerator, "scaler", None)):
                logger.info("fp16 loss scaling: non-finite scaled gradients at scale %s; the scaler skips this step "
                            "and lowers its scale.", accelerator.scaler.get_scale())  # fmt: skip
                return
            where = nonfinite_gradients(kwargs.get("model") or getattr(self.trainer, "model", None), optimizer, flags)
            skipped = getattr(self.trainer, "prorl_nonfinite_skips", None)
            if skipped is not None and len(skipped) < getattr(args, "max_nonfinite_skips", 0):
                self._skip(state, norm, args, where, optimizer, skipped)
                return
            raise self._error(state, norm, applied=False, args=args, where=where, keep=True)

    def _skip(self, state, norm: float, args, where: tuple[list[str], int], optimizer: Any, skipped: list) -> None:
        """Drop this step's gradients (every rank: the decision was agreed) and record the skip."""
        for parameter, _ in local_gradients(optimizer):
            parameter.grad = None  # the optimizer skips a parameter without a gradient: no update, no moment change
        step, phase = self._step_and_phase(state, applied=False)
        dump = self._keep(step, phase, where)
        event = {"step": step, "phase": phase, "grad_norm": str(norm), "nonfinite_gradients": len(where[0]),
                 "gradients": where[1], "kept": str(dump.relative_to(args.output_dir)) if dump else None}  # fmt: skip
        skipped.append(event)
        message = (
            f"Skipped global step {step}{f' (phase {phase!r})' if phase else ''}: its gradients are not finite (norm "
            f"{norm}; {len(where[0])} of {where[1]} gradients), so the update was dropped and the weights and "
            f"optimizer state are those of the step before. Skip {len(skipped)} of "
            f"max_nonfinite_skips={args.max_nonfinite_skips}"
            + (f"; its batches are in {dump}/ for a replay." if dump else ".")
        )
        logger.warning(message)
        if getattr(getattr(self.trainer, "accelerator", None), "is_main_process", True):
            announce(message)

    def on_log(self, args, state, control, logs=None, **kwargs):
        norm = (logs or {}).get("grad_norm")
        if self._checked_before_step or self._checked_landed or norm is None:
            return
        if not math.isfinite(float(norm)):
            raise self._error(state, float(norm), applied=True, args=args)

    def check_landed_norm(self, args, state, norm: Any) -> None:
        """DeepSpeed's path at every optimizer step: its engine has applied the update and reports the global norm
        (the same on every rank), before the step is counted, logged or saved. A non-finite norm stops the run there,
        so no checkpoint is written from the broken weights; `on_log` alone would see it only at a logging step."""
        if norm is None:
            return
        value = float(norm.item() if hasattr(norm, "item") else norm)
        self._checked_landed = True
        if not math.isfinite(value):
            raise self._error(state, value, applied=True, args=args, counted=False)

    def _step_and_phase(self, state, applied: bool, counted: bool | None = None) -> tuple[int, str | None]:
        """The step being taken (before the update) or just taken (`applied`), counted over the whole run where the
        trainer counts across phases, and its phase's name. `counted`: whether the trainer's step counter includes
        that step already (by default, where it was applied)."""
        counted = applied if counted is None else counted
        step = getattr(self.trainer, "prorl_global_step", state.global_step) + (0 if counted else 1)
        return step, getattr(getattr(self.trainer, "current_phase", None), "name", None)

    def _keep(self, step: int, phase: str | None, where) -> Path | None:
        """The step's batches written for a replay, or None; a failed write (disk full, odd inputs) only loses the
        record, never the stop or the skip."""
        try:
            return write_nonfinite_dump(self.trainer, step, phase, where[0] if where else [])
        except Exception as error:  # noqa: BLE001
            logger.warning("Could not keep the non-finite step's batches for a replay: %s", error)
            return None

    def _error(
        self, state, norm: float, applied: bool, args, where=None, keep: bool = False, counted: bool | None = None
    ) -> NonFiniteUpdate:
        """The error for the step being taken (before the update) or just taken (`applied`)."""
        from ..reset.checkpoint import latest_checkpoint

        checkpoint = latest_checkpoint(args.output_dir) if args.output_dir else None
        step, phase = self._step_and_phase(state, applied, counted)
        unbounded_kl = getattr(args, "beta", 0.0) > 0 and not getattr(args, "kl_clamp", False)
        dump = self._keep(step, phase, where) if keep else None
        skipped = getattr(self.trainer, "prorl_nonfinite_skips", None)
        return NonFiniteUpdate(step, norm, applied, checkpoint, phase, where, unbounded_kl, dump, skipped)
