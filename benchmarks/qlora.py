"""Hard resets on a quantised base (QLoRA) against a bf16 base, on one GPU: speed, memory, and what the reset changed.

    python benchmarks/qlora.py --json qlora.json      # one GPU: Qwen2-0.5B architecture (random init), ~4 min
    python benchmarks/qlora.py --smoke                # CPU, tiny model: checks the script runs (15-30 s)
    python benchmarks/qlora.py --bases 4bit,8bit --steps 3 --cap 512    # part of it, a longer shape

One model is saved once (bf16, random init, the tiny byte-level tokenizer: nothing is downloaded), then each base runs
in a process of its own (clean peak-memory counters, nothing cached from the previous base):
  bf16    the saved model in bf16                                  lora_reset_mode: frozen (the default)
  4bit    loaded in bitsandbytes 4-bit nf4, bf16 compute (QLoRA)    lora_reset_mode: frozen
  8bit    loaded in bitsandbytes 8-bit (LLM.int8)                   lora_reset_mode: frozen
  merge   the bf16 base with lora_reset_mode: merge (the old reset, for comparison; refused on a quantised base)
Each is a `ProRLTrainer` run of the GSM8K recipe's first two phases (recipes/prorl_gsm8k_qwen2_0.5b.yaml: LoRA r32 on
q,k, lr 2e-6, top_p 0.7 then 0.9, beta 0.001, gradient checkpointing, bf16), `--steps` optimizer steps each and a hard
reset between them, with `--completions` completions per step (one prompt, default 16) forced to `--cap` tokens
(default 64; a random model never stops), TRL's eager generation for every base (the rollout engine refuses a
quantised model) and a token-hash reward (it varies within a group, so LoRA B moves).
Per base: step time (median of the steps after each phase's first), peak `torch.cuda.max_memory_allocated` /
`max_memory_reserved` over training, the hard reset's wall time (device-synchronised; it includes the trainer's own
reset probe and the frozen factors' file), `prorl/reset_logp_change` (the trainer's measure: max |log-prob change|
on its latest completions) and max |logits after - before| on a fixed batch, next to the adapter's effect on that
batch (max |logits - logits with the adapter disabled|) at the reset. Frozen resets must change nothing (0).
Measured with `--cap 128` on an H200: 5.2 min in all; each process spends ~30 s importing, loading and writing
`final/`, and with TRL's eager generation a steady step of 16 x 128 tokens takes ~7 s on bf16 and 4-bit, ~16 s on
8-bit. The defaults (64 tokens) are sized from that to about 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _common import DEFAULT_RECIPE, device_name, error_line, fmt, publish, synchronize, utc_now, versions  # first

import torch  # noqa: E402

from memory import load_settings, prompt_dataset  # noqa: E402
from prorl_trl.config import ProRLConfig  # noqa: E402
from prorl_trl.reset import frozen_rank_total  # noqa: E402
from prorl_trl.tiny import build_tiny_tokenizer, tiny_config  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402
from scale_out import save_model_once  # noqa: E402
from trainer_gpu import StepTimer, qwen2_05b_config, token_hash_reward  # noqa: E402

BASES = ("bf16", "4bit", "8bit", "merge")
PACKAGES = ("torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes")


def quantization_config(base: str):
    from transformers import BitsAndBytesConfig

    if base == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    if base == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load_base(base: str, model_dir: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, quantization_config=quantization_config(base), device_map={"": device}
    )
    if device.type == "cpu":  # smoke: keep 4-bit weights in their layout (bitsandbytes' CPU backend repacks a 4-bit
        for module in model.modules():  # weight at an eval-mode forward, after which it cannot train; GPUs never do)
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return model


def settings(options, base: str, workdir: str) -> tuple:
    """(recipe, ProRLConfig kwargs): the recipe's first two phases at this benchmark's shape."""
    overrides = [
        f"training.max_completion_length={options.cap}", f"training.num_generations={options.completions}",
        f"training.generation_batch_size={options.completions}",
        f"training.per_device_train_batch_size={options.completions}", "training.gradient_accumulation_steps=1",
        f"training.generation_max_prompt_length={options.prompt_tokens}", "training.rollout_engine=false",
        "training.compiled_generation=false", f"training.lora_reset_mode={'merge' if base == 'merge' else 'frozen'}",
    ]  # fmt: skip
    if options.smoke:
        overrides += ["training.bf16=false", "training.use_cpu=true", "peft.r=4", "peft.lora_alpha=8"]
    recipe, kwargs = load_settings(options.recipe, overrides, False, options.steps, workdir)
    kwargs["phases"] = kwargs["phases"][:2]  # neither changes the cap: every completion is forced to it
    kwargs["generation_kwargs"] = dict(kwargs["generation_kwargs"], min_new_tokens=kwargs["max_completion_length"])
    kwargs["output_dir"] = str(Path(workdir) / f"run-{base}")
    return recipe, kwargs


@torch.no_grad()
def probe_logits(model, probe: torch.Tensor) -> torch.Tensor:
    return model(input_ids=probe).logits.float()


def time_resets(trainer, probe: torch.Tensor, device: torch.device, records: list[dict]) -> None:
    """Wrap `trainer.hard_reset` (the instance attribute the trainer calls at a phase boundary): its wall time, and
    the fixed batch's logits just before and after it."""
    original = trainer.hard_reset

    def hard_reset(*args, **kwargs):
        model = trainer.model
        before = probe_logits(model, probe)
        with model.disable_adapter():
            adapter_off = probe_logits(model, probe)
        synchronize(device)
        start = time.perf_counter()
        original(*args, **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - start
        after = probe_logits(model, probe)
        records.append({
            "seconds": seconds,
            "max_abs_logits_change": (after - before).abs().max().item(),
            "adapter_effect": (before - adapter_off).abs().max().item(),
            **trainer.prorl_reset_change,
            "merge_delta_lost": trainer.prorl_merge_delta_lost,
            "frozen_rank_total": frozen_rank_total(model),
        })  # fmt: skip

    trainer.hard_reset = hard_reset


def worker(base: str, options, model_dir: str) -> dict:
    """One base's 2-phase run in this process; its JSON-able result."""
    device = torch.device("cpu") if options.smoke else torch.device("cuda", torch.cuda.current_device())
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")  # 8-bit: one per layer call
    tokenizer = build_tiny_tokenizer()
    result: dict = {"base": base}
    with tempfile.TemporaryDirectory(prefix=f"prorl-qlora-{base}-") as workdir:
        recipe, kwargs = settings(options, base, workdir)
        dataset = prompt_dataset(tokenizer, options.prompt_tokens)
        probe = torch.tensor(tokenizer(dataset["prompt"][:2]).input_ids, device=device)
        model = load_base(base, model_dir, device)
        timer, resets = StepTimer(device), []
        trainer = ProRLTrainer(model=model, reward_funcs=token_hash_reward, args=ProRLConfig(**kwargs),
                               train_dataset=dataset, processing_class=tokenizer, peft_config=recipe.peft_config(),
                               callbacks=[timer])  # fmt: skip
        time_resets(trainer, probe, device, resets)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.train()
        steps = options.steps
        phases = [timer.times[i * steps : (i + 1) * steps] for i in range(len(timer.times) // steps)]
        result.update(
            lora_reset_mode=trainer.args.lora_reset_mode,
            step_seconds=timer.times,
            steady_step_seconds=statistics.median([t for phase in phases for t in phase[1:]] or timer.times),
            resets=resets,
            mean_completion_length=max((e["completions/mean_length"] for e in trainer.state.log_history
                                        if "completions/mean_length" in e), default=None),  # fmt: skip
        )
        if device.type == "cuda":
            result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    print(f"[qlora] {json.dumps(result)}", flush=True)
    return result


def run_in_process(base: str, options, model_dir: str) -> dict:
    try:
        return worker(base, options, model_dir)
    except Exception as error:  # one failing base must not hide the others' numbers
        return {"base": base, "error": error_line(error)}


def run_in_subprocess(base: str, options, model_dir: str, folder: Path) -> dict:
    path = folder / f"{base}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", base, "--model-dir", model_dir,
               "--result", str(path), "--steps", str(options.steps), "--cap", str(options.cap),
               "--completions", str(options.completions), "--prompt-tokens", str(options.prompt_tokens),
               "--recipe", str(options.recipe)]  # fmt: skip
    start = time.perf_counter()
    code = subprocess.call(command)
    if not path.exists():
        return {"base": base, "error": f"worker exited with code {code}"}
    return json.loads(path.read_text()) | {"process_seconds": time.perf_counter() - start}


def table(meta: dict, results: list[dict]) -> str:
    lines = [
        f"Device: {meta['device']} | {meta['date']} | {meta['versions']}",
        f"{meta['shape']}; {meta['total_seconds']} s in all (model save, a process per base)",
        "",
        "| base | reset mode | steady step (s), median | steps (s) | peak alloc / reserved (GiB) | hard reset (s) | "
        "prorl/reset_logp_change | max abs logits change at the reset | adapter effect on the logits | "
        "reset changed nothing |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['base']} | failed: {r['error']} |" + " |" * 8)
            continue
        reset = (r["resets"] or [{}])[0]
        change, logits = reset.get("prorl/reset_logp_change"), reset.get("max_abs_logits_change")
        peak = f"{r['peak_allocated_gib']:.2f} / {r['peak_reserved_gib']:.2f}" if "peak_allocated_gib" in r else "-"
        unchanged = "yes" if change == 0 and logits == 0 else "**no**"
        lines.append(
            f"| {r['base']} | {r['lora_reset_mode']} | {r['steady_step_seconds']:.2f} | "
            f"{', '.join(f'{t:.1f}' for t in r['step_seconds'])} | {peak} | {fmt(reset.get('seconds'))} | "
            f"{fmt(change, '.3g')} | {fmt(logits, '.3g')} | {fmt(reset.get('adapter_effect'), '.3g')} | {unchanged} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, in one process: checks the script runs")
    parser.add_argument("--bases", default=",".join(BASES), help=f"comma separated, from {BASES}")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per phase (2 phases, a reset between)")
    parser.add_argument("--cap", type=int, default=64, help="completion tokens (every completion forced to it)")
    parser.add_argument("--completions", type=int, default=16, help="completions per step (one prompt's group)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 128; smoke 16)")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--json", type=Path, default=None, help="write the results and metadata here")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    bases = [b for b in options.bases.split(",") if b]
    if set(bases) - set(BASES):
        parser.error(f"--bases: unknown {sorted(set(bases) - set(BASES))}; choose from {BASES}")
    if options.smoke:
        options.steps, options.completions, options.cap = min(options.steps, 2), min(options.completions, 4), 6
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    options.prompt_tokens = options.prompt_tokens or (16 if options.smoke else 128)
    if options.worker:
        options.result.write_text(json.dumps(worker(options.worker, options, options.model_dir)))
        return {}
    meta = {
        "device": "CPU (smoke)" if options.smoke else device_name(),
        "date": utc_now(),
        "versions": versions(*PACKAGES),
        "shape": (f"GSM8K recipe phases initial + reset-1 ({options.steps} steps each, a hard reset between), "
                  f"{options.completions} completions x {options.cap} tokens per step, {options.prompt_tokens}-token "
                  f"prompt, LoRA r{4 if options.smoke else 32} q,k, TRL's eager generation"),
    }  # fmt: skip
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(tokenizer) if options.smoke else qwen2_05b_config(tokenizer)
    results, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prorl-qlora-") as workdir:
        init_device = "cpu" if options.smoke else "cuda"
        model_dir = save_model_once(config, tokenizer, Path(workdir) / "model", torch.bfloat16, init_device)
        for base in bases:
            if options.smoke:  # in-process: a subprocess would import torch and TRL again per base
                results.append(run_in_process(base, options, model_dir))
            else:
                results.append(run_in_subprocess(base, options, model_dir, Path(workdir)))
    meta["total_seconds"] = round(time.perf_counter() - start)
    publish(table(meta, results), options.out, options.json, {"meta": meta, "results": results})
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()
