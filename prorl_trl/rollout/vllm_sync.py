"""ProRL phase settings and hard resets on TRL's vLLM path (`trainer.vllm_generation`, trl 1.16).

What TRL 1.16 does (read in `trl/generation/vllm_generation.py` and `GRPOTrainer._generate_single_turn`):
* `VLLMGeneration` copies `temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length,
  generation_kwargs` into attributes at init and reads them on every `generate()` call; `generation_kwargs` is applied
  *after* the explicit fields (colocate: `SamplingParams(**{...}.update(generation_kwargs))`; server: merged
  client-side), so a scheduled key also present there would be silently overridden. vLLM spells the completion cap
  `max_tokens`.
* Weights are pushed when `trainer.state.global_step != trainer._last_loaded_step`. HF's `global_step` restarts at 0
  in every phase (`train()` call), so a phase boundary must set `_last_loaded_step = -1` to force the push (else a
  phase whose first step equals the previous phase's last synced step keeps stale vLLM weights). After a hard reset
  the policy function is unchanged (fresh B = 0), but forcing a push costs one sync and removes any doubt.
* TRL's push (`_iter_named_params`) merges the active adapter into the base weights in place, streams them renamed
  to vLLM names (LoRA tensors skipped) and unmerges. Two things make that wrong for ProRL's LoRA runs, so
  `stream_policy_weights` replaces it: the frozen factors of earlier resets (`prorl_trl.reset.frozen`) live in a
  forward hook, not in any weight, so vLLM would sample from a policy without them; and on a bf16 base `unmerge` is
  not the inverse of `merge` (round(round(W + delta) - delta) != W), so every push would move the base weights by
  bf16 steps wherever the delta is large. The replacement folds every delta into each weight out of place, in
  float32, cast once to the weight's dtype (`reset.iter_policy_weights`, one module at a time, collective under
  ZeRO-3/FSDP2 as TRL's is): vLLM gets that rounded function while the trainer trains the exact one, and the live
  model is never written. A hard reset keeps every base name, shape and dtype, so server mode's cached
  `_weight_metadata` stays valid even after a rank/target change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..reset.gathered import iter_policy_weights

VLLM_SAMPLING_ATTRIBUTES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")
# How vLLM's SamplingParams spell each attribute in `generation_kwargs`.
VLLM_SAMPLING_PARAMS_NAMES = {name: name for name in VLLM_SAMPLING_ATTRIBUTES} | {"max_completion_length": "max_tokens"}
# Every `generation_kwargs` key that overrides a setting, on either backend (transformers spells the cap max_new_tokens).
_OVERRIDING_KEYS = {name: {name, VLLM_SAMPLING_PARAMS_NAMES[name]} for name in VLLM_SAMPLING_ATTRIBUTES}
_OVERRIDING_KEYS["max_completion_length"].add("max_new_tokens")


def shadowed_by_generation_kwargs(generation_kwargs: dict[str, Any] | None, settings: Any) -> list[str]:
    """Settings (TRL names) that `generation_kwargs` would silently override, on the transformers or the vLLM path.

    TRL applies `generation_kwargs` after (and over) its explicit sampling fields on both backends, so a phase or
    schedule value for one of these would never reach generation. Checks both spellings of the completion cap.
    """
    keys = set(generation_kwargs or {})
    return sorted(name for name in settings if _OVERRIDING_KEYS.get(name, {name}) & keys)


def apply_vllm_sampling(vllm_generation: Any, generation_kwargs: dict[str, Any] | None = None, **settings: Any) -> dict:
    """Push phase sampling settings into TRL's `VLLMGeneration`; they take effect at its next `generate()` call.

    `settings` are any of `VLLM_SAMPLING_ATTRIBUTES` (TRL's names, e.g. `max_completion_length`, not `max_tokens`);
    `generation_kwargs`, if given, replaces the extra SamplingParams dict. Raises `ValueError` for unknown settings and
    when `generation_kwargs` would silently override a scheduled setting. Returns the settings now in force.
    """
    unknown = sorted(set(settings) - set(VLLM_SAMPLING_ATTRIBUTES))
    if unknown:
        raise ValueError(f"Unknown vLLM sampling settings {unknown}; allowed: {list(VLLM_SAMPLING_ATTRIBUTES)}.")
    extra = dict(generation_kwargs) if generation_kwargs is not None else vllm_generation.generation_kwargs
    shadowed = shadowed_by_generation_kwargs(extra, settings)
    if shadowed:
        raise ValueError(
            f"generation_kwargs also sets {shadowed} (as {[VLLM_SAMPLING_PARAMS_NAMES[n] for n in shadowed]}); TRL "
            "applies generation_kwargs after the explicit vLLM fields, so the phase value would be ignored. Remove them "
            "from generation_kwargs and set them as ProRLConfig/PhaseConfig fields."
        )
    for name, value in settings.items():
        setattr(vllm_generation, name, value)
    vllm_generation.generation_kwargs = extra
    return {name: getattr(vllm_generation, name) for name in VLLM_SAMPLING_ATTRIBUTES}


def force_weight_sync(trainer: Any) -> None:
    """Make the next generation push the policy weights to vLLM (after a phase boundary or a hard reset).

    TRL compares `state.global_step` with `_last_loaded_step`; -1 never equals a step. No-op without vLLM.
    """
    if getattr(trainer, "use_vllm", False):
        trainer._last_loaded_step = -1



def stream_policy_weights(vllm_generation: Any) -> None:
    """Make TRL's vLLM push (`VLLMGeneration.sync_weights`, which iterates `_iter_named_params`) send the policy with
    every LoRA delta folded in out of place (see the module docstring). For PEFT models only: a fully fine-tuned
    model's weights are the policy already, and TRL streams them unchanged."""
    vllm_generation._iter_named_params = lambda: _policy_stream(vllm_generation)


def _policy_stream(vllm_generation: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value, _ in iter_policy_weights(vllm_generation.model, buffers=False):
        yield vllm_generation._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."]), value
