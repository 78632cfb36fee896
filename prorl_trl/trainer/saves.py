"""What a run writes besides HF's checkpoints: the frozen factors of a reset, merged models (at a reset, `final/`) and
the run's log history.

Plain functions of the trainer (they read its model, engine and counters); `ProRLTrainer` and `hard_reset` decide
when. Every write is by the main process of a saving run, and every function is collective (all ranks call it and
wait), since a merged save under FSDP2/ZeRO gathers the weights first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import reset as reset_ops
from ..reset.checkpoint import FINAL_DIR_NAME, LOG_HISTORY_NAME, finished_state, save_tensors_atomically, write_json
from ..reset.provenance import file_hashes


def save_frozen_factors(trainer: Any) -> None:
    """`<output_dir>/frozen/reset-<k>.safetensors`: every frozen LoRA factor after reset k (replicated on every
    rank; the main process writes), what a resume puts back onto the original base. Written atomically."""
    relative = f"frozen/reset-{trainer.prorl_resets}.safetensors"
    if trainer.accelerator.is_main_process and trainer.args.should_save:
        factors = reset_ops.frozen_state_dict(trainer.model)
        save_tensors_atomically(Path(trainer.args.output_dir) / relative, factors)
        trainer.prorl_reset_hashes = file_hashes(Path(trainer.args.output_dir) / relative, trainer.args.output_dir)
    trainer.prorl_frozen_path = relative
    trainer.accelerator.wait_for_everyone()


def save_log_history(trainer: Any) -> None:
    """`<output_dir>/prorl_log_history.json`: every log entry of the run so far (main process)."""
    if trainer.accelerator.is_main_process and trainer.args.should_save:
        write_json(Path(trainer.args.output_dir) / LOG_HISTORY_NAME, trainer.prorl_log_history)


def save_final(trainer: Any) -> None:
    """`<output_dir>/final/`: the merged model + tokenizer, loadable with `from_pretrained`, and `prorl_state.json`
    (what was trained). Written atomically, and not rewritten when it already holds this very state (resuming a
    finished run changes nothing)."""
    done = {
        "finished": True,
        "global_step": trainer._global_step_offset,
        "resets": trainer.prorl_resets,
        "phases": len(trainer.phases),
        "last_phase": trainer.current_phase.name,
    }
    output_dir = Path(trainer.args.output_dir)
    if finished_state(output_dir) != done:  # the same file on every rank: all of them take part in a gather
        save_merged(trainer, output_dir / FINAL_DIR_NAME, state=done)
    else:
        trainer.accelerator.wait_for_everyone()


def save_merged(trainer: Any, path: Path, state: dict[str, Any] | None = None) -> None:
    """The live policy as a plain `from_pretrained` model at `path` (rank 0 writes; all ranks wait).

    LoRA: every delta folded in float32 and written in `merged_save_dtype` ("auto": the base dtype unless that
    would round the deltas away, then float32). Under FSDP2/ZeRO the weights are first gathered to rank 0's CPU one
    module at a time (collective)."""
    model = reset_ops.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        save_dtype, sharded = trainer.args.merged_save_dtype, trainer._engine.sharded
        weights, dtype, rounding = reset_ops.merged_weights(model, save_dtype, sharded)
        if dtype != rounding.dtype and rounding.delta_sq > 0:
            trainer.announce(
                f"Merged save {path.name} written in {str(dtype).removeprefix('torch.')}: in the "
                f"{rounding.dtype_name} of the base weights {100 * rounding.lost_fraction:.1f} % of the LoRA "
                "deltas' norm would round away (merged_save_dtype: auto)."
            )
    else:
        weights = reset_ops.gathered_state_dict(model) if trainer._engine.sharded else None  # every rank takes part
    if trainer.accelerator.is_main_process and trainer.args.should_save:
        reset_ops.save_merged(model, trainer.processing_class, path, state=state, weights=weights)
    trainer.accelerator.wait_for_everyone()
