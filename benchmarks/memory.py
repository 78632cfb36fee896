"""Peak GPU memory of every phase of the GSM8K ProRL recipe: ProRLTrainer vs vanilla GRPOTrainer; prints one table.

    python benchmarks/memory.py                   # one GPU: Qwen2-0.5B architecture (random init, bf16), the recipe's shapes
    python benchmarks/memory.py --jobs 2          # the same, two worker processes sharing the GPU (memory is per process)
    python benchmarks/memory.py --smoke           # CPU, tiny model, tiny shapes (~10 s): checks the script runs
    python benchmarks/memory.py --set training.per_device_train_batch_size=8 ...   # recipe overrides (before/after)
    python benchmarks/memory.py --workers prorl --prorl-from 3 --json-dir runs/     # part of the work, JSON kept
    python benchmarks/memory.py --from-json runs/*.json                             # one table from several calls
    python benchmarks/memory.py --workers prorl --prorl-from 3 --memory-cap-gib 10.14  # does it run within 10.14 GiB?
    python benchmarks/memory.py ... --trace-segments   # + what occupies every large segment at each phase's end / OOM
    python benchmarks/memory.py ... --switch arena.PRIVATE_POOL=false   # A/B: a boolean switch of prorl_trl.rollout

On an H100 the whole default set takes about 20 minutes one worker at a time (a 4,096-token phase step 1.5 min,
reset-4 4 min); split it with `--workers` / `--prorl-from` to fit shorter device calls. Workers write their JSON after every phase, so a
call cut short keeps the phases it finished.

What runs: the recipe (default `recipes/prorl_gsm8k_qwen2_0.5b.yaml`) as written (micro-batch, gradient accumulation,
gradient checkpointing, LoRA per phase, compiled generation, rewards), with each phase cut to `--steps` optimizer steps
and checkpoints, logging backends and validation off.
- ProRLTrainer runs all phases in one process, hard resets between them, as a real run does. A phase's window opens
  where the previous one closed, so it includes the reset that starts it.
- GRPOTrainer runs each phase in a fresh process with that phase's settings (sampling, group size, generation batch,
  completion cap, LoRA rank and targets; the overlong buffer as TRL's `get_soft_overlong_punishment`) and the same
  compiled static-cache generation (`prorl_trl.rollout.compiled.configure_trainer_generation`, which only edits TRL's
  `GenerationConfig`), so the comparison isolates the trainer.
Peak = `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the window; every `generate` call is timed too
(in the JSON, informational). A random model does not stop, and
worst-case lengths are what must fit: `min_new_tokens` forces every completion to the phase's cap, and prompts are as
long as the recipe's prompt budget allows. Targets: every phase <= 24 GB (decimal, 22.35 GiB, leaving room for the CUDA
context on a 24 GB card) in peak *reserved* memory, and ProRL <= 1.05x GRPOTrainer in peak allocated memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_RECIPE, device_name, read_runs, versions  # first: the repository on sys.path

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

from prorl_trl.config import ProRLConfig, resolve_phases  # noqa: E402
from prorl_trl.rollout.compiled import configure_trainer_generation  # noqa: E402
from prorl_trl.recipe import load_recipe  # noqa: E402
from prorl_trl.tiny import build_tiny_tokenizer  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402
from trainer_gpu import build_model  # noqa: E402  (benchmarks/: tiny model on CPU, random Qwen2-0.5B in bf16 on GPU)
from generation_memory import in_default_pool, origin  # noqa: E402  (reading the allocator's snapshots)

CARD_BYTES = 24e9  # "24 GB" card: decimal gigabytes
MAX_RATIO = 1.05
GIB = 2**30
# Tiny shapes with the recipe's structure (phase 4: longer cap, bigger group, overlong buffer, wider LoRA).
SMOKE_OVERRIDES = [
    "training.max_completion_length=12", "training.per_device_train_batch_size=4", "training.generation_batch_size=8",
    "training.num_generations=4", "training.gradient_accumulation_steps=2", "training.generation_max_prompt_length=48",
    "training.bf16=false", "training.use_cpu=true", "peft.r=4", "peft.lora_alpha=8", "phases.4.max_completion_length=16",
    "phases.4.overlong_buffer=8", "phases.4.num_generations=8", "phases.4.lora_r=8", "phases.4.lora_alpha=16",
]  # fmt: skip
GRPO_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
PHASE_TO_GRPO = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "num_generations", "max_completion_length",
    "generation_batch_size", "learning_rate", "beta", "epsilon", "epsilon_high",
)  # fmt: skip


def load_settings(recipe_path: Path, overrides: list[str], smoke: bool, steps: int, workdir: str, first_phase: int = 0):
    """(recipe, ProRLConfig kwargs) with every phase cut to `steps` and nothing written or reported. `first_phase > 0`
    drops the phases before it, keeping every later phase's resolved settings (LoRA, sampling) as in the full run."""
    tokens = [f"--{item}" for item in (SMOKE_OVERRIDES if smoke else []) + overrides]
    recipe = load_recipe(recipe_path, tokens, dry=smoke)
    kwargs = recipe.config_kwargs(dry=smoke)
    kwargs.pop("model_init_kwargs", None)  # the model is built here, not loaded
    kwargs.update(output_dir=workdir, save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True)
    kwargs.update(save_merged_on_reset=False, plateau_patience=0)
    kwargs["phases"] = [dict(phase, max_steps=steps) for phase in kwargs["phases"]]
    longest = max([kwargs["max_completion_length"]] + [p.get("max_completion_length") or 0 for p in kwargs["phases"]])
    kwargs["generation_kwargs"] = dict(kwargs.get("generation_kwargs") or {}, min_new_tokens=longest)
    if first_phase:
        resolved = resolve_phases(ProRLConfig(**kwargs), recipe.peft_config())[first_phase:]
        kwargs["phases"] = [dataclasses.asdict(p.to_phase_config()) for p in resolved]
    return recipe, kwargs


