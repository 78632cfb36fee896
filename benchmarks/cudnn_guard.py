"""The cuDNN attention guard (`prorl_trl.attention`): does the bug reproduce here, what the probe finds, what it costs.

    python benchmarks/cudnn_guard.py --out benchmarks/results/cudnn_guard.md            # one GPU, every shape
    python benchmarks/cudnn_guard.py --shapes reset4 --json r4.json                     # one shape (another GPU)
    python benchmarks/cudnn_guard.py --shapes reset4 --lengths guarded --json g.json    # one length per GPU, then
    python benchmarks/cudnn_guard.py --report g.json u.json --out table.md              # their tables as one
    python benchmarks/cudnn_guard.py --smoke                                            # CPU: the script runs

1. Reproduction, torch only: q/k/v (bf16, the GSM8K model's 14 heads of 64) with a left-padded causal mask as
   transformers builds it, at lengths 64, 65, 192, 193: are the gradients finite with cuDNN forced, with the
   memory-efficient backend forced, and through `guarded_sdpa_attention_forward` with the guard on ("auto")?
2. The start-up probe (`probe_cudnn_backward`) at the recipe's and the study's head shapes: the remainders it finds
   failing and its time.
3. Cost, in whole `ProRLTrainer` steps (generation, rewards, loss, backward, optimizer, logging) at three shapes:
   `initial` and `reset4` (the GSM8K recipe's first and last phases: Qwen2-0.5B architecture, random init, bf16,
   the rollout engine, completions forced to the cap; `reset4` after 4 frozen resets) and `study` (the prolonged
   study's 19M model, 64 prompts x 8 completions of 48 tokens, LoRA r8 on all projections). Each shape runs twice,
   with prompts that put the padded length on a guarded remainder (64 mod 128, the worst case: "auto" acts) and one
   token longer (every other length: "auto" only checks). In one trainer the guard's mode cycles off -> auto ->
   always from step to step after a warm-up step, so the modes share the model, the graphs and the machine's state.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_RECIPE, device_name, error_line, publish, read_runs, utc_now  # first: repository on path

import torch  # noqa: E402
from memory import load_settings, prompt_dataset  # noqa: E402
from step_time import hard_reset_timed, timed_calls  # noqa: E402
from trainer_gpu import StepTimer, build_model, token_hash_reward  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from prorl_trl.attention import install_cudnn_attention_guard, probe_cudnn_backward  # noqa: E402
from prorl_trl.attention.cudnn_guard import guarded_sdpa_attention_forward, left_padded_causal_mask  # noqa: E402
from prorl_trl.config import ProRLConfig, resolve_phases  # noqa: E402
from prorl_trl.reset import unwrap_model  # noqa: E402
from prorl_trl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402

MODES = ("off", "auto", "always")
SHAPES = ("initial", "reset4", "study")
STUDY_MODEL = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4}
HEAD_SHAPES = {"GSM8K recipe (Qwen2-0.5B)": (14, 64), "prolonged study (19M Qwen2)": (8, 64)}


# ------------------------------------------------------------------------------------------- 1. reproduction
def reproduction(device: torch.device, dtype: torch.dtype, tokenizer) -> list[dict]:
    """Finite gradients? per length, with cuDNN forced, memory-efficient forced, and through the guarded attention
    (installed on a tiny model in "auto", as a trainer does: its probe decides the remainders)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    install_cudnn_attention_guard(build_tiny_model(tokenizer, seed=0).to(device=device, dtype=dtype), "auto")

    class Attention(torch.nn.Module):  # what transformers' sdpa_attention_forward reads from the layer
        num_key_value_groups, is_causal, training = 1, True, True

    rows = []
    for length in (64, 65, 192, 193):
        generator = torch.Generator(device=device).manual_seed(length)
        inputs = [torch.randn(2, 14, length, 64, device=device, dtype=dtype, generator=generator) for _ in range(3)]
        mask = left_padded_causal_mask(length, padding=5, device=device)
        row = {"length": length}
        forced = (("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]))
        for label, backends in (*forced,
                                ("guarded", None)):  # fmt: skip
            q, k, v = (tensor.clone().requires_grad_() for tensor in inputs)
            try:
                if backends is None:
                    output = guarded_sdpa_attention_forward(Attention(), q, k, v, mask, scaling=None)[0]
                else:
                    with sdpa_kernel(backends):
                        output = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                output.float().square().mean().backward()
                row[label] = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
            except RuntimeError as error:
                row[label] = f"n/a ({str(error).splitlines()[0][:60]})"
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------- 3. cost
class CycleModes(TrainerCallback):
    """The first generation batch warms up (mode "auto"); then each generation batch (`cycle` optimizer steps: the
    reset-4 phase spends 2 steps on one) runs with the next of MODES, set before its first step starts, so every mode
    gets the same mix of steps that generate and steps that only train."""

    def __init__(self, model, cycle: int):
        self.model, self.cycle, self.modes = model, cycle, []

    def on_step_begin(self, args, state, control, **kwargs):
        batch = state.global_step // self.cycle
        mode = "auto" if batch == 0 else MODES[(batch - 1) % len(MODES)]
        install_cudnn_attention_guard(self.model, mode)
        self.modes.append(mode)


def recipe_trainer(shape: str, prompt_tokens: int, options, device, tokenizer, workdir: str, callbacks: list):
    first = 4 if shape == "reset4" else 0
    recipe, kwargs = load_settings(options.recipe, [], options.smoke, options.steps, workdir, first_phase=first)
    kwargs["phases"] = kwargs["phases"][:1]
    kwargs.update(generation_max_prompt_length=prompt_tokens, rollout_engine=True, compiled_generation=True)
    trainer = ProRLTrainer(
        model=build_model(options.smoke, tokenizer, device), reward_funcs=recipe.reward_functions(),
        args=ProRLConfig(**kwargs), train_dataset=prompt_dataset(tokenizer, prompt_tokens),
        processing_class=tokenizer, peft_config=recipe.peft_config(), callbacks=callbacks,
    )  # fmt: skip
    for index in range(4 if shape == "reset4" and not options.smoke else 0):  # the frozen resets before phase 4
        hard_reset_timed(trainer, index, device)
    return trainer


def study_trainer(prompt_tokens: int, options, device, tokenizer, workdir: str, callbacks: list):
    from peft import LoraConfig

    cuda = device.type == "cuda"
    shape = STUDY_MODEL if cuda else {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "num_key_value_heads": 1}  # fmt: skip
    model = build_tiny_model(tokenizer, seed=0, **shape).to(device=device, dtype=torch.bfloat16 if cuda else None)
    config = ProRLConfig(
        output_dir=workdir, max_steps=options.steps, learning_rate=2e-4, lr_scheduler_type="constant_with_warmup",
        warmup_steps=1, per_device_train_batch_size=(16 if options.smoke else 512), num_generations=8,
        max_completion_length=48, generation_kwargs={"min_new_tokens": 48}, temperature=1.0, top_p=0.7, beta=0.001,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, kl_clamp=True, rollout_engine=cuda, save_strategy="no",
        report_to=[], logging_steps=1, disable_tqdm=True, bf16=cuda, use_cpu=not cuda,
    )  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return ProRLTrainer(
        model=model, reward_funcs=[token_hash_reward], args=config,
        train_dataset=prompt_dataset(tokenizer, prompt_tokens),
        processing_class=tokenizer, peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=targets),
        callbacks=callbacks,
    )  # fmt: skip


def cap_and_cycle(shape: str, options, workdir: str) -> tuple[int, int]:
    """The completion cap and the optimizer steps one generation batch feeds at `shape`."""
    if shape == "study":
        return 48, 1
    recipe, kwargs = load_settings(
        options.recipe, [], options.smoke, 1, workdir, first_phase=4 if shape == "reset4" else 0
    )
    args = ProRLConfig(**kwargs)
    phase = resolve_phases(args, recipe.peft_config())[0]  # the phase's own generation batch, as the trainer sets it
    micro_steps = phase.generation_batch_size // args.per_device_train_batch_size  # one process
    return phase.max_completion_length, max(1, micro_steps // args.gradient_accumulation_steps)


def run_shape(shape: str, guarded_length: bool, options, device, tokenizer) -> dict:
    """One trainer at `shape`, its padded length on a guarded remainder (64 mod 128) or one token past it."""
    with tempfile.TemporaryDirectory(prefix="prorl-guard-") as workdir:
        cap, cycle = cap_and_cycle(shape, options, workdir)
        options.steps = cycle * (1 + len(MODES) * options.rounds)
        smallest = 16 if shape == "study" else 128  # the study's prompts are short; the recipe's 128+ tokens
        prompt_tokens = smallest + (64 - smallest - cap) % 128 + (0 if guarded_length else 1)
        timer, generate_seconds = StepTimer(device), []
        callbacks = [timer]
        if shape == "study":
            trainer = study_trainer(prompt_tokens, options, device, tokenizer, workdir, callbacks)
        else:
            trainer = recipe_trainer(shape, prompt_tokens, options, device, tokenizer, workdir, callbacks)
        modes = CycleModes(unwrap_model(trainer.model), cycle)
        trainer.add_callback(modes)
        engine = getattr(trainer, "rollout_engine", None)
        timed_calls(engine if engine is not None else trainer.model, "generate", generate_seconds, device)
        trainer.train()
        result = {
            "shape": shape, "cap": cap, "prompt_tokens": prompt_tokens, "padded_length": prompt_tokens + cap,
            "modes": modes.modes, "cycle": cycle, "step_seconds": timer.times, "generate_seconds": generate_seconds,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "grad_norms": [e.get("grad_norm") for e in trainer.state.log_history if "loss" in e],
            "guard": trainer.cudnn_attention_guard.message,
        }  # fmt: skip
        del trainer, engine
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"[cudnn_guard] {json.dumps(result)}", flush=True)
    return result


def cost_rows(result: dict) -> list[str]:
    rows = []
    by_mode: dict[str, list[tuple[float, float]]] = {}
    cycle = result.get("cycle", 1)
    steps, generations = result["step_seconds"], result["generate_seconds"]
    for batch in range(1, min(len(steps) // cycle, len(generations))):  # batch 0 warmed up
        seconds = sum(steps[batch * cycle : (batch + 1) * cycle])  # a generation batch's steps, per step below
        by_mode.setdefault(result["modes"][batch * cycle], []).append(
            (seconds / cycle, (seconds - generations[batch]) / cycle)
        )
    if "off" not in by_mode:
        return rows
    base_step = statistics.median(s for s, _ in by_mode["off"])
    base_train = statistics.median(t for _, t in by_mode["off"])
    where = "on 64 mod 128 (guarded)" if result["padded_length"] % 128 == 64 else "64 mod 128 + 1 (not guarded)"
    for mode in MODES:
        if mode not in by_mode:
            continue
        step = statistics.median(s for s, _ in by_mode[mode])
        train = statistics.median(t for _, t in by_mode[mode])
        rows.append(
            f"| {result['shape']} | {result['padded_length']} ({where}) | {mode} | {len(by_mode[mode])} | {step:.3f} | "
            f"{train:.3f} | {100 * (step / base_step - 1):+.2f}% | {100 * (train / base_train - 1):+.2f}% |"
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and shapes: checks the script runs")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma separated, from {SHAPES}")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--lengths", default="guarded,unguarded",
                        help="comma separated: 'guarded' (padded length 64 mod 128) and/or 'unguarded' (one token more)")
    parser.add_argument("--probe-all", action="store_true", help="also probe all 128 remainders (slow: ~20 s a shape)")
    parser.add_argument("--report", type=Path, nargs="+", default=None,
                        help="JSON files of earlier runs (--json): print their tables together, run nothing")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    shapes = [s for s in options.shapes.split(",") if s]
    if set(shapes) - set(SHAPES):
        parser.error(f"--shapes: unknown {sorted(set(shapes) - set(SHAPES))}; choose from {SHAPES}")
    lengths = [length for length in options.lengths.split(",") if length]
    if not lengths or set(lengths) - {"guarded", "unguarded"}:
        parser.error(f"--lengths {options.lengths!r}: choose 'guarded', 'unguarded' or both")
    if options.report:
        return report_of(options.report, options.out)
    if not options.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    if options.smoke:
        shapes, options.rounds = ["study"], 1
    device = torch.device("cpu") if options.smoke else torch.device("cuda", torch.cuda.current_device())
    meta = {
        "device": device_name(device, cpu="CPU (smoke)"), "date": utc_now(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }  # fmt: skip
    tokenizer = build_tiny_tokenizer()
    repro = reproduction(device, torch.bfloat16, tokenizer) if device.type == "cuda" else []
    probes = {}
    for label, (heads, head_dim) in HEAD_SHAPES.items():
        started = time.perf_counter()
        probes[label] = (probe_cudnn_backward(device, torch.bfloat16, heads, head_dim), time.perf_counter() - started)
        if options.probe_all and device.type == "cuda":  # every remainder: do the default lengths miss one?
            started = time.perf_counter()
            every = probe_cudnn_backward(device, torch.bfloat16, heads, head_dim, tuple(range(384, 512)))
            probes[label + ", lengths 384-511"] = (every, time.perf_counter() - started)
    results = []
    for shape in shapes:
        for guarded_length in [length == "guarded" for length in lengths]:
            try:
                results.append(run_shape(shape, guarded_length, options, device, tokenizer))
            except Exception as error:  # one failing shape must not hide the others' numbers
                results.append({"shape": shape, "error": error_line(error)})
                print(f"[cudnn_guard] {shape} FAILED: {results[-1]['error']}", flush=True)
    payload = {
        "meta": meta,
        "reproduction": repro,
        "probes": {k: list(v) for k, v in probes.items()},
        "results": results,
    }
    publish(render(payload), options.out, options.json, payload)
    return payload


def render(payload: dict) -> str:
    """One run's tables: reproduction, probe, cost."""
    meta, repro = payload["meta"], payload["reproduction"]
    lines = [f"Device: {meta['device']} | {meta['date']} | torch {meta['torch']} | cuDNN {meta['cudnn']}", ""]
    if repro:
        lines += [
            "| length | cuDNN forced: finite grads | memory-efficient forced | guarded (auto) |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r['length']} | {r['cudnn']} | {r['efficient']} | {r['guarded']} |" for r in repro]
        lines.append("")
    lines += ["| head shape | probe: failing remainders (mod 128) | probe time (s) |", "|---|---|---:|"]
    lines += [f"| {label} | {failing} | {seconds:.2f} |" for label, (failing, seconds) in payload["probes"].items()]
    lines += [cost_header(), *cost_lines(payload["results"])]
    return "\n".join(lines)


def cost_header() -> str:
    return ("\n| shape | padded length | guard | steps | step (s, median) | training half (s) | step vs off | "
            "training half vs off |\n|---|---|---|---:|---:|---:|---:|---:|")


def cost_lines(results: list[dict]) -> list[str]:
    lines = []
    for result in results:
        lines += [f"| {result['shape']} | failed: {result['error']} |" + " |" * 6] if "error" in result else cost_rows(result)
    return lines


def report_of(paths: list[Path], out: Path | None) -> dict:
    """The cost tables of runs made apart (one length per GPU, say) as one table, each run's device named."""
    payloads = read_runs(paths)
    lines = [f"- {path.name}: {p['meta']['device']}, {p['meta']['date']}, torch {p['meta']['torch']}, cuDNN "
             f"{p['meta']['cudnn']}" for path, p in zip(paths, payloads)]  # fmt: skip
    lines += [cost_header(), *cost_lines([result for payload in payloads for result in payload["results"]])]
    publish("\n".join(lines), out)
    return {"payloads": payloads}


if __name__ == "__main__":
    main()
