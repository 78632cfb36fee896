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

Long phases also need grouped-query decode attention (`prorl_trl.rollout.gqa_attention`), which
`configure_trainer_generation` switches the policy to.
"""

from __future__ import annotations

from typing import Any

from transformers import CompileConfig, GenerationConfig

from .gqa_attention import use_gqa_decode_attention

STATIC_CACHE = "static"
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


