"""Sampling settings a phase or a schedule may change, where TRL 1.16 baked them in at init, and `apply_sampling`,
which pushes new values into all those places.

`ProRLTrainer.apply_sampling` decides when; the generation side is TRL's `generation_config`/`generation_kwargs`
(transformers) or `vllm_generation` (`prorl_trl.rollout.vllm_sync`), and the loss side is the fused log-prob head,
whose temperature is a closure constant (`patch_fused_log_prob_heads`).
"""

from __future__ import annotations

from typing import Any

from ..reset import unwrap_model
from ..rollout.vllm_sync import VLLM_SAMPLING_ATTRIBUTES, apply_vllm_sampling, shadowed_by_generation_kwargs

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


def apply_sampling(trainer: Any, **settings: Any) -> None:
    """Make sampling settings reach generation (transformers or vLLM), the loss and the overlong penalty.

    Relies on TRL 1.16 privates: `generation_config` + `generation_kwargs` (transformers path) or
    `vllm_generation.<attr>` (vLLM), both read at every generation; the temperature is also baked into the fused
    LM head at init, so the policy (and reference) heads are re-patched.
    """
    unknown = sorted(set(settings) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"Unknown sampling settings {unknown}; allowed: {list(SAMPLING_KEYS)}.")
    changed = {k: v for k, v in settings.items() if getattr(trainer, k) != v}
    shadowed = shadowed_by_generation_kwargs(trainer.args.generation_kwargs, changed)
    if shadowed:  # TRL applies generation_kwargs over these: the new value would reach the loss, not generation
        raise ValueError(
            f"Cannot change {shadowed} to {[changed[k] for k in shadowed]}: `generation_kwargs` sets "
            f"{shadowed} too, and TRL applies generation_kwargs over the sampling fields. Set them as "
            "ProRLConfig/PhaseConfig fields instead of in generation_kwargs."
        )
    penalty = trainer.overlong_penalty
    cap = changed.get("max_completion_length")
    if cap is not None and penalty is not None and 0 < penalty.overlong_buffer and penalty.overlong_buffer >= cap:
        # the penalty zone would start at or below 0 tokens: every completion, a one-token answer too, penalised
        raise ValueError(
            f"Cannot change max_completion_length to {cap}: the overlong buffer is {penalty.overlong_buffer} tokens, "
            "and the penalty starts at the cap minus the buffer. Keep the cap above the buffer, or lower "
            "overlong_buffer (the phase's) first."
        )
    for key, value in changed.items():
        setattr(trainer, key, value)
        setattr(trainer.args, key, value)
        if trainer.use_vllm:
            apply_vllm_sampling(trainer.vllm_generation, **{key: value})
        else:
            name = GENERATION_CONFIG_NAMES.get(key, key)
            setattr(trainer.generation_config, name, value)
            trainer.generation_kwargs[name] = value
    if "temperature" in changed:
        patch_fused_log_prob_heads(
            unwrap_model(trainer.model),
            unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None,
            changed["temperature"],
            trainer.args.cast_lm_head_to_fp32,
            trainer._fused_forward_at_init,
        )
    if trainer.overlong_penalty is not None:
        trainer.overlong_penalty.max_completion_length = trainer.max_completion_length
    if trainer.args.compiled_generation and ("max_completion_length" in changed or not trainer._compiled_generation):
        # The static cache is sized from the cap, so it follows every cap change (one compilation per shape).
        from ..rollout.compiled import configure_trainer_generation  # here, so `trainer.checks` stays light

        trainer._compiled_generation = configure_trainer_generation(
            trainer, max_prompt_length=trainer.args.generation_max_prompt_length
        )
    trainer.sampling = {key: getattr(trainer, key) for key in SAMPLING_KEYS}
