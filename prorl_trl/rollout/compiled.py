"""Faster rollouts on TRL's transformers path: a static KV cache and a `torch.compile`d decode step.

Why: `GRPOTrainer` (trl 1.16) generates with `unwrapped_model.generate(..., generation_config=trainer.generation_config)`,
a config it builds once in `__init__` as `GenerationConfig(**generation_kwargs, disable_compile=True)`. With the default
dynamic cache every decode step is an eager forward, so small models are bound by Python and kernel-launch overhead,
not by the GPU (see `benchmarks/results/generation.md`). transformers compiles the decode step itself (CUDA graphs via
`mode="reduce-overhead"`) when three things hold on its `GenerationConfig`: a compileable cache
(`cache_implementation="static"`), `disable_compile` false, and the model on an accelerator. TRL forbids the second
through `generation_kwargs` (it passes `disable_compile=True` itself), so we flip it on the trainer's object after
`__init__`. No TRL method is overridden.

Shapes decide compilations: one per (generation batch size, static cache length, train/eval mode, adapter layout).
The cache length is `max(previous length, padded prompt + max_new_tokens)`, so prompts of varying length would
recompile every time a longer one arrives; `max_cache_len` (prompt budget + completion cap) fixes it to one compile per
phase. This module imports no TRL, so the benchmark exercises exactly what the trainer runs.

Long phases need one more change. With a static cache transformers' compiled SDPA decode step copies the whole cache
once per query head (`repeat_kv`, grouped-query models), so the step cost grows with the cache length, not with the
tokens written so far: at the seed's reset-4 cache (64 x 6,656) the compiled path was 0.9x TRL's default.
`use_gqa_decode_attention` registers an SDPA variant that attends on the key/value heads directly for one-token steps
(3.5x TRL's default there); `configure_trainer_generation` switches the policy to it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig

STATIC_CACHE = "static"
GQA_DECODE_ATTENTION = "sdpa_gqa_decode"
# Each phase (and eval) compiles the decode step anew; torch's default of 8 recompilations per code object would
# silently fall back to eager after a few phases.
MIN_RECOMPILE_LIMIT = 64


def default_compile_config(mode: str = "reduce-overhead") -> CompileConfig:
    """The decode-step compile settings: static shapes (one graph per phase), CUDA graphs, graph breaks allowed."""
    return CompileConfig(fullgraph=False, dynamic=False, mode=mode)


def raise_recompile_limit(minimum: int = MIN_RECOMPILE_LIMIT) -> int:
    """Raise `torch._dynamo.config.recompile_limit` to at least `minimum` (never lowers it); returns the new limit."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, minimum)
    return torch._dynamo.config.recompile_limit


def enable_compiled_generation(
    generation_config: GenerationConfig,
    max_cache_len: int | None = None,
    compile_config: CompileConfig | None = None,
) -> GenerationConfig:
    """Switch `generation_config` (in place) to the static-cache, compiled-decode path; returns it.

    Args:
        generation_config: the config `generate` receives (TRL: `trainer.generation_config`).
        max_cache_len: static cache length, i.e. the longest padded prompt plus `max_new_tokens`. `None` sizes the
            cache per call (then every longer prompt costs a recompilation).
        compile_config: `torch.compile` settings; default `default_compile_config()`.
    """
    max_new_tokens = generation_config.max_new_tokens
    if max_cache_len is not None and max_new_tokens is not None and max_cache_len <= max_new_tokens:
        raise ValueError(
            f"max_cache_len={max_cache_len} leaves no room for the prompt: it must exceed max_new_tokens="
            f"{max_new_tokens} by the longest prompt (in tokens). Pass prompt budget + max_completion_length."
        )
    if generation_config.use_cache is False:
        raise ValueError("Compiled generation needs the KV cache: `use_cache=False` is set on the generation config.")
    generation_config.cache_implementation = STATIC_CACHE
    generation_config.disable_compile = False
    generation_config.compile_config = compile_config or default_compile_config()
    generation_config.max_cache_len = max_cache_len
    raise_recompile_limit()
    return generation_config


def configure_trainer_generation(
    trainer: Any,
    max_prompt_length: int | None = None,
    compile_config: CompileConfig | None = None,
    require_accelerator: bool = True,
) -> bool:
    """Make a trl 1.16 `GRPOTrainer` generate through the compiled static-cache path; returns whether it did.

    Call it after `GRPOTrainer.__init__`, and again whenever `max_completion_length` changes (a phase start): the cache
    length follows `trainer.max_completion_length`. It does nothing (returns False) with vLLM or continuous batching
    (they have their own engines) and, unless `require_accelerator=False`, when the model is not on CUDA/XPU, where
    transformers would not compile and a static cache only costs memory.

    Args:
        trainer: a `trl.GRPOTrainer` (or subclass) on its transformers generation path.
        max_prompt_length: longest prompt in tokens (after the chat template). Reserving it in the cache gives one
            compilation per phase; `None` lets the cache grow with the longest prompt seen so far.
        compile_config: `torch.compile` settings; default `default_compile_config()`.
        require_accelerator: skip on CPU (default). Tests set False (with a `CompileConfig` whose
            `_compile_all_devices` is set) to exercise the path on CPU.
    """
    if getattr(trainer, "use_vllm", False) or getattr(trainer, "use_transformers_continuous_batching", False):
        return False
    generation_config = getattr(trainer, "generation_config", None)
    if not isinstance(generation_config, GenerationConfig):
        raise RuntimeError(
            "trainer.generation_config is missing: this helper targets trl 1.16's GRPOTrainer transformers path "
            "(it reads `trainer.generation_config`, built in GRPOTrainer.__init__). Check the installed TRL version."
        )
    if require_accelerator and trainer.accelerator.device.type not in ("cuda", "xpu"):
        return False
    if max_prompt_length is not None and max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be a positive number of tokens, got {max_prompt_length}.")
    max_completion_length = trainer.max_completion_length
    generation_config.max_new_tokens = max_completion_length
    max_cache_len = None if max_prompt_length is None else max_prompt_length + max_completion_length
    enable_compiled_generation(generation_config, max_cache_len=max_cache_len, compile_config=compile_config)
    # With a static cache every compiled decode step would otherwise copy the whole cache once per query head
    # (benchmarks/results/generation.md: 0.9x -> 3.5x TRL's default path at the seed's reset-4 cache of 6,656 tokens).
    use_gqa_decode_attention(trainer.accelerator.unwrap_model(trainer.model))
    # TRL keeps the same settings as a dict (used only on transformers < 5); keep the two in agreement.
    generation_kwargs = getattr(trainer, "generation_kwargs", None)
    if isinstance(generation_kwargs, dict):
        generation_kwargs["cache_implementation"] = STATIC_CACHE
        generation_kwargs["max_new_tokens"] = max_completion_length
    return True


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
    dropout, position biases, per-head masks) goes to transformers' own `sdpa_attention_forward` unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
        return sdpa_attention_forward(
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
    """Switch `model` (a transformers model, or a PEFT model around one) from "sdpa" to `sdpa_gqa_decode_forward`.

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
    if implementation != "sdpa" or not hasattr(base, "set_attn_implementation"):
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
