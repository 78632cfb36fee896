"""Whole GRPO training steps at the seed's Initial-phase shape: vanilla GRPOTrainer, `compiled_generation`, the engine.

    python benchmarks/step_time.py --out steps.md     # one GPU: Qwen2-0.5B architecture (random init, bf16)
    python benchmarks/step_time.py --smoke            # CPU, tiny model (the engine forced on, graphs off): runs

Paths, each a fresh model with the same init, one after another in this process (peak memory reset between them):
  rollout_engine       ProRLTrainer, `rollout_engine: true` (+ `compiled_generation` as the recipe sets it)
  compiled_generation  ProRLTrainer, `compiled_generation: true` (today's recipe default before the engine)
  vanilla              GRPOTrainer with TRL's defaults (eager `generate`, dynamic cache)
Shape: the GSM8K recipe's Initial phase (recipes/prorl_gsm8k_qwen2_0.5b.yaml): 2 prompts x 16 samples, LoRA r32 on
q,k, top_p 0.7, micro-batch 16 x grad-accum 2, gradient checkpointing, bf16 weights; prompts of `--prompt-tokens`
tokens (also the static cache's prompt budget), every completion forced to the cap (`min_new_tokens`, a random model
never stops). Vanilla's eager step takes minutes at 4,096 tokens (257 s on an H200): `--vanilla-cap` runs it at a
shorter cap and the table states what is measured and what is extrapolated (per-token generation time x 4,096 plus
the measured training time of the engine's step).
Step time = from one step's start to the next (generation, rewards, loss, backward, optimizer, logging); the first
step includes compilation/capture. Generation seconds are timed around each `generate` / engine call.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_RECIPE, device_name, publish, utc_now  # first: the repository on sys.path

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from memory import GRPO_FIELDS, PHASE_TO_GRPO, load_settings, lora_for, prompt_dataset  # noqa: E402
from prorl_trl.config import ProRLConfig, resolve_phases  # noqa: E402
from prorl_trl.rollout.trl_generation import attach_rollout_engine  # noqa: E402
from prorl_trl.tiny import build_tiny_tokenizer  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402
from trainer_gpu import StepTimer, build_model  # noqa: E402

PATHS = ("rollout_engine", "compiled_generation", "vanilla")


def timed_calls(owner, name: str, sink: list[float], device: torch.device) -> None:
    """Wrap `owner.<name>` so each call's wall time (CUDA-synchronised) is appended to `sink`."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        sink.append(time.perf_counter() - start)
        return result

    setattr(owner, name, wrapper)


