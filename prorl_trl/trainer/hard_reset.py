"""A hard reset on a live trainer: which `prorl_trl.reset` mechanics run in which order, and the trainer state they
update (adapter shape, reset counter, optimizer and LR schedule, saved deltas, the probe's log keys).

`ProRLTrainer` decides *when* (a phase boundary, a request, a callback); `ProRLTrainer.hard_reset` calls
`run_hard_reset`. The mechanics on tensors (merge, freeze, fresh adapter, broadcast) are `prorl_trl.reset`'s; here
they are applied to the trainer's model, engine, optimizer and counters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .. import reset as reset_ops
from ..config import ResolvedPhase
from ..reset.provenance import file_hashes
from ..rollout.vllm_sync import force_weight_sync
from .callbacks import HardResetCallback
from .reset_probe import ResetProbe
from .saves import save_frozen_factors, save_merged

logger = logging.getLogger("prorl_trl")


def adapter_differs(trainer: Any, phase: ResolvedPhase) -> bool:
    """Whether `phase` asks for another adapter than the live one (rank, wrapped modules or alpha).

    Compares wrapped modules, not spellings: PEFT rewrites `target_modules="all-linear"` into module names.
    An alpha change alone keeps the Parameters but rescales the delta, so it too needs a merge first.
    """
    model = reset_ops.unwrap_model(trainer.model)
    if phase.lora_r is None or not hasattr(model, "peft_config"):
        return False
    if trainer._superset is not None:  # sharded engine: compare with the live part of the superset adapter
        return trainer._active_lora is None or trainer._active_lora != superset_shape(trainer, phase)
    if reset_ops.adapter_needs_rebuild(model, r=phase.lora_r, target_modules=phase.lora_target_modules):
        return True
    return phase.lora_alpha is not None and phase.lora_alpha != model.peft_config["default"].lora_alpha


def superset_shape(trainer: Any, phase: ResolvedPhase) -> dict[str, Any]:
    """`phase`'s adapter as the active part of the superset adapter: rank, alpha and wrapped module names."""
    model = reset_ops.unwrap_model(trainer.model)
    alpha = phase.lora_alpha if phase.lora_alpha is not None else trainer._superset.lora_alpha
    return {
        "r": phase.lora_r,
        "lora_alpha": alpha,
        "target_names": reset_ops.targeted_module_names(model, phase.lora_target_modules),
    }


def fresh_adapter(trainer: Any, phase: ResolvedPhase) -> bool:
    """A fresh adapter of `phase`'s shape, identical on every rank; True when its Parameters are new objects.

    Under FSDP2/ZeRO the existing (sharded) Parameters are rewritten, never replaced: a shape change activates
    another part of the superset adapter (`prorl_trl.reset.sharded`).
    """
    if trainer._engine.sharded:
        shape = superset_shape(trainer, phase) if trainer._superset is not None else {}
        trainer._active_lora = reset_ops.fresh_adapter_sharded(
            trainer.model,
            trainer._engine.kind,
            seed=reset_seed(trainer),
            rank=shape.get("r"),
            lora_alpha=shape.get("lora_alpha", phase.lora_alpha),
            target_names=shape.get("target_names"),
        )
        return False
    new_params = reset_ops.reinit_adapter(
        trainer.model,
        r=phase.lora_r,
        lora_alpha=phase.lora_alpha,
        target_modules=phase.lora_target_modules,
        seed=reset_seed(trainer),
    )
    reset_ops.broadcast_adapter(trainer.model)
    return new_params


def reinit_adapter(trainer: Any, phase: ResolvedPhase) -> None:
    """Outside the loop, before any merge (first phase, resume): new Parameters drop the optimizer for `train()`."""
    if fresh_adapter(trainer, phase):
        trainer.optimizer, trainer.lr_scheduler, trainer.model_wrapped = None, None, trainer.model


def reset_seed(trainer: Any) -> int:
    """Seed of the k-th fresh adapter: deterministic, identical on all ranks, different per reset."""
    return trainer._base_seed * 1000 + 7919 * (trainer.prorl_resets + 1)


def frozen_room(trainer: Any, target: ResolvedPhase) -> int:
    """For how many later resets a joined frozen part leaves zero room (`consolidate_frozen_parts`): those the
    phases after `target` plan and, where a `HardResetCallback` may add more, at least as many as there have been
    (the room doubles when it runs out). Resets that fit write in place: the rollout engine keeps its graphs."""
    planned = sum(
        1
        for previous, phase in zip(trainer.phases[target.index :], trainer.phases[target.index + 1 :])
        if phase.hard_reset or phase.lora_shape != previous.lora_shape
    )
    if any(isinstance(callback, HardResetCallback) for callback in trainer.callback_handler.callbacks):
        planned = max(planned, trainer.prorl_resets + 1)
    return planned


