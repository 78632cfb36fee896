"""Rollout throughput (tokens/s) for the Qwen2-0.5B architecture on TRL's generation paths, and the decode limit.

Methods (each reproduces what `trl==1.16.0` `GRPOTrainer._generate_single_turn` runs, in plain transformers, so the
GPU machine needs no TRL):
  trl_default          `model.generate(generation_config=GenerationConfig(**generation_kwargs, disable_compile=True))`
                       under `torch.no_grad()`, model in train mode: dynamic KV cache, eager decode steps.
  static_compile       the same config after `prorl_trl.rollout.compiled.enable_compiled_generation` (static cache sized
                       prompt + completion, `torch.compile(mode="reduce-overhead", dynamic=False)` of the decode step).
  static_compile_gqa   static_compile with `prorl_trl.rollout.gqa_attention.use_gqa_decode_attention` (decode steps attend on the
                       KV heads instead of copying them per query head).
  static_compile_top_p1  diagnostic: static_compile without top-p (no vocabulary sort per step).
  rollout_engine       `prorl_trl.rollout.engine.RolloutEngine.generate` (what `ProRLConfig.rollout_engine` runs in the
                       trainer): prefill + compiled decode steps replayed as CUDA graphs, sort-free sampling. Its rows
                       add the capture/compile time and, from replays of its graph, GPU vs host milliseconds per step
                       and (`--profile`) the kernels that take the GPU time.
  rollout_engine_unfused  A/B: rollout_engine with `lora_decode.FUSE_LORA` off (PEFT's LoRA modules called as modules).
  rollout_engine_separate  A/B: rollout_engine with `fused_weights.FUSE_BASE` off (q/k/v and gate/up base projections
                       as separate GEMMs).
  rollout_engine_autotune  A/B: rollout_engine compiled with inductor's `max_autotune_gemm` (benchmarked GEMMs).
  rollout_engine@P[+Q]  A/B: any rollout_engine method compiled with the inductor options of presets P, Q from
                       `INDUCTOR_PRESETS` (e.g. `rollout_engine@pdl+nocombo`: programmatic dependent launch, no
                       combo kernels).
  rollout_engine_unfused_mlp  A/B: rollout_engine with `fused_mlp.FUSED_MLP` off (the gated MLP's gate/up GEMM,
                       their LoRA B products and SiLU(gate) * up as separate kernels where gate/up carry adapters).
  rollout_engine_fixed_splits  A/B: rollout_engine with `decode_attention.LIVE_SPLITS` off (attention's splits over
                       fixed column ranges of the cache instead of equal shares of each row's live keys).
  rollout_engine_unfolded  A/B: rollout_engine with `lora_decode.FOLD_LORA_A` off (the adapters' A products as an
                       inductor reduction instead of extra rows of the base GEMM).
  rollout_engine_torch_race  A/B: rollout_engine with `sampler.RACE_KERNEL` off (sampling after top-p as compiled
                       torch ops: masked scores, 32-bit noise and a chunked argmax, instead of `race_triton`'s kernel).
  rollout_engine_torch_softmax  A/B: rollout_engine with `sampler.SOFTMAX_KERNEL` off (the softmax before top-p as
                       compiled torch ops on float32 logits instead of `softmax_triton`'s kernels).
  rollout_engine_no_prefetch  A/B: rollout_engine with `top_p_triton.PREFETCH` and `race_triton.PREFETCH` off (each
                       block's load waits instead of overlapping the previous block's arithmetic).
  rollout_engine_default_pool  A/B: rollout_engine with `arena.PRIVATE_POOL` off (the generation arena in the caching
                       allocator's default pool, cached between generations, instead of given back to the driver).
  rollout_engine_ieee_mlp_lora  A/B: rollout_engine with `fused_mlp.LORA_PRECISION` "ieee" (the LoRA delta products
                       of the fused MLP and `lora_epilogue` kernels in IEEE float32 on CUDA cores instead of three bf16
                       tensor-core products of the operands' high and low parts).
  rollout_engine_tf32x3_lora  A/B: rollout_engine with `fused_mlp.LORA_PRECISION` "tf32x3" (those products as three
                       TF32 tensor-core products, the engine's form before 2026-11-30).
  rollout_engine_epilogue_all  A/B: rollout_engine with `lora_epilogue.MIN_RANK` 1 (every folded group's B products in
                       `lora_epilogue`'s kernel, the r32 groups included, instead of inductor's reductions there).
  rollout_engine_lora_reductions  A/B: rollout_engine with `lora_epilogue.LORA_EPILOGUE` off (a folded group's LoRA B
                       products, additions and rounding as inductor's reductions instead of `lora_epilogue`'s kernel).
  rollout_engine_parts_apart  A/B: rollout_engine with `lora_decode.JOIN_FROZEN` off (in `lora_epilogue`'s kernel,
                       each frozen part of an earlier reset its own factor instead of a module's parts as one).
  rollout_engine_a_reductions  A/B: rollout_engine with `lora_a_product.A_PRODUCT_KERNEL` off (the A products that
                       do not fold into a GEMM, gate/up's, as inductor's reduction fused with the norm before it instead
                       of `lora_a_product`'s kernel).
  continuous_batching  `model.generate_batch(prompt_ids, generation_config=..., continuous_batching_config=
                       ContinuousBatchingConfig(max_memory_percent=0.5))` as TRL's `use_transformers_continuous_batching`.
Continuous batching runs last for each model: it reserves half the free GPU memory for its paged cache.

The model is random (no download), so lengths are fixed with `min_new_tokens = max_new_tokens`. Each (shape, model,
method) is called once to warm up (allocator growth, compilation, CUDA-graph capture), then `--repeats` times; the
steady figure is the median. The first call's extra time is reported as the compile/first-call overhead and amortised
over a phase of `--phase-steps` generations (shapes are fixed within a phase). On CUDA each method runs in a process of
its own (`--isolate`, the default there): an engine compiled after another in the same process ran 2-9 % slower on an
H100 (benchmarks/results/rollout_engine.md, 2026-11-27, commit 1216db5), which biased A/B rows. Those processes share
inductor's on-disk cache, so they share its compile-time kernel choices; one compile's choice for one kernel moved the
Initial shape's row by up to 6 % on an H200 (2026-11-30, rollout_engine.md), so `--fresh-compiles K` runs every method
K times, each process compiling from an empty cache, and reports the spread.

Decode limit: each decode step must read every weight once and the K/V of every cached token; that many bytes over the
bandwidth of a large device-to-device copy (bytes read + written) is the floor, and tokens / floor the limit.

    python benchmarks/generation.py                      # one GPU: the full table (markdown) on stdout
    python benchmarks/generation.py --smoke              # CPU, tiny model, a few tokens (< 30 s)
    python benchmarks/generation.py --from-json a.json b.json   # one table from several runs' --json files
    python benchmarks/generation.py --shapes 32x4096 --methods rollout_engine,rollout_engine_unfused_mlp --fresh-compiles 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import device_name, int_list, publish, read_runs, synchronize, utc_now  # first: the repository on sys.path

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from prorl_trl.rollout.compiled import enable_compiled_generation  # noqa: E402
from prorl_trl.rollout.gqa_attention import kv_cache_bytes_per_token, use_gqa_decode_attention  # noqa: E402

METHODS = (
    "trl_default",
    "static_compile",
    "static_compile_gqa",
    "static_compile_top_p1",
    "continuous_batching",
    "rollout_engine",
    "rollout_engine_unfused",
    "rollout_engine_separate",
    "rollout_engine_autotune",
    "rollout_engine_unfused_mlp",
    "rollout_engine_fixed_splits",
    "rollout_engine_unfolded",
    "rollout_engine_torch_race",
    "rollout_engine_torch_softmax",
    "rollout_engine_no_prefetch",
    "rollout_engine_default_pool",
    "rollout_engine_ieee_mlp_lora",
    "rollout_engine_lora_reductions",
    "rollout_engine_parts_apart",
    "rollout_engine_a_reductions",
    "rollout_engine_tf32x3_lora",
    "rollout_engine_epilogue_all",
)
# Inductor options an engine method takes after '@' (joined with '+'), for A/B rows without a new method each.
INDUCTOR_PRESETS = {
    "autotune": {"max_autotune_gemm": True},  # benchmarked GEMM choices
    "pdl": {"triton.enable_pdl": True},  # Hopper programmatic dependent launch: a kernel's prologue overlaps the last
    "combo": {"combo_kernels": True},  # independent small kernels (e.g. q's and k's LoRA B products) as one launch
    "coordinate": {"coordinate_descent_tuning": True},  # tuned block sizes for the pointwise/reduction kernels
    "nocombo": {"combo_kernels": False},  # the engine's default combo kernels off
    "nopdl": {"triton.enable_pdl": False},  # the engine's default programmatic dependent launch off
    "aggressive": {"aggressive_fusion": True},  # fuse nodes that share no reads
    "deterministic": {"deterministic": True},  # no on-device benchmarking of kernel configs: chosen by heuristics
}
QWEN2_05B_EOS, QWEN2_05B_PAD = 151645, 151643


def qwen2_05b_config() -> Qwen2Config:
    """Qwen2-0.5B(-Instruct)'s architecture; weights are random."""
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        max_window_layers=24,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=QWEN2_05B_PAD,
        eos_token_id=QWEN2_05B_EOS,
        pad_token_id=QWEN2_05B_PAD,
    )


