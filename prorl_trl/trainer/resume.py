"""Resuming a run: the ProRL side of a checkpoint (phase, counters, earlier phases' LoRA deltas, adapter shape, log
history) restored before HF's part, a phase's last checkpoint resumed without HF's `train()`, and a loaded LR
schedule brought to this run's settings.

`ProRLTrainer.train` decides when (`prepare_resume` before the phase loop, `_restore_finished_phase` for a phase
that was over, `_load_optimizer_and_scheduler` inside HF's resume); these functions do it. Every refusal comes before
anything is loaded or any later checkpoint is un-committed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import LambdaLR
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import speed_metrics

from .. import reset as reset_ops
from ..files import read_json
from ..reset.checkpoint import (
    LOG_HISTORY_NAME,
    in_phase_dir,
    load_merged_base,
    load_optimizer_state,
    supersede_after,
    verify_checkpoint,
)
from ..reset.provenance import RunFilesError, base_model_difference, resolve_in_run, verify_files
from .hard_reset import adapter_differs, frozen_kind, reinit_adapter
from .phase_switch import announce_phase
from .reset_probe import load_probe_rows
from .state import find_checkpoint, resume_state, resumed_log_history, resumed_phase, resumed_phase_complete


def adapter_shapes(model: Any) -> tuple[dict[str, tuple[int, ...]], float | None]:
    """The live adapter as PEFT saves it (key -> shape) and its alpha."""
    from peft import get_peft_model_state_dict

    shapes = {key: tuple(value.shape) for key, value in get_peft_model_state_dict(model).items()}
    return shapes, model.peft_config["default"].lora_alpha


def refuse_adapter_shape_change(trainer: Any, phase: Any, checkpoint: Path) -> None:
    """A resume inside a phase loads the checkpoint's adapter into the phase's: a LoRA rank, alpha or target list
    changed since (an `--allow-changes` override) would load it partly, or rescale its delta, and so change the
    policy the checkpoint holds without a word. Refused; a shape changes at a hard reset, between phases."""
    import json

    from safetensors import safe_open

    model = reset_ops.unwrap_model(trainer.model)
    saved, config = checkpoint / "adapter_model.safetensors", checkpoint / "adapter_config.json"
    if not hasattr(model, "peft_config") or not saved.is_file() or not config.is_file():
        return
    with safe_open(str(saved), "pt") as handle:
        recorded = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    recorded_alpha = json.loads(config.read_text()).get("lora_alpha")
    live, alpha = adapter_shapes(model)
    if recorded == live and recorded_alpha == alpha:
        return
    differs = sorted(set(recorded) ^ set(live)) or sorted(key for key in live if recorded[key] != live[key])
    what = f"first differing weight {differs[0]}" if differs else f"lora_alpha {recorded_alpha} -> {alpha}"
    raise RunFilesError(
        f"{checkpoint} is inside phase {phase.index} ({phase.name}), and this run gives that phase another adapter "
        f"than the checkpoint's ({what}). Loading it would change the policy the checkpoint holds: a LoRA shape "
        f"changes only at a hard reset. Nothing was loaded. Keep phase {phase.index}'s LoRA settings as recorded, or "
        "end the phase (`prorl-trl reset RUN_DIR`) and give the new shape to the next one."
    )


def _accepted(trainer: Any) -> None:
    """The start or resume passed every check: `ProRLTrainer.on_resume_accepted` (the CLI's records of the run)."""
    for hook in trainer.on_resume_accepted:
        hook()


def epoch_phase_length(trainer: Any, phase: Any) -> tuple[int | None, int | None]:
    """A phase of `num_train_epochs` (`max_steps` < 1, one-phase runs): its length in optimizer steps and the steps
    per epoch, as HF's `train()` derives them (`Trainer.set_initial_training_values` on this run's train dataloader);
    (None, None) for a phase of `max_steps`, or a dataloader without a length."""
    if phase.max_steps > 0:
        return None, None
    values = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())
    per_epoch, length = values[1], values[-1]
    return (length, per_epoch) if isinstance(length, int) and length > 0 else (None, None)