def frozen_kind(trainer: Any) -> str | None:
    """The forwards this run's frozen parts act in (`prorl_trl.reset.frozen`): `BOTH` for a full reset (and without a
    KL term, beta = 0, where no forward is the reference's), `POLICY` where the reference stays
    (`reset_reference=False`), `REFERENCE` where the adapter stays and the reference moves; None where its resets
    freeze nothing (the adapter and the reference both kept, or no KL term)."""
    if trainer.args.reset_adapter:
        keeps_reference = not trainer.args.reset_reference and trainer.args.beta != 0.0
        return reset_ops.POLICY if keeps_reference else reset_ops.BOTH
    return reset_ops.REFERENCE if trainer.args.reset_reference and trainer.args.beta != 0.0 else None


def run_hard_reset(trainer: Any, reason: str = "manual", lora_phase: ResolvedPhase | None = None) -> None:
    """Keep the LoRA delta (frozen factors, or merged: `lora_reset_mode`), start a fresh adapter, reset optimizer
    and reference (per switches).

    With frozen factors the outputs are bitwise unchanged (`prorl_trl.reset.frozen`; saved to
    `<output_dir>/frozen/reset-<k>.safetensors` for a resume); a merge is exact only into a float32 base.
    `lora_phase` gives the fresh adapter's shape (default: the current phase). Saves the merged model under
    `<output_dir>/merged/reset-<k>/` when `save_merged_on_reset`.
    """
    if trainer._user_scheduler and trainer.args.reset_optimizer:
        raise ValueError(
            "hard_reset with reset_optimizer=True starts a fresh LR schedule, but the scheduler was passed in "
            "`optimizers=(..., scheduler)` and cannot be rebuilt. Choose the schedule with `lr_scheduler_type`/"
            "`lr_scheduler_kwargs` (HF rebuilds it at every reset), or set reset_optimizer=False."
        )
    if not trainer._reset_support_checked:  # manual calls in a run that had no reset planned at init
        reset_ops.check_reset_support(trainer.args, trainer.model, trainer.accelerator)
        trainer._reset_support_checked = True
    target = lora_phase or trainer.current_phase
    model = reset_ops.unwrap_model(trainer.model)
    engine = trainer._engine
    new_params, rounding, kept, probe = False, None, None, None
    keeps_adapter = hasattr(model, "peft_config") and not trainer.args.reset_adapter
    kind = frozen_kind(trainer)
    if keeps_adapter:
        if kind == reset_ops.REFERENCE:  # the reference := the policy: a TRL "ref" adapter zeroed (else the
            reset_ops.reset_reference_adapter(model)  # adapter-disabled base), plus a copy of the live delta for it
            kept = reset_ops.snapshot_reference_delta(model)
            reset_ops.keep_out_of_ddp_broadcasts(trainer.model_wrapped)
    elif hasattr(model, "peft_config"):
        trainer.prorl_adapter_resets += 1
        probe = ResetProbe.take(trainer)
        trainer._resumed_probe_rows = None  # used once, by the reset the resume was stopped before
        # in the engine's storage; idle parts of a superset adapter are zero and skipped
        active = trainer._active_lora["target_names"] if engine.sharded and trainer._active_lora else None
        if trainer.args.lora_reset_mode == "frozen":
            joined = trainer.args.consolidate_frozen_parts
            room_for = frozen_room(trainer, target) if joined else 0
            kept = reset_ops.freeze_lora_delta(model, engine.kind, active, joined, room_for, kind)
            reset_ops.keep_out_of_ddp_broadcasts(trainer.model_wrapped)
        elif engine.sharded:
            rounding = reset_ops.merge_lora_sharded(model, engine.kind, active)
        else:
            rounding = reset_ops.merge_lora_in_place(model)
        new_params = fresh_adapter(trainer, target)
        if trainer.args.reset_reference:  # a TRL "ref" adapter (PeftModel given with beta > 0) -> the policy
            reset_ops.reset_reference_adapter(model)
    elif trainer.args.reset_reference and trainer.ref_model is not None:
        if engine.sharded:
            reset_ops.sync_reference_sharded(trainer.ref_model, model, engine.kind)
        else:
            reset_ops.sync_reference(trainer.ref_model, model)
    if engine.deepspeed:  # edited trainable weights (LoRA A/B) must reach ZeRO's fp32 masters before its next step
        reset_ops.refresh_master_weights(trainer.optimizer)
    reset_optimizer(trainer, new_params)
    trainer.prorl_resets += 1
    trainer._pending_reset = None
    for callback in trainer.callback_handler.callbacks:  # a reset's policy gets `patience` evaluations of its own
        if isinstance(callback, HardResetCallback) and callback.tracker is not None:
            callback.tracker.restart_patience()
    force_weight_sync(trainer)
    if kept is not None:  # what a resume needs: small, written at every reset whatever the save settings
        save_frozen_factors(trainer)
    if trainer.args.save_merged_on_reset:
        path = Path(trainer.args.output_dir) / "merged" / f"reset-{trainer.prorl_resets}"
        save_merged(trainer, path)
        trainer.prorl_merged_path = str(path)
        if kept is None and trainer.accelerator.is_main_process and trainer.args.should_save:
            trainer.prorl_reset_hashes = file_hashes(path, trainer.args.output_dir)  # what a merge-mode resume loads
    if kept is not None and kept.layers:
        done = f"; {kept.describe()}"
    else:
        done = f"; {rounding.describe()}" if rounding is not None and rounding.delta_sq > 0 else ""
    if keeps_adapter:
        done = "; the adapter kept (reset_adapter=False)"
        if kept is not None:
            done += ", the KL reference moved to the policy (a copy of its delta)"
    elif kept is not None and kind == reset_ops.POLICY:
        done += ", for the policy only (reset_reference=False: the KL reference stays)"
    step = trainer.prorl_global_step
    trainer.announce(f"ProRL hard reset #{trainer.prorl_resets} at global step {step} ({reason}){done}.")
    if probe is not None:
        trainer.prorl_reset_change = probe.measure(trainer)
        for key, value in trainer.prorl_reset_change.items():
            trainer._metrics["train"][key].append(value)
    if rounding is not None:
        report_merge_rounding(trainer, rounding)


