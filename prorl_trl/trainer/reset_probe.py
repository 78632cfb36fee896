"""What a hard reset changed in the policy's outputs: the per-token log-probs of a few recent completions, before and
after the reset (`prorl/reset_logp_change`, `prorl/reset_effect_lost`).

Why: a reset must be a no-op on the policy (the fresh adapter starts at B = 0). `lora_reset_mode="frozen"` keeps every
delta exactly; `"merge"` rounds it into the base weights, and on a bf16 base at the recipes' learning rates that undoes
most of a phase. The share of the delta's norm a merge rounds away (`prorl/merge_delta_lost`) understates the damage,
since the rounding also adds noise of the same size, so this measures the outputs themselves, on the completions the
trainer was training on, with the log-probs its loss uses (TRL's `_get_per_token_logps_and_entropies`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..reset import unwrap_model

PROBE_ROWS = 2  # completions per process: enough to see a reset's effect, a few forwards of cost at a reset
PROBE_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
PROBE_FILE = "reset_probe_{}.safetensors"  # in a checkpoint, one per process (as HF's rng_state_<rank>.pth)


@dataclass
class ResetProbe:
    """Log-probs of `PROBE_ROWS` recent completions under the policy (`before`) and with the adapter disabled
    (`adapter_off`: the policy as of the last reset), taken just before a reset; `measure` compares them with the
    policy after it."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    before: torch.Tensor
    adapter_off: torch.Tensor

    @classmethod
    @torch.no_grad()
    def take(cls, trainer: Any) -> ResetProbe | None:
        """Probe the last generation batch (TRL's `_buffered_inputs`); None when there is none (a reset before the
        first step, or outside training) or it is not plain text. Collective: every process calls it at a reset."""
        batch = _recent_batch(trainer)
        if batch is None:
            return None
        completion_ids, completion_mask = batch["completion_ids"][:PROBE_ROWS], batch["completion_mask"][:PROBE_ROWS]
        input_ids = torch.cat([batch["prompt_ids"][:PROBE_ROWS], completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"][:PROBE_ROWS], completion_mask], dim=1)
        before = _logps(trainer, input_ids, attention_mask, completion_ids.size(1))
        with unwrap_model(trainer.model).disable_adapter():
            adapter_off = _logps(trainer, input_ids, attention_mask, completion_ids.size(1))
        return cls(input_ids, attention_mask, completion_mask.bool(), before, adapter_off)

    @torch.no_grad()
    def measure(self, trainer: Any) -> dict[str, float]:
        """`prorl/reset_logp_change`: the largest |log-prob after - before| over the probed tokens (0: the reset was a
        no-op); `prorl/reset_effect_lost`: |after - before| / |before - adapter off| (norms over the tokens of every
        process), the share of the adapter's effect on the log-probs that the reset changed (absent for an adapter
        with no effect). Collective."""
        after = _logps(trainer, self.input_ids, self.attention_mask, self.completion_mask.size(1))
        change = (after - self.before)[self.completion_mask].double()
        effect = (self.before - self.adapter_off)[self.completion_mask].double()
        largest = change.abs().max() if change.numel() else change.new_zeros(())
        sums = torch.stack([change.square().sum(), effect.square().sum(), largest])
        gathered = trainer.accelerator.gather(sums.to(trainer.accelerator.device)[None]).reshape(-1, 3)
        change_sq, effect_sq = float(gathered[:, 0].sum()), float(gathered[:, 1].sum())
        metrics = {"prorl/reset_logp_change": float(gathered[:, 2].max())}
        if effect_sq > 0:
            metrics["prorl/reset_effect_lost"] = math.sqrt(change_sq / effect_sq)
        return metrics


def save_probe_rows(trainer: Any, checkpoint: Path) -> None:
    """Write the rows a reset would probe now into `checkpoint` (this process's file; LoRA runs only).

    A resume starts with no generation batch, so a reset right after it (the phase boundary after a phase's last
    checkpoint, a reset pending at the checkpoint) would have nothing to probe, and the resumed run's log would lack
    the metrics the uninterrupted run logged there; `load_probe_rows` gives the resumed run these rows."""
    batch = _recent_batch(trainer)
    if batch is None or not checkpoint.is_dir() or not hasattr(unwrap_model(trainer.model), "peft_config"):
        return
    rows = {key: batch[key][:PROBE_ROWS].detach().cpu().contiguous() for key in PROBE_KEYS}
    save_file(rows, str(checkpoint / PROBE_FILE.format(trainer.accelerator.process_index)))


def load_probe_rows(trainer: Any, checkpoint: Path) -> dict[str, torch.Tensor] | None:
    """The rows `save_probe_rows` wrote into `checkpoint` for this process, on its device; None when there are none,
    or when they are not one file per process of this run (a resume on another number of processes, `--allow-changes`).

    Why all or none: a probe is collective (`ResetProbe.take`'s forwards under FSDP2, `measure`'s gather), so a resume
    on more processes, where the new ones have no file, would probe on some processes only and mismatch collectives
    (gloo aborts, NCCL hangs). Every process lists the same checkpoint folder, so all decide alike without a collective.
    Training is unchanged: the rows only give the reset's log its `prorl/reset_logp_change` and `reset_effect_lost`."""
    written = probe_file_ranks(Path(checkpoint))
    processes = trainer.accelerator.num_processes
    if written != list(range(processes)):
        if written:
            trainer.announce(
                f"note: {checkpoint} holds reset probe rows of {len(written)} process(es) and this run has "
                f"{processes}: a hard reset before the resume's first step logs no prorl/reset_logp_change or "
                "prorl/reset_effect_lost (the probe needs every process's rows). Training is not affected."
            )
        return None
    path = Path(checkpoint) / PROBE_FILE.format(trainer.accelerator.process_index)
    return {key: value.to(trainer.accelerator.device) for key, value in load_file(str(path)).items()}


def probe_file_ranks(checkpoint: Path) -> list[int]:
    """The process indices of the probe files in `checkpoint`, sorted (HF's `rng_state_<rank>.pth` naming)."""
    prefix, suffix = PROBE_FILE.split("{}")
    names = (path.name[len(prefix) : -len(suffix)] for path in checkpoint.glob(PROBE_FILE.format("*")))
    return sorted(int(name) for name in names if name.isdigit())


def _recent_batch(trainer: Any) -> dict[str, torch.Tensor] | None:
    """TRL's current generation batch (`_buffered_inputs`, private), else the rows a resume loaded."""
    buffered = getattr(trainer, "_buffered_inputs", None)
    batch = buffered[0] if isinstance(buffered, list) and buffered else getattr(trainer, "_resumed_probe_rows", None)
    if batch is None or any(key not in batch for key in PROBE_KEYS) or "pixel_values" in batch:
        return None
    return batch


def _logps(trainer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """The loss's per-token log-probs (TRL's method, at the sampling temperature), in eval mode (no dropout)."""
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        return trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)[0].float()
    finally:
        model.train(was_training)