def prepare_resume(trainer: Any, resume_from_checkpoint: str | bool | None) -> Path | None:
    """Restore the ProRL side of a checkpoint (phase, earlier deltas, adapter shape, counters) before TRL's part.

    `True` means the latest complete checkpoint of `output_dir`. Resuming from an older one un-commits the later
    checkpoints (`supersede_after`), so a later "resume from the latest" cannot jump back onto the abandoned path.
    Every check that can refuse (exit 2) comes before `on_resume_accepted` (the CLI's records: the resume history, a
    finished run's `final/` renamed) and the un-committing: a refused resume leaves the run folder as it was.
    """
    trainer._resumed_phase_step = 0
    trainer._resumed_phase_complete = False
    trainer._resumed_loss_sum = None
    if not resume_from_checkpoint:
        _accepted(trainer)
        return None
    if resume_from_checkpoint is True:
        checkpoint = find_checkpoint(trainer.args.output_dir)
    else:
        checkpoint = Path(resume_from_checkpoint)
    # Every process checks the files it is about to load, so all refuse together (exit 2, nothing loaded).
    unchecked = verify_checkpoint(checkpoint)
    if unchecked:
        trainer.announce(f"note: {unchecked}")
    state = resume_state(checkpoint, trainer.phases[0])  # a plain GRPOTrainer checkpoint resumes as phase 0
    phase = resumed_phase(state, trainer.phases, checkpoint)  # a run with fewer phases than it trained: refused
    # At the phase's last step (of this run's length) or a plateau stop: the phase is over. Refused before any change.
    complete = resumed_phase_complete(state, phase, checkpoint, *epoch_phase_length(trainer, phase))
    difference = base_model_difference(state.get("base_model"), trainer.prorl_base_model)
    if difference:
        raise RunFilesError(
            f"{checkpoint} was made on another base model: {difference}. Its LoRA deltas (and frozen factors) "
            "only reproduce the run's policy on the base they were trained on; nothing was loaded. Resume with the "
            "run's base model (`model.name_or_path`, `model.revision`), or start a new run."
        )
    # The run's log history, read (and refused when damaged) before anything is recorded.
    history = Path(trainer.args.output_dir) / LOG_HISTORY_NAME
    saved_history = None
    if "log_history" not in state and history.is_file():
        saved_history = read_json(history, list, "It is the run's log history, which a resume continues.")
    trainer.prorl_merged_path = recorded_merged_path(trainer, state.get("merged_base"), checkpoint)
    restore_reset_deltas(trainer, state, checkpoint)
    trainer.prorl_resets = state["resets"]
    trainer.prorl_adapter_resets = adapter_resets_of(state)
    trainer.prorl_nonfinite_skips = list(state.get("nonfinite_skips") or [])
    trainer.prorl_on_demand_resets = list(state.get("on_demand_resets") or [])
    trainer.prorl_reset_hashes = dict(state.get("reset_files_sha256") or {})
    trainer._global_step_offset = state["global_step_offset"]
    trainer._resumed_phase_step = state["phase_global_step"]
    trainer._resumed_phase_complete = complete
    trainer._phase_end_reason = state.get("phase_end_reason", "max_steps")
    trainer._pending_reset = state.get("pending_reset")
    if adapter_differs(trainer, phase):
        reinit_adapter(trainer, phase)
    if not complete and trainer._superset is None:
        refuse_adapter_shape_change(trainer, phase, checkpoint)
    trainer._apply_phase(phase)  # in memory only; its checks (sampling settings) refuse before the records too
    trainer._scheduler_horizon = state.get("scheduler_horizon")
    trainer._scheduler_start = state.get("scheduler_start", 0)
    if trainer._scheduler_horizon is not None and "scheduler_start" in state and phase.max_steps > 0:
        trainer._scheduler_horizon = max(phase.max_steps - trainer._scheduler_start, 1)  # this run's phase length
    trainer._resumed_loss_sum = state.get("phase_loss_sum")  # none in older checkpoints and plain TRL ones
    trainer._resumed_refill = state.get("refill_position")  # none before 2026-11-29: the stream restarted
    trainer._state_callback.load_state_dict(state.get("callbacks", {}))
    if "log_history" in state:
        trainer.prorl_log_history = state["log_history"]
    elif saved_history is not None:
        step = trainer._global_step_offset + trainer._resumed_phase_step
        trainer.prorl_log_history = resumed_log_history(saved_history, phase.index, step, phase_continues=not complete)
    probe_rows = load_probe_rows(trainer, checkpoint)  # what a reset before the first step probes
    # After every refusal above (the adapter's shape, the log history too): a refused resume leaves the later
    # checkpoints committed and the run's records (a finished run's final/ included) as they were.
    _accepted(trainer)
    if trainer.accelerator.is_main_process and trainer.args.should_save:
        supersede_after(trainer.args.output_dir, checkpoint)
    trainer.accelerator.wait_for_everyone()
    trainer._trackers.resumed_at = trainer._global_step_offset + trainer._resumed_phase_step
    trainer._resumed_probe_rows = probe_rows  # after `_apply_phase`, which clears them
    announce_phase(trainer, phase)
    return checkpoint


def run_dir_of(trainer: Any, checkpoint: Path) -> Path:
    """The run folder `checkpoint` is in now (`output_dir`, spelled as given, when it is that folder)."""
    output_dir = Path(trainer.args.output_dir)
    if not in_phase_dir(checkpoint) or checkpoint.resolve().parent.parent == output_dir.resolve():
        return output_dir
    return checkpoint.resolve().parent.parent