def report_merge_rounding(trainer: Any, rounding: reset_ops.MergeRounding) -> None:
    """Log `prorl/merge_delta_lost` (the fraction of the LoRA delta's norm the merge rounded away) with the next
    entry, and warn when most of it was: a silent loss of what the adapter learned since the last reset."""
    trainer.prorl_merge_delta_lost = rounding.lost_fraction
    trainer._metrics["train"]["prorl/merge_delta_lost"].append(rounding.lost_fraction)
    if rounding.lost_fraction > reset_ops.LOST_FRACTION_WARNING and trainer.accelerator.is_main_process:
        logger.warning(
            "Hard reset #%d: %s. Most of what the adapter learned since the last reset is below the resolution of "
            "the %s base weights and is gone. Set `lora_reset_mode: frozen` (the default), which keeps every "
            "phase's delta exactly as frozen factors and never writes the base weights.",
            trainer.prorl_resets, rounding.describe(), rounding.dtype_name,
        )  # fmt: skip


def reset_optimizer(trainer: Any, new_params: bool) -> None:
    """Fresh optimizer state / LR schedule after a reset; a new optimizer when the adapter has new Parameters.

    Outside the HF loop (phase boundary, manual call) a new adapter only drops the optimizer: the next `train()`
    builds and prepares one (and re-wraps DDP, `model_wrapped = model`). Inside the loop the optimizer and
    scheduler are swapped in place (`trainer.optimizer`/`lr_scheduler` are looked up every step, notes §5).
    """
    if trainer.optimizer is None:
        return
    if new_params and not trainer._in_training_loop:
        if not trainer.args.reset_optimizer:
            logger.warning("The LoRA shape changed: optimizer state cannot carry over to the new adapter.")
        trainer.optimizer, trainer.lr_scheduler, trainer.model_wrapped = None, None, trainer.model
        return
    if new_params:
        if trainer.accelerator.num_processes > 1:
            raise RuntimeError(
                "A LoRA shape change inside a phase would desynchronise DDP replicas; change the adapter shape only "
                "at a phase boundary (PhaseConfig.lora_r / lora_target_modules)."
            )
        stale = trainer.optimizer
        trainer.accelerator._optimizers = [o for o in trainer.accelerator._optimizers if o is not stale]
        trainer.optimizer = None
        trainer.create_optimizer()
        trainer.optimizer = trainer.accelerator.prepare(trainer.optimizer)
    elif trainer.args.reset_optimizer:
        reset_ops.reset_optimizer_state(trainer.optimizer)
    else:
        return
    if trainer._in_training_loop:
        trainer.lr_scheduler = None
        trainer._scheduler_start = trainer.state.global_step
        trainer._scheduler_horizon = max(trainer.state.max_steps - trainer._scheduler_start, 1)
        trainer.create_scheduler(num_training_steps=trainer._scheduler_horizon, optimizer=trainer.optimizer)
        trainer.callback_handler.optimizer = trainer.optimizer
        trainer.callback_handler.lr_scheduler = trainer.lr_scheduler