def prompt_dataset(tokenizer, prompt_tokens: int, rows: int = 64) -> Dataset:
    """Prompts of exactly `prompt_tokens` tokens (byte-level tokenizer) with a gold answer for the recipe's reward."""
    prompts = []
    for i in range(rows):
        head = f"Problem {i}: a shop sells {i + 3} pens at {2 * i + 1} dollars each. Total? "
        prompts.append((head + "Think step by step. " * prompt_tokens)[:prompt_tokens])
    if any(len(tokenizer(p).input_ids) != prompt_tokens for p in prompts[:2]):
        raise RuntimeError("prompt_dataset expects a byte-level tokenizer (one token per character).")
    return Dataset.from_dict({"prompt": prompts, "answer": [str((i + 3) * (2 * i + 1)) for i in range(rows)]})


class PhaseMemory(TrainerCallback):
    """Per inner `train()` call (one phase): peak memory since the previous call ended, wall time, completion length."""

    def __init__(self, device: torch.device, on_record=None, trace_segments: bool = False):
        self.device, self.records, self._start, self.on_record = device, [], None, on_record
        self.trace_segments = trace_segments  # also each large segment's blocks (`segment_blocks`) per record
        self._generate_seconds: list[float] = []
        self.engine = None  # the trainer's RolloutEngine, when it has one: its captures go in the records

    def watch_generation(self, model) -> None:
        """Time every `generate` call of `model` (the PeftModel TRL unwraps for generation; resets keep the object)."""
        original = model.generate

        def timed_generate(*args, **kwargs):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            output = original(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._generate_seconds.append(time.perf_counter() - start)
            return output

        model.generate = timed_generate

    def _reset(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        if self._start is None:
            self._reset()

    def on_train_end(self, args, state, control, **kwargs):
        lengths = [entry["completions/mean_length"] for entry in state.log_history if "completions/mean_length" in entry]
        record = {"seconds": time.perf_counter() - self._start, "mean_completion_length": max(lengths, default=None)}
        record["generate_seconds"], self._generate_seconds = self._generate_seconds, []
        if self.engine is not None:  # cumulative over the run: a capture per phase is expected, more is a cost
            record["engine_captures"] = self.engine.stats.captures
            record["engine_capture_seconds"] = round(self.engine.stats.capture_seconds, 2)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            record["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            record["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
            snapshot = torch.cuda.memory._snapshot()
            record["segments"] = segment_summary(snapshot["segments"])
            record["free_space"] = free_space(snapshot)
            if self.trace_segments:
                record["segment_blocks"] = segment_blocks(snapshot)
                record["side_stream_blocks"] = side_stream_blocks(snapshot)
        else:  # process-wide high-water mark (monotonic): only shows that the script runs
            record["peak_allocated"] = record["peak_reserved"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.records.append(record)
        if self.on_record:
            self.on_record(list(self.records))
        self._reset()


def segment_summary(snapshot: list[dict], largest: int = 12) -> dict:
    """What the allocator holds (reserved) at a phase's end, where reserved memory only grows: segments by stream and
    pool (a CUDA graph's private pool, or the default one) with their allocated bytes, and the largest segments. Why:
    the peak reserved memory of two paths with the same peak allocated memory differs by how training reuses what
    generation left cached (JSON only; the table shows the peaks)."""
    groups: dict[str, dict] = {}
    for segment in snapshot:
        pool = "default" if in_default_pool(segment) else "private"
        name = f"stream {segment['stream']:#x}, {pool} pool, {segment['segment_type']}"
        group = groups.setdefault(name, {"segments": 0, "reserved": 0, "allocated": 0})
        group["segments"] += 1
        group["reserved"] += segment["total_size"]
        group["allocated"] += segment["allocated_size"]
    top = sorted(snapshot, key=lambda segment: -segment["total_size"])[:largest]
    return {
        "by_stream_and_pool": groups,
        "largest": [{"mib": round(s["total_size"] / 2**20, 1), "allocated_mib": round(s["allocated_size"] / 2**20, 1),
                     "stream": f"{s['stream']:#x}"} for s in top],  # fmt: skip
    }


def segment_blocks(snapshot: dict, min_mib: float = 64, min_block_mib: float = 1) -> list[dict]:
    """Every default-pool segment of at least `min_mib`, its blocks in address order: free runs as a number of MiB,
    live blocks of at least `min_block_mib` as "<MiB> MiB <the code that allocated them>" (PyTorch's allocation
    history must be on), runs of smaller live blocks as "<MiB> MiB small". Why: a segment training cannot reuse for a
    large request, or release under memory pressure, is one whose free space is cut by live blocks; this says which
    (`--trace-segments`)."""
    report = []
    for segment in sorted(snapshot["segments"], key=lambda segment: -segment["total_size"]):
        if segment["total_size"] < min_mib * 2**20 or not in_default_pool(segment):
            continue
        items: list = []  # [kind, MiB, label]: kind "free", "small" or "live"
        for block in segment["blocks"]:
            mib = block["size"] / 2**20
            if block["state"] != "active_allocated":
                kind, label = "free", ""
            elif block["size"] < min_block_mib * 2**20:
                kind, label = "small", "small"
            else:
                kind, label = "live", origin(block.get("frames", []))
            if items and items[-1][0] == kind != "live":
                items[-1][1] += mib  # consecutive free (or small live) blocks: one run
            else:
                items.append([kind, mib, label])
        blocks = [round(mib, 1) if kind == "free" else f"{mib:.1f} MiB {label}" for kind, mib, label in items]
        report.append({"mib": round(segment["total_size"] / 2**20, 1), "stream": f"{segment['stream']:#x}",
                       "blocks": blocks})  # fmt: skip
    return report


def side_stream_blocks(snapshot: dict, frames: int = 8) -> list[dict]:
    """The live default-pool blocks allocated on a stream other than the default one (a capture's side stream: the
    engine's, or inductor's CUDA-graph trees'), each with its size and the innermost `frames` Python frames of its
    allocation (PyTorch's allocation history must be on): what a generation path keeps beside training, however
    small."""
    found = []
    for segment in snapshot["segments"]:
        if segment["stream"] == 0 or not in_default_pool(segment):
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                stack = [f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                         for f in block.get("frames", [])[:frames]]  # fmt: skip
                found.append({"bytes": block["size"], "origin": origin(block.get("frames", [])), "frames": stack})
    return found


def free_space(snapshot: dict) -> dict:
    """Where the reserved memory is, in MiB (default pool unless said): live blocks; free memory in segments that also
    hold live blocks (usable only by requests that fit one of its free runs, never releasable); wholly free segments
    (released before an OOM is raised); the private pools (CUDA graphs, the generation arena); and the largest free
    run. At an OOM the wholly free segments are already released, so the rest is what training could not use."""
    totals = dict.fromkeys(("allocated", "free_in_used_segments", "free_segments", "private_pools"), 0.0)
    largest_run = 0.0
    for segment in snapshot["segments"]:
        if not in_default_pool(segment):
            totals["private_pools"] += segment["total_size"]
            continue
        free = segment["total_size"] - segment["allocated_size"]
        totals["allocated"] += segment["allocated_size"]
        totals["free_segments" if segment["allocated_size"] == 0 else "free_in_used_segments"] += free
        run = 0
        for block in segment["blocks"]:
            run = run + block["size"] if block["state"] != "active_allocated" else 0
            largest_run = max(largest_run, run)
    result = {key: round(value / 2**20, 1) for key, value in totals.items()}
    result["largest_free_run"] = round(largest_run / 2**20, 1)
    return result


def watch_out_of_memory(result: dict) -> None:
    """Keep the allocator's state at each out-of-memory error, taken when it happens (the allocator's observer), not
    after the failed step's tensors were freed: `free_space` for each (the last is the one that ended the run; one
    caught and retried, as the generation arena's, comes before it) and the large segments' blocks of the last."""

    def observer(device: int, requested: int, device_allocated: int, device_free: int) -> None:
        snapshot = torch.cuda.memory._snapshot()
        states = result.setdefault("oom_states", [])
        states[:] = states[-3:] + [{"requested_mib": round(requested / 2**20, 1), **free_space(snapshot)}]
        result["oom_segment_blocks"] = segment_blocks(snapshot)

    torch._C._cuda_attach_out_of_memory_observer(observer)


def apply_switches(items: list[str]) -> dict[str, bool]:
    """`--switch MODULE.NAME=true|false`: set a boolean A/B switch of a `prorl_trl.rollout` module in this process."""
    applied = {}
    for item in items:
        name, _, value = item.partition("=")
        module_name, _, attribute = name.rpartition(".")
        try:
            module = importlib.import_module(f"prorl_trl.rollout.{module_name}")
        except ImportError:
            module = None
        if module is None or not isinstance(getattr(module, attribute, None), bool):
            raise SystemExit(f"--switch {item}: {name!r} is not a boolean switch of a prorl_trl.rollout module")
        if value.lower() not in ("true", "false"):
            raise SystemExit(f"--switch {item}: the value must be true or false")
        setattr(module, attribute, value.lower() == "true")
        applied[name] = value.lower() == "true"
    return applied


def device_label(device: torch.device) -> str:
    return f"{device_name(device, cpu='CPU (smoke; peak = process RSS high-water mark)')}, {versions('torch')}"


def lora_for(phase) -> LoraConfig:
    return LoraConfig(r=phase.lora_r, lora_alpha=phase.lora_alpha, target_modules=phase.lora_target_modules,
                      lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip


def run_prorl(recipe, args: ProRLConfig, smoke: bool, device, tokenizer, dataset, probe: PhaseMemory) -> None:
    """All phases in one ProRLTrainer run; `probe` records each phase."""
    trainer = ProRLTrainer(
        model=build_model(smoke, tokenizer, device), reward_funcs=recipe.reward_functions(), args=args,
        train_dataset=dataset, processing_class=tokenizer, peft_config=recipe.peft_config(), callbacks=[probe],
    )  # fmt: skip
    probe.watch_generation(trainer.model)
    probe.engine = trainer.rollout_engine
    trainer.train()


def run_grpo(recipe, kwargs: dict, prorl_args: ProRLConfig, phase, smoke: bool, device, tokenizer, dataset,
             probe: PhaseMemory) -> None:
    """Vanilla GRPOTrainer at `phase`'s (resolved) settings, fresh model; `probe` records the phase."""
    grpo_kwargs = {k: v for k, v in kwargs.items() if k in GRPO_FIELDS and k != "steps_per_generation"}
    grpo_kwargs.update({name: getattr(phase, name) for name in PHASE_TO_GRPO}, max_steps=phase.max_steps)
    reward_funcs = recipe.reward_functions()
    if phase.overlong_buffer:
        reward_funcs.append(get_soft_overlong_punishment(phase.max_completion_length, phase.overlong_buffer))
        grpo_kwargs["reward_weights"] = list(grpo_kwargs["reward_weights"]) + [phase.overlong_penalty_factor]
    trainer = GRPOTrainer(
        model=build_model(smoke, tokenizer, device), reward_funcs=reward_funcs, args=GRPOConfig(**grpo_kwargs), train_dataset=dataset,
        processing_class=tokenizer, peft_config=lora_for(phase), callbacks=[probe],
    )  # fmt: skip
    if prorl_args.compiled_generation:
        configure_trainer_generation(trainer, max_prompt_length=prorl_args.generation_max_prompt_length)
    probe.watch_generation(trainer.model)
    trainer.train()


def free_memory(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def worker(name: str, options: argparse.Namespace, save=None) -> dict:
    """Run one worker in this process: `prorl` (all phases) or `grpo:N` (phase N). Returns its JSON-able result;
    `save(result)` is also called after every phase, so a run cut short keeps the phases it finished."""
    device = torch.device("cpu") if options.smoke else torch.device("cuda", torch.cuda.current_device())
    switches = apply_switches(options.switch)
    if options.trace_segments and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    if options.memory_cap_gib and device.type == "cuda":  # the allocator frees its cache and retries before an OOM
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(options.memory_cap_gib * GIB / total, 1.0), device)
    tokenizer = build_tiny_tokenizer()
    with tempfile.TemporaryDirectory(prefix="prorl-memory-") as workdir:
        first = options.prorl_from if name == "prorl" else 0
        recipe, kwargs = load_settings(options.recipe, options.set, options.smoke, options.steps, workdir, first)
        dataset = prompt_dataset(tokenizer, options.prompt_tokens or kwargs.get("generation_max_prompt_length") or 512)
        args = ProRLConfig(**kwargs)
        phases = resolve_phases(args, recipe.peft_config())
        keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "compiled_generation")
        result = {
            "worker": name, "first_phase": first, "records": [], "device": device_label(device), "prompt_tokens": len(dataset[0]["prompt"]),
            "memory_cap_gib": options.memory_cap_gib, "switches": switches,
            "training": {key: getattr(args, key) for key in keys},
            "resolved": [dataclasses.asdict(phase) for phase in phases],
        }  # fmt: skip
        probe = PhaseMemory(device, on_record=lambda records: save and save(dict(result, records=records)),
                            trace_segments=options.trace_segments and device.type == "cuda")  # fmt: skip
        if probe.trace_segments:
            watch_out_of_memory(result)
        try:
            if name == "prorl":
                run_prorl(recipe, args, options.smoke, device, tokenizer, dataset, probe)
            else:
                phase = phases[int(name.split(":")[1])]
                run_grpo(recipe, kwargs, args, phase, options.smoke, device, tokenizer, dataset, probe)
        except torch.OutOfMemoryError as error:
            result["error"] = f"OOM: {str(error).splitlines()[0][:160]}"
        finally:
            free_memory(device)
        result["records"] = list(probe.records)
    if save:
        save(result)
    return result


def run_workers(names: list[str], options: argparse.Namespace, jobs: int, folder: Path) -> list[dict]:
    """Each worker in its own process (clean CUDA state per measurement), `jobs` at a time; JSON results in `folder`."""
    base = [sys.executable, str(Path(__file__).resolve()), "--recipe", str(options.recipe), "--steps", str(options.steps)]
    base += [f"--set={item}" for item in options.set] + (["--smoke"] if options.smoke else [])
    base += ["--prorl-from", str(options.prorl_from)]
    if options.memory_cap_gib:
        base += ["--memory-cap-gib", str(options.memory_cap_gib)]
    if options.trace_segments:
        base += ["--trace-segments"]
    base += [f"--switch={item}" for item in options.switch]
    if options.prompt_tokens:
        base += ["--prompt-tokens", str(options.prompt_tokens)]
    results, pending, running = [], list(names), []
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            path = folder / f"{name.replace(':', '_')}.json"
            running.append((name, path, subprocess.Popen(base + ["--worker", name, "--json", str(path)])))
        time.sleep(1)
        for item in [item for item in running if item[2].poll() is not None]:
            running.remove(item)
            name, path, process = item
            if not path.exists():  # died before its first phase ended
                path.write_text(json.dumps({"worker": name, "error": f"worker exited with code {process.returncode}"}))
            results.append(json.loads(path.read_text()))
            print(f"[memory] {name} done: {results[-1].get('error', 'ok')}", file=sys.stderr, flush=True)
    return results


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def memory_cell(record: dict | None, result: dict) -> str:
    if record is None:
        return result.get("error", "not run")
    return f"{gib(record['peak_allocated'])} / {gib(record['peak_reserved'])}"


def prorl_record(prorl_runs: list[dict], index: int) -> tuple[dict, dict | None]:
    """(run, record) for phase `index` from the ProRL run that started earliest and reached it."""
    for run in prorl_runs:
        offset = index - run.get("first_phase", 0)
        if 0 <= offset < len(run["records"]):
            return run, run["records"][offset]
    return (prorl_runs or [{}])[0], None


def table(results: list[dict], steps: int) -> str:
    """One row per phase; several ProRL runs (`--prorl-from`) fill the phases each reached."""
    by_name = {r["worker"]: r for r in results if r["worker"] != "prorl"}
    prorl_runs = sorted((r for r in results if r["worker"] == "prorl"), key=lambda r: r.get("first_phase", 0))
    reference = max((r for r in results if "resolved" in r), key=lambda r: len(r["resolved"]))
    training = reference["training"]
    checkpointing = "on" if training["gradient_checkpointing"] else "off"
    ok = {True: "yes", False: "**no**", None: "n/a"}
    header = (
        f"| phase ({reference['device']}; micro-batch {training['per_device_train_batch_size']} x grad-accum "
        f"{training['gradient_accumulation_steps']}, gradient checkpointing {checkpointing}, "
        f"{reference['prompt_tokens']}-token prompts, {steps} step(s)/phase) | completions x tokens | LoRA | "
        "GRPOTrainer peak alloc / reserved (GiB) | ProRLTrainer peak alloc / reserved (GiB) | ProRL/GRPO alloc | "
        "mean completion length | <= 24 GB | <= 1.05x |"
    )
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    # a run started later (`--prorl-from`) resolved only its phases: number them as in the full run
    for index, phase in enumerate(reference["resolved"], start=reference.get("first_phase", 0)):
        grpo = by_name.get(f"grpo:{index}", {})
        g = (grpo.get("records") or [None])[0]
        prorl, p = prorl_record(prorl_runs, index)
        ratio = p["peak_allocated"] / g["peak_allocated"] if p and g else None
        fits = None if p is None or g is None else max(p["peak_reserved"], g["peak_reserved"]) <= CARD_BYTES
        modules = ",".join(name.replace("_proj", "") for name in sorted(phase["lora_target_modules"]))
        later_start = f" (run from phase {prorl['first_phase']})" if p and prorl.get("first_phase") else ""
        lengths = [f"{rec['mean_completion_length']:.0f}" for rec in (g, p) if rec and rec["mean_completion_length"] is not None]
        lines.append(
            f"| {index} {phase['name']} (T={phase['temperature']}, top_p={phase['top_p']}) | "
            f"{phase['generation_batch_size']} x {phase['max_completion_length']} | r{phase['lora_r']} {modules} | "
            f"{memory_cell(g, grpo)} | {memory_cell(p, prorl)}{later_start} | "
            f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {' / '.join(lengths) or 'n/a'} | {ok[fits]} | "
            f"{ok[None if ratio is None else ratio <= MAX_RATIO]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and shapes, in-process: checks the script runs.")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="Recipe whose phases are measured.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Recipe override (repeatable), e.g. training.per_device_train_batch_size=8.")
    parser.add_argument("--steps", type=int, default=1, help="Optimizer steps per phase (>= 1).")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="Prompt length; default the recipe's generation_max_prompt_length.")
    parser.add_argument("--jobs", type=int, default=1, help="Worker processes at a time on the GPU (peak memory is per process).")
    parser.add_argument("--workers", default=None, help="Comma-separated subset of workers: prorl, grpo:N (default all).")
    parser.add_argument("--json-dir", type=Path, default=None, help="Keep each worker's JSON result here.")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None, help="Only build the table from saved worker JSON.")
    parser.add_argument("--prorl-from", type=int, default=0, help="Start the ProRL run at this phase (settings as in the full run).")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="Also write the table (with a header) to this file.")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="Cap each worker's CUDA memory (torch.cuda.set_per_process_memory_fraction): whether the "
                             "phases run within it, cached blocks freed on demand as before a real OOM.")  # fmt: skip
    parser.add_argument("--trace-segments", action="store_true",
                        help="Record allocation history; the JSON gets what occupies every segment of 64 MiB or more "
                             "at each phase's end and at an OOM (slower).")  # fmt: skip
    parser.add_argument("--switch", action="append", default=[], metavar="MODULE.NAME=true|false",
                        help="A/B: set a boolean switch of a prorl_trl.rollout module in every worker (repeatable), "
                             "e.g. arena.PRIVATE_POOL=false.")  # fmt: skip
    options = parser.parse_args(argv)
    if options.steps < 1:
        parser.error("--steps must be >= 1.")
    if options.from_json:
        result = table(read_runs(options.from_json), options.steps)
        return emit(result, options, argv)
    if not options.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke for the CPU check.")
    if options.smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if options.worker:
        worker(options.worker, options, save=lambda result: options.json.write_text(json.dumps(result)))
        return ""
    _, kwargs = load_settings(options.recipe, options.set, options.smoke, options.steps, tempfile.gettempdir())
    names = ["prorl"] + [f"grpo:{i}" for i in range(len(kwargs["phases"]))]
    if options.workers:
        unknown = sorted(set(options.workers.split(",")) - set(names))
        if unknown:
            parser.error(f"unknown workers {unknown}; choose from {names}.")
        names = [name for name in names if name in options.workers.split(",")]
    if options.smoke and options.jobs == 1:  # in-process: subprocesses would re-import torch/TRL per worker
        results = [worker(name, options) for name in names]
    else:
        with tempfile.TemporaryDirectory(prefix="prorl-memory-json-") as folder:
            folder = options.json_dir or Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            results = run_workers(names, options, options.jobs, folder)
    return emit(table(results, options.steps), options, argv)


def emit(result: str, options: argparse.Namespace, argv: list[str] | None) -> str:
    print(result)
    if options.out:
        command = " ".join(argv if argv is not None else sys.argv[1:])
        header = f"Measured {datetime.date.today().isoformat()}; command: `python benchmarks/memory.py {command}`.\n\n"
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(header + result + "\n")
    return result


if __name__ == "__main__":
    main()