def recorded_merged_path(trainer: Any, recorded: str | None, checkpoint: Path) -> str | None:
    """The last merged save of a resumed run, for its log entries (loaded, when it is, by `restore_reset_deltas`):
    relative paths belong to the checkpoint's run folder; an old absolute one is kept only inside it."""
    if not recorded or not isinstance(recorded, str):
        return None
    run_dir = run_dir_of(trainer, checkpoint)
    path = Path(recorded)
    path = path if path.is_absolute() else run_dir / path
    return str(path) if path.resolve().is_relative_to(run_dir.resolve()) else None


def adapter_resets_of(state: dict[str, Any]) -> int:
    """The resets whose LoRA deltas a resume restores: those with reset_adapter=False kept the adapter itself, which
    the checkpoint holds (checkpoints from before the count was recorded: every reset)."""
    return state.get("adapter_resets", state["resets"])


def check_frozen_kind(trainer: Any, checkpoint: Path) -> None:
    """Refuse frozen parts that act in other forwards than this run's resets make (`reset_adapter` /
    `reset_reference` changed since the checkpoint): the next reset could not join them, and the reference the
    loaded parts define is not the one this run's settings describe."""
    found = {frozen.acts_in for _, _, frozen in reset_ops.frozen_layers(trainer.model)}
    expected = frozen_kind(trainer)
    if found and found != {expected}:
        raise ValueError(
            f"{checkpoint}'s frozen LoRA parts act in the {'/'.join(sorted(found))} forward(s), but this run's resets "
            f"(reset_adapter={trainer.args.reset_adapter}, reset_reference={trainer.args.reset_reference}) "
            f"{'keep no frozen part' if expected is None else f'make parts for the {expected} forward(s)'}: the "
            "checkpoint's KL reference is not the one these settings describe. Resume with the settings the run was "
            "started with."
        )


def restore_reset_deltas(trainer: Any, state: dict[str, Any], checkpoint: Path) -> None:
    """Put the earlier phases' LoRA deltas of a checkpoint back: its frozen factors or its merged base, both read
    from the run folder the checkpoint is in now (a moved run finds its own) and checked against the sha256
    recorded at the reset (`reset.provenance`). Refuses a checkpoint whose deltas cannot be restored, changed
    files, and a resume in the other `lora_reset_mode`, rather than train on a policy that lost them."""
    run_dir = run_dir_of(trainer, checkpoint)
    hashes = state.get("reset_files_sha256") or {}  # none in checkpoints from before they were recorded
    is_lora = hasattr(reset_ops.unwrap_model(trainer.model), "peft_config")
    recorded = state.get("lora_reset_mode", "merge")  # checkpoints from before frozen factors merged
    adapter_resets = adapter_resets_of(state)
    if is_lora and adapter_resets > 0 and recorded != trainer.args.lora_reset_mode:
        raise ValueError(
            f"{checkpoint} was written by a run with lora_reset_mode={recorded!r}, and this one has "
            f"{trainer.args.lora_reset_mode!r}: its earlier phases' LoRA deltas are kept the other way. Resume with "
            f"`lora_reset_mode: {recorded}`."
        )
    if state.get("frozen_factors"):
        from safetensors.torch import load_file

        path = resolve_in_run(state["frozen_factors"], run_dir, checkpoint, "frozen_factors")
        if not path.is_file():
            raise RunFilesError(
                f"{checkpoint} needs the frozen LoRA factors of its earlier phases at {path}, which is "
                f"{'a folder' if path.is_dir() else 'missing'}; nothing was loaded. Put the run's own file back "
                "(resume the run folder the checkpoint was written in, with its frozen/ folder), or resume from a "
                "checkpoint written before that reset (`--resume <run>/phase-<i>/checkpoint-<step>`)."
            )
        verify_files(hashes, run_dir, checkpoint, "the frozen LoRA factors of its earlier phases")
        reset_ops.load_frozen_(trainer.model, load_file(str(path)))
        check_frozen_kind(trainer, checkpoint)
        reset_ops.keep_out_of_ddp_broadcasts(trainer.model_wrapped)
        trainer.prorl_frozen_path = state["frozen_factors"]
    elif state.get("merged_base"):
        path = resolve_in_run(state["merged_base"], run_dir, checkpoint, "merged_base")
        verify_files(hashes, run_dir, checkpoint, "the merged base of its earlier phases")
        load_merged_base(trainer.model, path)
        if trainer.ref_model is not None and trainer.args.reset_reference:
            load_merged_base(trainer.ref_model, path)
        trainer.prorl_merged_path = str(path)
    elif is_lora and adapter_resets > 0:
        raise ValueError(
            f"{checkpoint} comes after {adapter_resets} hard reset(s) that merged the LoRA deltas into the base "
            "weights, but the merged base was not saved (save_merged_on_reset: false), so the earlier phases' "
            "learning cannot be restored. Resume from a checkpoint before the first reset, or restart the run."
        )