def build_model(
    smoke: bool,
    device: torch.device,
    dtype: torch.dtype,
    lora_rank: int,
    lora_targets: str = "q_proj,k_proj",
    frozen_resets: int = 0,
    frozen_rank: int | None = None,
    frozen_targets: str | None = None,
    frozen_joined: bool = False,
):
    """`(model, eos_token_id, pad_token_id)`: random Qwen2-0.5B (or the tiny test model), optionally LoRA-wrapped.

    LoRA mirrors the trainer: `get_peft_model` (adapter weights upcast to fp32, PEFT's default) and
    `enable_input_require_grads` (TRL does it for PEFT + gradient checkpointing); adapters stay unmerged.
    `frozen_resets`: that many hard resets already behind it, as `lora_reset_mode: frozen` leaves them (each phase's
    adapter, given a trained-looking B, kept as a frozen part of rank `lora_rank` on its base layers; a fresh adapter
    with a trained-looking B on top). `frozen_rank` / `frozen_targets`: the earlier phases' adapter shape where it
    differs (the GSM8K recipe's reset-4: four r32 q,k phases behind an r64 all-linear adapter); the last reset then
    gives the adapter the live shape, as the trainer's reset into that phase does. `frozen_joined`: each reset joins
    a layer's parts into one (`consolidate_frozen_parts`), without room.
    """
    if smoke:
        from prorl_trl.tiny import build_tiny

        model, tokenizer = build_tiny(seed=0)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    else:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(qwen2_05b_config())
        eos, pad = QWEN2_05B_EOS, QWEN2_05B_PAD
    model = model.to(device=device, dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        def target_list(targets: str) -> str | list[str]:
            return "all-linear" if targets == "all-linear" else targets.split(",")

        first_rank = frozen_rank if frozen_resets and frozen_rank else lora_rank
        first_targets = frozen_targets if frozen_resets and frozen_targets else lora_targets
        lora = LoraConfig(r=first_rank, lora_alpha=2 * first_rank, target_modules=target_list(first_targets))
        model = get_peft_model(model, lora)
        model.enable_input_require_grads()
        for reset in range(frozen_resets + 1):
            if reset:
                from prorl_trl.reset import freeze_lora_delta, reinit_adapter

                freeze_lora_delta(model, consolidate=frozen_joined)
                if reset == frozen_resets and (first_rank, first_targets) != (lora_rank, lora_targets):
                    reinit_adapter(model, r=lora_rank, lora_alpha=2 * lora_rank,
                                   target_modules=target_list(lora_targets), seed=reset)  # fmt: skip
                else:
                    reinit_adapter(model, seed=reset)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(reset)
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(std=1e-3)
    model.train()  # TRL generates inside `training_step`, after `model.train()`
    return model, eos, pad


def trl_generation_config(args, max_new_tokens: int, eos: int, pad: int, top_p: float) -> GenerationConfig:
    """`GRPOTrainer.generation_config` as trl 1.16 builds it, with `generation_kwargs={"min_new_tokens": N}`."""
    generation_kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": True,
        "pad_token_id": pad,
        "bos_token_id": None,
        "eos_token_id": [eos],
        "temperature": args.temperature,
        "top_p": top_p,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "cache_implementation": None,
    }
    generation_kwargs.update({"min_new_tokens": max_new_tokens})  # GRPOConfig.generation_kwargs: fixed lengths
    return GenerationConfig(**generation_kwargs, disable_compile=True)


