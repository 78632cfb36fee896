"""Grouped-query decode attention: one-token decode steps attend on the key/value heads, with no per-head cache copy.

With a static cache transformers' compiled SDPA decode step copies the whole cache
once per query head (`repeat_kv`, grouped-query models), so the step cost grows with the cache length, not with the
tokens written so far: at the seed's reset-4 cache (64 x 6,656) the compiled path was 0.9x TRL's default.
`use_gqa_decode_attention` registers an SDPA variant that attends on the key/value heads directly for one-token steps
(3.5x TRL's default there); `prorl_trl.rollout.compiled.configure_trainer_generation` switches the policy to it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import GUARDED_SDPA, guarded_sdpa_attention_forward

GQA_DECODE_ATTENTION = "sdpa_gqa_decode"


def sdpa_gqa_decode_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a one-token decode step attends on the key/value heads directly.

    Why: with a mask (always, with a static cache) transformers' SDPA path copies every key/value head
    `num_key_value_groups` times (`repeat_kv`) before the kernel when the step is compiled, i.e. the whole cache,
    every layer, every token: for Qwen2-0.5B (14 query / 2 KV heads) 7x the cache's bytes per step. One query token per
    head lets the group's query heads stand in the query-length axis instead: `(batch, kv_heads, groups, dim)` against
    `(batch, kv_heads, cache, dim)`, the same arithmetic with no copy. Anything else (prefill, training forwards,
    dropout, position biases, per-head masks) goes to transformers' own `sdpa_attention_forward` unchanged, through
    the cuDNN attention guard (`prorl_trl.attention`), which only acts on training calls.
    """

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, query_length, dim = query.shape
    per_head_mask = attention_mask is not None and (attention_mask.ndim != 4 or attention_mask.shape[1] != 1)
    if (
        query_length != 1
        or groups == 1
        or per_head_mask
        or (dropout and module.training)
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or key.shape[-1] != dim
    ):
        return guarded_sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    packed = query.reshape(batch, heads // groups, groups, dim)
    output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def _text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def use_gqa_decode_attention(model: Any) -> bool:
    """Switch `model` (a transformers model, or a PEFT model around one) from "sdpa" (or its cuDNN-guarded variant)
    to `sdpa_gqa_decode_forward`.

    Only for models on SDPA with grouped-query attention (fewer key/value heads than query heads); returns whether it
    switched. Results are the same (the training forward is transformers' own SDPA); decode steps copy no KV heads.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == GQA_DECODE_ATTENTION:
        return True
    if implementation not in ("sdpa", GUARDED_SDPA) or not hasattr(base, "set_attn_implementation"):
        return False
    text_config = _text_config(config)
    heads = getattr(text_config, "num_attention_heads", None)
    if not heads or (getattr(text_config, "num_key_value_heads", None) or heads) >= heads:
        return False
    AttentionInterface.register(GQA_DECODE_ATTENTION, sdpa_gqa_decode_forward)
    AttentionMaskInterface.register(GQA_DECODE_ATTENTION, sdpa_mask)
    base.set_attn_implementation(GQA_DECODE_ATTENTION)
    return config._attn_implementation == GQA_DECODE_ATTENTION


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of keys and values one token occupies across all layers (what each decode step re-reads per token)."""
    text_config = _text_config(config)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    num_kv_heads = text_config.num_key_value_heads or text_config.num_attention_heads
    element_size = torch.tensor([], dtype=dtype).element_size()
    return 2 * text_config.num_hidden_layers * num_kv_heads * head_dim * element_size