def restore_finished_phase(trainer: Any, checkpoint: Path) -> None:
    """Resume from the checkpoint of a phase's last step: load what HF's resume would (weights, optimizer state,
    RNG), but do not call HF's `train()`, which checks `max_steps` only after a step and so would train one step
    more than the phase has (and than the uninterrupted run did)."""
    if trainer._engine.sharded:  # HF loads FSDP/DeepSpeed checkpoints only inside `train()`, into a built engine
        raise reset_ops.ResetNotSupportedError(
            f"{checkpoint} was written at the last step of phase {trainer.current_phase.index}; resuming from such a "
            f"checkpoint is not supported under {trainer._engine.label} yet (its weights and optimizer state are in "
            "the engine's own format, which HF loads only into the engine a training call builds). Resume from "
            "an earlier checkpoint of that phase, or save at a step inside the phase."
        )
    trainer._load_from_checkpoint(str(checkpoint))  # HF private: the adapter (LoRA) or all weights
    if trainer.optimizer is None:
        trainer.create_optimizer()
    load_optimizer_state(trainer.optimizer, checkpoint)
    trainer._load_rng_state(str(checkpoint))  # HF private: python, numpy, torch (and CUDA) RNG of this process
    log_phase_summary_of(trainer, checkpoint)


def log_phase_summary_of(trainer: Any, checkpoint: Path) -> None:
    """The entry HF's `_finalize_training` logs when a phase's call ends (`train_loss` over the phase,
    `total_flos`, speed figures), which a resume from the phase's last checkpoint would not have: with it the log
    equals the uninterrupted run's. The speed figures are this call's (no step trained); a checkpoint that
    recorded no `phase_loss_sum` (older ones) gets no entry, and none is added when the run's log history, written
    after the phase's call, already has it (a stop during the next reset or `final/`)."""
    state_file = checkpoint / TRAINER_STATE_NAME
    phase = trainer.current_phase.index
    logged = any(entry.get("prorl/phase") == phase and "train_loss" in entry for entry in trainer.prorl_log_history)
    if trainer._resumed_loss_sum is None or logged or not state_file.is_file():
        return
    start = time.time()
    trainer.state = TrainerState.load_from_json(str(state_file))  # the phase's step, epoch and flos, as HF had them
    metrics = speed_metrics("train", start, num_samples=0, num_steps=0)
    metrics["total_flos"] = trainer.state.total_flos
    metrics["train_loss"] = trainer._resumed_loss_sum / max(trainer.state.global_step, 0.001)  # as `_finalize_training`
    trainer._in_training_loop = True  # `prorl/global_step` counts the phase's steps, as inside HF's call
    try:
        trainer.log(metrics)
    finally:
        trainer._in_training_loop = False


def match_loaded_schedule(trainer: Any, checkpoint: str | None, fresh_rates: list[float]) -> None:
    """After HF loaded a checkpoint's optimizer and scheduler: the LR schedule of this run's settings at the loaded
    step (`fresh_rates`: the base rates of the scheduler HF built from this run's settings, before loading).

    The loaded states carry the old schedule's rate (LambdaLR's `base_lrs` and `_last_lr`, the param groups'
    `initial_lr` and `lr`); the schedule is rebuilt as a fresh run with this run's settings builds it
    (`create_scheduler`) and set to the loaded step (`last_epoch`), and the param groups get its rate. With unchanged
    settings this is LambdaLR's own `base_lr * lr_lambda(step)`: the loaded rates, bit for bit. Other schedulers
    (`reduce_lr_on_plateau`, one passed in `optimizers`) keep the loaded state.
    """
    scheduler = trainer.lr_scheduler
    if checkpoint is None or trainer._user_scheduler or not isinstance(scheduler, LambdaLR) or not fresh_rates:
        return
    step = scheduler.last_epoch  # scheduler steps since the schedule started (the phase, or an in-loop reset)
    for group, rate in zip(trainer.optimizer.param_groups, fresh_rates):
        group["initial_lr"] = rate  # `create_scheduler` takes its base rates from here
    trainer.lr_scheduler = None
    fresh = trainer.create_scheduler(num_training_steps=trainer.state.max_steps, optimizer=trainer.optimizer)
    scheduler.base_lrs, scheduler.lr_lambdas = list(fresh.base_lrs), list(fresh.lr_lambdas)
    rates = [base * schedule(step) for base, schedule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(trainer.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates
    trainer.lr_scheduler = scheduler  # the loaded object, which HF (and DeepSpeed) already reference