@torch.no_grad()
def hard_reset_timed(trainer, index: int, device: torch.device) -> float:
    """Give the adapter a trained-looking B, then time one `hard_reset()` (device-synchronised): the resets a run has
    behind it when its later phases start (`--frozen-resets`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(index)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    trainer.hard_reset(reason="benchmark")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_path(path: str, options, device: torch.device, tokenizer, workdir: str) -> dict:
    cap = options.vanilla_cap if path == "vanilla" and options.vanilla_cap else None
    overrides = list(options.set) + ([f"training.max_completion_length={cap}"] if cap else [])
    recipe, kwargs = load_settings(options.recipe, overrides, options.smoke, options.steps, workdir)
    kwargs["phases"] = kwargs["phases"][:1]  # the Initial phase
    if cap:
        kwargs["phases"][0]["max_completion_length"] = cap
    prompt_tokens = options.prompt_tokens or (16 if options.smoke else 256)
    kwargs["generation_max_prompt_length"] = prompt_tokens
    kwargs["rollout_engine"] = path == "rollout_engine"
    kwargs["compiled_generation"] = path != "vanilla"
    kwargs["save_merged_on_reset"] = False  # a reset's own time; the merged save is a disk write (trainer_gpu.py)
    kwargs["lora_reset_mode"] = options.lora_reset_mode
    args = ProRLConfig(**kwargs)
    phase = resolve_phases(args, recipe.peft_config())[0]
    kwargs["generation_kwargs"] = dict(kwargs.get("generation_kwargs") or {}, min_new_tokens=phase.max_completion_length)
    args = ProRLConfig(**kwargs)
    dataset = prompt_dataset(tokenizer, prompt_tokens)
    timer, generate_seconds = StepTimer(device), []
    model = build_model(options.smoke, tokenizer, device)
    if path == "vanilla":
        grpo_kwargs = {k: v for k, v in kwargs.items() if k in GRPO_FIELDS and k != "steps_per_generation"}
        grpo_kwargs.update({name: getattr(phase, name) for name in PHASE_TO_GRPO}, max_steps=phase.max_steps)
        trainer = GRPOTrainer(model=model, reward_funcs=recipe.reward_functions(), args=GRPOConfig(**grpo_kwargs),
                              train_dataset=dataset, processing_class=tokenizer, peft_config=lora_for(phase),
                              callbacks=[timer])  # fmt: skip
    else:
        trainer = ProRLTrainer(model=model, reward_funcs=recipe.reward_functions(), args=args, train_dataset=dataset,
                               processing_class=tokenizer, peft_config=recipe.peft_config(), callbacks=[timer])  # fmt: skip
        if path == "rollout_engine" and trainer.rollout_engine is None and options.smoke:
            trainer.rollout_engine = attach_rollout_engine(trainer, allow_cpu=True)  # exercise it on CPU
    reset_seconds = [hard_reset_timed(trainer, reset, device) for reset in range(options.frozen_resets)]
    if getattr(trainer, "rollout_engine", None) is not None:
        timed_calls(trainer.rollout_engine, "generate", generate_seconds, device)
    else:
        timed_calls(trainer.model, "generate", generate_seconds, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    engine = getattr(trainer, "rollout_engine", None)
    result = {
        "path": path, "cap": phase.max_completion_length, "batch": phase.generation_batch_size,
        "resets": options.frozen_resets, "reset_seconds": reset_seconds,
        "lora_reset_mode": args.lora_reset_mode,
        "step_seconds": timer.times, "generate_seconds": generate_seconds,
        "mean_completion_length": max((e["completions/mean_length"] for e in trainer.state.log_history
                                       if "completions/mean_length" in e), default=None),
        "engine": None if engine is None else {"captures": engine.stats.captures,
                                               "capture_seconds": engine.stats.capture_seconds,
                                               "compile_error": engine.stats.compile_error},
    }  # fmt: skip
    if device.type == "cuda":
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    del trainer, model
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"[step_time] {json.dumps(result)}", flush=True)
    return result


def table(meta: dict, results: list[dict]) -> str:
    by_path = {r["path"]: r for r in results if "error" not in r}
    engine = by_path.get("rollout_engine")
    lines = [
        f"Device: {meta['device']} | {meta['date']} | torch {meta['torch']} | Initial phase of the GSM8K recipe, "
        f"{meta['prompt_tokens']}-token prompts, completions forced to the cap",
        "",
        "| path | cap | steps | first step (s) | steady step (s), median | generation (s/step, steady) | "
        "training rest (s/step) | peak alloc / reserved (GiB) | x vanilla (steady) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    vanilla = by_path.get("vanilla")
    vanilla_steady = None
    if vanilla and vanilla["step_seconds"]:
        gen = statistics.median(vanilla["generate_seconds"][1:] or vanilla["generate_seconds"])
        rest = None if engine is None else statistics.median(engine["step_seconds"][1:] or engine["step_seconds"]) - \
            statistics.median(engine["generate_seconds"][1:] or engine["generate_seconds"])
        target_cap = engine["cap"] if engine else vanilla["cap"]
        if rest is not None:
            vanilla_steady = gen * target_cap / vanilla["cap"] + rest
    for r in results:
        if "error" in r:
            lines.append(f"| {r['path']} | failed: {r['error']} |" + " |" * 7)
            continue
        steady = r["step_seconds"][1:] or r["step_seconds"]
        steady_gen = r["generate_seconds"][1:] or r["generate_seconds"]
        step, gen = statistics.median(steady), statistics.median(steady_gen)
        ratio = f"{vanilla_steady / step:.1f}" if vanilla_steady and r["path"] != "vanilla" else "-"
        peak = f"{r['peak_allocated_gib']:.2f} / {r['peak_reserved_gib']:.2f}" if "peak_allocated_gib" in r else "-"
        label = r["path"] + (f", after {r['resets']} {r['lora_reset_mode']} resets" if r.get("resets") else "")
        lines.append(
            f"| {label} | {r['cap']} | {len(r['step_seconds'])} | {r['step_seconds'][0]:.1f} | {step:.1f} | "
            f"{gen:.1f} | {step - gen:.1f} | {peak} | {ratio} |"
        )
    if vanilla_steady:
        lines += ["", f"vanilla at cap {engine['cap']} (extrapolated): {vanilla_steady:.0f} s/step = its measured "
                  f"generation time per token at cap {vanilla['cap']} x {engine['cap']} tokens + the engine run's "
                  "measured non-generation time per step."]  # fmt: skip
    for r in results:
        if r.get("reset_seconds"):
            times = ", ".join(f"{t:.2f}" for t in r["reset_seconds"])
            lines.append(f"{r['path']}: hard_reset() took {times} s ({r['lora_reset_mode']}, no merged save)")
    for r in results:
        if r.get("engine"):
            lines.append(f"rollout_engine: {r['engine']['captures']} capture(s), {r['engine']['capture_seconds']:.1f} s "
                         f"capture+compile in all; compile error: {r['engine']['compile_error']}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and shapes: checks the script runs")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma separated, from {PATHS}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per path (the first one warms up)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length and prompt budget (256)")
    parser.add_argument("--vanilla-cap", type=int, default=None, help="run vanilla at this completion cap instead")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip the paths left after this many seconds")
    parser.add_argument("--frozen-resets", type=int, default=0,
                        help="ProRLTrainer paths: hard resets (a trained-looking adapter each) before the timed steps")
    parser.add_argument("--lora-reset-mode", default="frozen", choices=["frozen", "merge"])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    paths = [p for p in options.paths.split(",") if p]
    if set(paths) - set(PATHS):
        parser.error(f"--paths: unknown {sorted(set(paths) - set(PATHS))}; choose from {PATHS}")
    if options.smoke:
        options.set = ["training.max_completion_length=6", "training.per_device_train_batch_size=4",
                       "training.generation_batch_size=8", "training.num_generations=4", "training.bf16=false",
                       "training.use_cpu=true", "peft.r=4", "peft.lora_alpha=8"] + options.set  # fmt: skip
        options.steps = min(options.steps, 2)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    device = torch.device("cpu") if options.smoke else torch.device("cuda", torch.cuda.current_device())
    meta = {
        "device": device_name(device, cpu="CPU (smoke)"), "date": utc_now(),
        "torch": torch.__version__, "prompt_tokens": options.prompt_tokens or (16 if options.smoke else 256),
    }  # fmt: skip
    tokenizer, results, start = build_tiny_tokenizer(), [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prorl-steps-") as workdir:
        for path in paths:
            if time.perf_counter() - start > options.budget_s:
                results.append({"path": path, "error": "skipped: --budget-s reached"})
                continue
            try:
                results.append(run_path(path, options, device, tokenizer, workdir))
            except Exception as error:  # one failing path must not hide the others' numbers
                results.append({"path": path, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
                print(f"[step_time] {path} FAILED: {results[-1]['error']}", flush=True)
    publish(table(meta, results), options.out, options.json, {"meta": meta, "results": results})
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()