def make_prompts(num_prompts: int, num_generations: int, prompt_length: int, vocab: int, device, pad: int):
    """Left-padded prompt batch like TRL's: `num_prompts` random prompts (lengths prompt_length, prompt_length - 1/8),
    each repeated `num_generations` times. Returns (input_ids, attention_mask, list of unpadded id lists)."""
    generator = torch.Generator().manual_seed(1)
    lengths = [prompt_length - (i % 2) * (prompt_length // 8) for i in range(num_prompts)]
    prompts = [torch.randint(0, min(vocab, QWEN2_05B_PAD) - 1, (n,), generator=generator).tolist() for n in lengths]
    rows = [p for p in prompts for _ in range(num_generations)]
    input_ids = torch.full((len(rows), prompt_length), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, prompt_length - len(row) :] = torch.tensor(row)
        attention_mask[i, prompt_length - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device), rows


def split_presets(method: str) -> tuple[str, dict | None]:
    """`"rollout_engine@pdl+combo"` -> ("rollout_engine", the presets' inductor options merged); no '@': no options."""
    base, _, names = method.partition("@")
    if not names:
        return base, None
    unknown = [name for name in names.split("+") if name not in INDUCTOR_PRESETS]
    if unknown or not base.startswith("rollout_engine"):
        raise SystemExit(
            f"--methods: {method!r}: presets go after a rollout_engine method, from {sorted(INDUCTOR_PRESETS)}"
        )
    options: dict = {}
    for name in names.split("+"):
        options.update(INDUCTOR_PRESETS[name])
    return base, options


def prefetch_switches() -> tuple[bool, bool] | None:
    """`(top_p_triton.PREFETCH, race_triton.PREFETCH)`, None without Triton (both are Triton modules)."""
    from prorl_trl.rollout.decode_attention import triton_available

    if not triton_available():
        return None
    from prorl_trl.rollout import race_triton, top_p_triton

    return top_p_triton.PREFETCH, race_triton.PREFETCH


def set_prefetch(values: tuple[bool, bool] | None) -> None:
    """Set both switches (read at each launch: an engine captured with them off replays without prefetching)."""
    if values is not None:
        from prorl_trl.rollout import race_triton, top_p_triton

        top_p_triton.PREFETCH, race_triton.PREFETCH = values


def make_runner(method: str, model, args, shape, eos: int, pad: int, device):
    """A zero-argument callable that generates once and returns the number of new tokens."""
    num_sequences, max_new_tokens = shape
    input_ids, attention_mask, rows = make_prompts(
        args.num_prompts, num_sequences // args.num_prompts, args.prompt_length, model.config.vocab_size, device, pad
    )
    top_p = 1.0 if method == "static_compile_top_p1" else args.top_p
    config = trl_generation_config(args, max_new_tokens, eos, pad, top_p)
    if method.startswith("rollout_engine"):
        from prorl_trl.rollout import (arena, decode_attention, fused_mlp, fused_weights, lora_a_product, lora_decode,
                                       lora_epilogue, sampler)  # fmt: skip
        from prorl_trl.rollout.engine import RolloutEngine

        cache_len = max(args.cache_len or 0, args.prompt_length + max_new_tokens)
        method, options = split_presets(method)
        if method == "rollout_engine_autotune":
            options = {**(options or {}), **INDUCTOR_PRESETS["autotune"]}
        engine = RolloutEngine(prompt_budget=cache_len - max_new_tokens, compile_options=options)

        def run_engine() -> int:
            switches = (lora_decode.FUSE_LORA, fused_weights.FUSE_BASE, fused_mlp.FUSED_MLP, fused_mlp.LORA_PRECISION,
                        decode_attention.LIVE_SPLITS, lora_decode.FOLD_LORA_A, sampler.RACE_KERNEL,
                        sampler.SOFTMAX_KERNEL, arena.PRIVATE_POOL, lora_epilogue.LORA_EPILOGUE,
                        lora_decode.JOIN_FROZEN, lora_a_product.A_PRODUCT_KERNEL, lora_epilogue.MIN_RANK,
                        prefetch_switches())  # fmt: skip
            lora_epilogue.LORA_EPILOGUE = method != "rollout_engine_lora_reductions" and lora_epilogue.LORA_EPILOGUE
            fused_mlp.LORA_PRECISION = {"rollout_engine_ieee_mlp_lora": "ieee",
                                        "rollout_engine_tf32x3_lora": "tf32x3"}.get(method, fused_mlp.LORA_PRECISION)
            lora_decode.FUSE_LORA = method != "rollout_engine_unfused"  # the A/B switches
            arena.PRIVATE_POOL = method != "rollout_engine_default_pool" and arena.PRIVATE_POOL
            fused_weights.FUSE_BASE = method != "rollout_engine_separate"
            fused_mlp.FUSED_MLP = method != "rollout_engine_unfused_mlp" and fused_mlp.FUSED_MLP
            decode_attention.LIVE_SPLITS = method != "rollout_engine_fixed_splits" and decode_attention.LIVE_SPLITS
            lora_decode.FOLD_LORA_A = method != "rollout_engine_unfolded" and lora_decode.FOLD_LORA_A
            lora_decode.JOIN_FROZEN = method != "rollout_engine_parts_apart" and lora_decode.JOIN_FROZEN
            lora_a_product.A_PRODUCT_KERNEL = (method != "rollout_engine_a_reductions"
                                               and lora_a_product.A_PRODUCT_KERNEL)  # fmt: skip
            lora_epilogue.MIN_RANK = 1 if method == "rollout_engine_epilogue_all" else lora_epilogue.MIN_RANK
            sampler.RACE_KERNEL = method != "rollout_engine_torch_race" and sampler.RACE_KERNEL
            sampler.SOFTMAX_KERNEL = method != "rollout_engine_torch_softmax" and sampler.SOFTMAX_KERNEL
            if method == "rollout_engine_no_prefetch" and switches[-1] is not None:
                set_prefetch((False, False))
            try:
                output = engine.generate(model, input_ids, attention_mask, config)
            finally:
                (lora_decode.FUSE_LORA, fused_weights.FUSE_BASE, fused_mlp.FUSED_MLP, fused_mlp.LORA_PRECISION,
                 decode_attention.LIVE_SPLITS, lora_decode.FOLD_LORA_A, sampler.RACE_KERNEL,
                 sampler.SOFTMAX_KERNEL, arena.PRIVATE_POOL, lora_epilogue.LORA_EPILOGUE,
                 lora_decode.JOIN_FROZEN, lora_a_product.A_PRODUCT_KERNEL, lora_epilogue.MIN_RANK,
                 prefetch) = switches  # fmt: skip
                set_prefetch(prefetch)
            if output.tokens.shape[1] != max_new_tokens:
                raise RuntimeError(f"generated {output.tokens.shape[1]} tokens per sequence, expected {max_new_tokens}")
            model.train()
            return output.tokens.numel()

        run_engine.engine = engine
        return run_engine
    if method.startswith("static_compile"):
        cache_len = max(args.cache_len or 0, args.prompt_length + max_new_tokens)
        enable_compiled_generation(config, max_cache_len=cache_len)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if method == "static_compile_gqa":
        if not use_gqa_decode_attention(model):
            raise RuntimeError(f"use_gqa_decode_attention did not apply ({base.config._attn_implementation})")
    elif base.config._attn_implementation != "sdpa":
        base.set_attn_implementation("sdpa")  # undo an earlier static_compile_gqa on the same model
    if method.startswith("continuous_batching"):
        from transformers.generation import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(max_memory_percent=0.5)  # TRL's training-aware default

        def run() -> int:
            with torch.no_grad():
                outputs = model.generate_batch(
                    rows, generation_config=config, continuous_batching_config=cb_config, progress_bar=False
                )
            model.train()
            return sum(len(output.generated_tokens) for output in outputs.values())

        return run

    def run() -> int:
        with torch.no_grad():
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        new_tokens = output.shape[1] - input_ids.shape[1]
        if new_tokens != max_new_tokens:
            raise RuntimeError(f"generated {new_tokens} tokens per sequence, expected {max_new_tokens}")
        return output.shape[0] * new_tokens

    return run


def timed(run, device) -> tuple[float, int]:
    synchronize(device)
    start = time.perf_counter()
    tokens = run()
    synchronize(device)
    return time.perf_counter() - start, tokens


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written (random data)."""
    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    repeats, samples = 10, []
    for _ in range(3):
        seconds, _ = timed(lambda: [target.copy_(source) for _ in range(repeats)], device)
        samples.append(2 * num_bytes * repeats / seconds)
    del source, target
    return statistics.median(samples)


def decode_floor_seconds(weight_bytes: int, kv_bytes: int, shape, prompt_length: int, bandwidth: float) -> float:
    """Least time to generate: per token position, read all weights once and the K/V of every cached token."""
    num_sequences, max_new_tokens = shape
    cached_tokens = num_sequences * sum(prompt_length + step for step in range(max_new_tokens))
    return (max_new_tokens * weight_bytes + cached_tokens * kv_bytes) / bandwidth


def measure(method, model, args, shape, eos, pad, device, weight_bytes, kv_bytes, bandwidth) -> dict:
    model_kind = "lora" if args.lora_rank_now else "base"
    if args.lora_rank_now and args.frozen_resets:
        model_kind += f", {args.frozen_resets} resets"
        if args.frozen_rank or args.frozen_targets:
            model_kind += f" of r{args.frozen_rank or args.lora_rank} {args.frozen_targets or args.lora_targets}"
        if args.frozen_joined:
            model_kind += ", joined"
    row = {"shape": f"{shape[0]}x{shape[1]}", "model": model_kind, "method": method}
    try:
        run = make_runner(method, model, args, shape, eos, pad, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if args.warmup_tokens and not method.startswith("rollout_engine"):  # their compiled shapes do not depend on the length
            warm = make_runner(method, model, args, (shape[0], args.warmup_tokens), eos, pad, device)
            first_seconds, _ = timed(warm, device)
        else:
            first_seconds, tokens = timed(run, device)
        engine = getattr(run, "engine", None)
        first_capture = engine.stats.capture_seconds if engine is not None else 0.0
        steady = []
        for index in range(args.repeats):
            if engine is not None and index == args.repeats - 1:
                engine.release_cache = False  # keep the last graph replayable for the diagnostics below
            steady.append(timed(run, device))
        if not steady:
            raise RuntimeError("--repeats must be >= 1")
    except Exception as error:  # one failing path must not hide the others' numbers
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        print(f"  {method} failed in full:\n{str(error)[-6000:]}", file=sys.stderr, flush=True)
        print(f"  {row['shape']} {row['model']} {method}: FAILED {row['error']}", flush=True)
        return row
    steady_seconds = statistics.median(seconds for seconds, _ in steady)
    tokens = statistics.median(count for _, count in steady)
    overhead = max(first_seconds - steady_seconds, 0.0)
    if args.warmup_tokens and not method.startswith("rollout_engine"):
        overhead = first_seconds  # a short warm-up call: (nearly) all of it is compilation
    if engine is not None:
        row["engine"] = engine_diagnostics(engine, first_capture, args.profile, args.replay_steps)
    floor = decode_floor_seconds(weight_bytes, kv_bytes, shape, args.prompt_length, bandwidth)
    row.update(
        tokens=tokens,
        first_seconds=first_seconds,
        steady_seconds=[round(seconds, 4) for seconds, _ in steady],
        tokens_per_s=tokens / steady_seconds,
        first_call_overhead_s=overhead,
        amortised_tokens_per_s=args.phase_steps * tokens / (args.phase_steps * steady_seconds + overhead),
        ms_per_step=1000 * steady_seconds / shape[1],
        floor_ms_per_step=1000 * floor / shape[1],
        decode_limit_tokens_per_s=tokens / floor,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )
    print(f"  {row['shape']} {row['model']} {method}: {row['tokens_per_s']:.0f} tok/s steady, first call "
          f"{first_seconds:.1f}s, steady {row['steady_seconds']}", flush=True)
    return row


REPLAYS = 8  # `engine_diagnostics`' timed graph replays
REPLAYED_STEPS = REPLAYS * 16  # the decode steps they run (the engine's default 16 a graph)


def engine_diagnostics(
    engine, first_capture_seconds: float, profile: bool, replay_steps: tuple[int, ...] = (1,)
) -> dict:
    """Capture/compile time, the last call's split, and replays of its graph: GPU vs host time per decode step and
    (`profile`) its kernels, from the first of `replay_steps` (1: a short cache); each later one (attention reads that
    many more keys) in `at_steps`."""
    last = engine.stats.last
    steps = max(last["decode_steps"], 1)
    found = {
        "capture_and_compile_s": first_capture_seconds, "captures": engine.stats.captures,
        "compile_error": engine.stats.compile_error, "prefill_s": last["prefill_seconds"],
        "decode_ms_per_step": 1000 * last["decode_seconds"] / steps,
        "host_issue_ms_per_step_in_loop": 1000 * last["host_seconds"] / steps,
    }  # fmt: skip
    if engine.stats.captures == 0:  # no CUDA graph (CPU smoke run)
        engine.release_cache = True
        engine._arena.release()
        return found
    for index, step in enumerate(replay_steps):
        at = found if index == 0 else found.setdefault("at_steps", {}).setdefault(str(step), {})
        at.update(engine.time_replays(REPLAYS, step), replay_step=step)
        if profile:
            at.update(replay_profile(engine, step))
    engine.release_cache = True
    engine._arena.release()
    print(f"    engine: {found}", flush=True)
    return found


def replay_profile(engine, step: int) -> dict:
    """Kernels of two graph replays from decode step `step`: launches a step and every kernel's microseconds a step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as profiler:
        engine.time_replays(2, step)
    steps = 2 * engine.steps_per_graph
    kernels = sorted(profiler.key_averages(), key=lambda event: -event.device_time_total)
    return {
        "kernels_per_step": sum(event.count for event in kernels) / steps,
        "top_kernels": [  # (name, microseconds per step, launches per step), every kernel (the JSON keeps them all)
            (event.key[:70], round(event.device_time_total / steps, 2), event.count / steps) for event in kernels
        ],
    }


def render(meta: dict, rows: list[dict]) -> str:
    """The markdown report: environment, decode limits, one line per (shape, model, method)."""
    lines = [
        f"Device: {meta['device']} | {meta['date']} | torch {meta['torch']} | transformers "
        f"{meta['transformers']} | peft {meta.get('peft')} | dtype {meta['dtype']} | prompts "
        f"{meta['num_prompts']} x prompt length {meta['prompt_length']} | temperature {meta['temperature']}, "
        f"top_p {meta['top_p']} | copy bandwidth {meta['bandwidth_gb_s']:.0f} GB/s (read + write) | "
        f"amortised over {meta['phase_steps']} generations per phase"
        + (f" | static cache length {meta['cache_len']}" if meta.get("cache_len") else ""),
        "",
        "| shape (seqs x new tokens) | model | method | tokens/s (steady) | x TRL default | first-call overhead "
        "(s) | tokens/s amortised | x TRL default (amortised) | ms/step | decode floor ms/step | % of decode "
        "limit | peak GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baseline = {(r["shape"], r["model"]): r for r in rows if r["method"] == "trl_default" and "error" not in r}
    for r in rows:
        method = r["method"] + (f" (compile {r['compile']})" if "compile" in r else "")
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['model']} | {method} | failed: {r['error']} |" + " |" * 8)
            continue
        base = baseline.get((r["shape"], r["model"]))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        amortised_ratio = f"{r['amortised_tokens_per_s'] / base['amortised_tokens_per_s']:.2f}" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(
            f"| {r['shape']} | {r['model']} | {method} | {r['tokens_per_s']:,.0f} | {ratio} | "
            f"{r['first_call_overhead_s']:.1f} | {r['amortised_tokens_per_s']:,.0f} | {amortised_ratio} | "
            f"{r['ms_per_step']:.2f} | {r['floor_ms_per_step']:.3f} | "
            f"{100 * r['tokens_per_s'] / r['decode_limit_tokens_per_s']:.1f} | {peak} |"
        )
    lines += compile_spread(rows)
    limits = sorted({(r["shape"], r["model"], round(r["decode_limit_tokens_per_s"])) for r in rows if "error" not in r})
    lines += ["", "Decode limit (tokens/s): " + "; ".join(f"{s} {m}: {lim:,}" for s, m, lim in limits)]
    for r in rows:
        if r.get("engine"):
            e = r["engine"]
            lines.append(
                f"rollout_engine {r['shape']} {r['model']}: capture+compile {e['capture_and_compile_s']:.1f} s, "
                f"prefill {e['prefill_s']:.2f} s, decode {e['decode_ms_per_step']:.3f} ms/step in the loop"
                + (f"; graph replays: GPU {e['gpu_ms_per_step']:.3f} ms/step, host {e['host_ms_per_step']:.4f} ms/step"
                   if "gpu_ms_per_step" in e else "; no CUDA graph")
                + (f", {e['kernels_per_step']:.0f} kernels/step" if "kernels_per_step" in e else "")
                + (f"; compile error: {e['compile_error']}" if e.get("compile_error") else "")
            )
    return "\n".join(lines)


def compile_spread(rows: list[dict]) -> list[str]:
    """Lines "Compile spread": per (shape, model, method) run with `--fresh-compiles`, the median, lowest and highest
    tokens/s over its compiles (empty without such rows)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if "compile" in r and "error" not in r:
            groups.setdefault((r["shape"], r["model"], r["method"]), []).append(r["tokens_per_s"])
    if not groups:
        return []
    return ["", "Compile spread (tokens/s over fresh compiles): " + "; ".join(
        f"{shape} {model} {method}: median {statistics.median(v):,.0f}, {min(v):,.0f}-{max(v):,.0f} ({len(v)} compiles)"
        for (shape, model, method), v in groups.items()
    )]  # fmt: skip


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        sequences, _, new_tokens = item.strip().partition("x")
        if not (sequences.isdigit() and new_tokens.isdigit()):
            raise SystemExit(f"--shapes: {item!r} is not SEQUENCESxNEW_TOKENS (e.g. 32x256)")
        shapes.append((int(sequences), int(new_tokens)))
    return shapes


def _step_list(text: str) -> tuple[int, ...]:
    """`--replay-steps`: decode steps from 1, comma separated."""
    steps = tuple(int_list(text))
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"decode steps from 1, comma separated; got {text!r}")
    return steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few tokens (for the test)")
    parser.add_argument("--shapes", default="32x256,64x256,32x1024", help="SEQSxNEW_TOKENS, comma separated")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma separated, from {METHODS}")
    parser.add_argument("--long-methods", default="trl_default,static_compile",
                        help="methods run at shapes after the first (continuous batching is slow)")
    parser.add_argument("--models", default="base,lora", help="base and/or lora (LoRA r=--lora-rank on q,k)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-targets", default="q_proj,k_proj", help="comma-separated modules, or all-linear")
    parser.add_argument("--frozen-resets", type=int, default=0,
                        help="lora: hard resets behind the adapter (lora_reset_mode frozen: a frozen part each)")
    parser.add_argument("--frozen-rank", type=int, default=None,
                        help="lora: the frozen parts' rank where it differs from --lora-rank (reset-4: 32)")
    parser.add_argument("--frozen-joined", action="store_true",
                        help="lora: join each layer's frozen parts into one at every reset (consolidate_frozen_parts)")
    parser.add_argument("--frozen-targets", default=None,
                        help="lora: the frozen parts' targets where they differ from --lora-targets "
                             "(reset-4: q_proj,k_proj)")
    parser.add_argument("--warmup-tokens", type=int, default=0,
                        help="new tokens of the warm-up call of the compiled generate paths (0: the full shape)")
    parser.add_argument("--profile", action="store_true", help="rollout_engine rows: top kernels of a graph replay")
    parser.add_argument("--replay-steps", type=_step_list, default=(1,),
                        help="rollout_engine rows: graph replays (GPU ms a step, --profile's kernels) from each of "
                             "these decode steps, comma separated; attention reads that many more keys (1: a short "
                             "cache)")
    parser.add_argument("--num-prompts", type=int, default=2, help="distinct prompts; sequences / this = group size")
    parser.add_argument("--prompt-length", type=int, default=128, help="padded prompt tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.7)
    parser.add_argument("--cache-len", type=int, default=None,
                        help="static cache length (the trainer's: generation_max_prompt_length + max_completion_length)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up call")
    parser.add_argument("--phase-steps", type=int, default=50, help="generations a compile is amortised over")
    parser.add_argument("--budget-s", type=float, default=520, help="skip what is left after this many seconds")
    parser.add_argument("--json", type=Path, help="write raw results here")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render one table from earlier --json files")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each method in a fresh process (default: on CUDA with several methods)")
    parser.add_argument("--fresh-compiles", type=int, default=0,
                        help="run each method in this many processes, each compiling from an empty inductor cache "
                             "(methods interleaved), and report the spread: one compile's kernel choices can move a "
                             "row by several percent (0: one process per method, sharing the cache)")
    args = parser.parse_args(argv)

    if args.from_json:
        runs = read_runs(args.from_json)
        publish(render(runs[0]["meta"], [row for run in runs for row in run["rows"]]), args.out)
        return {"meta": runs[0]["meta"], "rows": [row for run in runs for row in run["rows"]]}

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted({split_presets(m)[0] for m in methods} - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {METHODS}")
    if args.smoke:
        args.shapes, args.prompt_length, args.repeats, args.lora_rank = "4x6", 12, 1, 4
        methods = [m for m in methods if not m.startswith("continuous_batching")]
    shapes = parse_shapes(args.shapes)
    for sequences, new_tokens in shapes:
        if sequences % args.num_prompts:
            raise SystemExit(f"--shapes: {sequences} sequences is not a multiple of --num-prompts={args.num_prompts}")
        late = [step for step in args.replay_steps if step > 1 and step > new_tokens - REPLAYED_STEPS]
        if late:  # found before any model is built, not after a generation (time_replays would refuse them)
            raise SystemExit(f"--replay-steps: {late} start too late for {sequences}x{new_tokens}: the replays run "
                             f"{REPLAYED_STEPS} decode steps, so start at {max(1, new_tokens - REPLAYED_STEPS)} or "
                             f"earlier")  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.fresh_compiles < 0:
        raise SystemExit(f"--fresh-compiles must be >= 0, got {args.fresh_compiles}")
    if args.fresh_compiles and args.isolate is False:
        raise SystemExit("--fresh-compiles runs every method in processes of its own: drop --no-isolate")
    if args.fresh_compiles or (args.isolate if args.isolate is not None else device.type == "cuda" and len(methods) > 1):
        return run_isolated(sys.argv[1:] if argv is None else argv, methods, args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_float32_matmul_precision("high")
    bandwidth = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        peft_version = None
    meta = {
        "device": device_name(device, cpu=f"CPU ({platform.processor()})"), "date": utc_now(),
        "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft_version,
        "dtype": str(dtype).removeprefix("torch."), "num_prompts": args.num_prompts,
        "prompt_length": args.prompt_length, "temperature": args.temperature, "top_p": args.top_p,
        "bandwidth_gb_s": bandwidth / 1e9, "phase_steps": args.phase_steps, "cache_len": args.cache_len,
        "pid": os.getpid(), "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }
    print(f"# {meta}", flush=True)
    start, rows = time.perf_counter(), []
    for model_kind in [m.strip() for m in args.models.split(",") if m.strip()]:
        args.lora_rank_now = args.lora_rank if model_kind == "lora" else 0
        model, eos, pad = build_model(
            args.smoke, device, dtype, args.lora_rank_now, args.lora_targets, args.frozen_resets, args.frozen_rank,
            args.frozen_targets, args.frozen_joined
        )
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_bytes = kv_cache_bytes_per_token(model.config, dtype)
        jobs = [
            (shape, method)
            for index, shape in enumerate(shapes)
            for method in methods
            if (index == 0 or method in args.long_methods.split(","))
            and not (model_kind == "lora" and method.startswith("continuous_batching"))
        ]
        jobs.sort(key=lambda job: job[1].startswith("continuous_batching"))  # stable: CB last
        for shape, method in jobs:
            if time.perf_counter() - start > args.budget_s:
                rows.append({"shape": f"{shape[0]}x{shape[1]}", "model": model_kind, "method": method,
                             "error": "skipped: --budget-s reached"})
                continue
            rows.append(measure(method, model, args, shape, eos, pad, device, weight_bytes, kv_bytes, bandwidth))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report_of(meta, rows, args)


def report_of(meta: dict, rows: list[dict], args: argparse.Namespace) -> dict:
    """Print the table, write `--json` (raw results) and `--out` (the table) where given; return the results."""
    publish(render(meta, rows), args.out, args.json, {"meta": meta, "rows": rows})
    return {"meta": meta, "rows": rows}


def without_options(argv: list[str], names: set[str]) -> list[str]:
    """`argv` less the options in `names` (as `--name value` or `--name=value`) and any `--isolate` flag."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item.split("=", 1)[0] in names:
            skip = "=" not in item
        elif item not in ("--isolate", "--no-isolate"):
            kept.append(item)
    return kept


def isolated_jobs(methods: list[str], rounds: int) -> list[tuple[int, str]]:
    """`(round, method)` in the order `run_isolated` runs them: every method once per round, rounds one after another,
    so a drift of the machine over the call spreads over all methods alike."""
    return [(round_index, method) for round_index in range(rounds) for method in methods]


def run_isolated(argv: list[str], methods: list[str], args: argparse.Namespace) -> dict:
    """Run this script once per method (`--no-isolate`), each in a fresh process, and report their rows as one table.
    With `--fresh-compiles K`: K rounds of every method in turn, each process with an inductor cache of its own
    (`TORCHINDUCTOR_CACHE_DIR`), so each row is one draw of inductor's compile-time kernel choices; rows carry
    `compile` (the round).

    A process that fails or writes no result adds an error row for its method; the budget left is passed on."""
    rest = without_options(argv, {"--methods", "--json", "--out", "--budget-s", "--fresh-compiles"})
    started, runs = time.perf_counter(), []
    rounds = max(1, args.fresh_compiles)
    with tempfile.TemporaryDirectory() as folder:
        for index, (round_index, method) in enumerate(isolated_jobs(methods, rounds)):
            left = max(0.0, args.budget_s - (time.perf_counter() - started))
            result = Path(folder) / f"{index}.json"
            command = [sys.executable, str(Path(__file__).resolve()), *rest, "--no-isolate", "--methods", method,
                       "--json", str(result), "--budget-s", str(left)]  # fmt: skip
            env = dict(os.environ)
            if args.fresh_compiles:
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(folder) / f"inductor_{index}")
            code = subprocess.run(command, check=False, env=env).returncode
            if code == 0 and result.exists():
                runs.append(json.loads(result.read_text()))
            else:
                runs.append({"meta": None, "rows": [{"shape": "all", "model": "all", "method": method,
                                                     "error": f"its process exited with code {code}"}]})  # fmt: skip
            if args.fresh_compiles:
                for row in runs[-1]["rows"]:
                    row["compile"] = round_index + 1
    metas = [run["meta"] for run in runs if run["meta"]]
    if not metas:
        raise SystemExit("generation.py --isolate: no method's process produced a result")
    meta = {**metas[0], "pid": [m["pid"] for m in metas],  # one process per method (and compile)
            "inductor_cache": [m.get("inductor_cache") for m in metas]}  # fmt: skip
    return report_of(meta, [row for run in runs for row in run["rows"]], args)


if __name__ == "__main__":
    main()
