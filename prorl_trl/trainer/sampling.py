"""Sampling settings a phase or a schedule may change, and where TRL 1.16 baked them in at init.

`ProRLTrainer.apply_sampling` decides when; the generation side is TRL's `generation_config`/`generation_kwargs`
(transformers) or `vllm_generation` (`prorl_trl.rollout.vllm_sync`), and the loss side is the fused log-prob head,
whose temperature is a closure constant (`patch_fused_log_prob_heads`).
"""

from __future__ import annotations

from typing import Any

from ..rollout.vllm_sync import VLLM_SAMPLING_ATTRIBUTES

# The settings a phase or a schedule may change mid-run: the attributes TRL reads at every generation (both backends).
SAMPLING_KEYS = VLLM_SAMPLING_ATTRIBUTES
# GenerationConfig / generation_kwargs spell one of them differently.
GENERATION_CONFIG_NAMES = {"max_completion_length": "max_new_tokens"}


def patch_fused_log_prob_heads(
    policy: Any, ref_model: Any, temperature: float, cast_lm_head_to_fp32: bool, originals: dict[int, Any]
) -> None:
    """Re-apply TRL's fused log-prob head with `temperature` on the (unwrapped) policy and reference model.

    `originals` maps `id(module)` to the forward TRL installed at init; it is restored first (and remembered on the
    first call), so repeated changes never stack more than one layer.
    """
    from trl.trainer.utils import add_fused_lm_head  # here, so `trainer.checks` (validate) stays light

    targets = [(policy.get_base_model() if hasattr(policy, "get_base_model") else policy, ("log_probs", "entropy"))]
    if ref_model is not None:
        targets.append((ref_model, ("log_probs",)))
    for module, outputs in targets:
        module.forward = originals.setdefault(id(module), module.forward)
        add_fused_lm_head(module, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
