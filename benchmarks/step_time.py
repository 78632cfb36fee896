"""Whole GRPO training steps of the GSM8K recipe: each phase's steady ProRLTrainer step and where it goes, or (`--paths`)
vanilla GRPOTrainer / `compiled_generation` / the engine at the Initial shape.

    python benchmarks/step_time.py --json steps.json    # one GPU: every phase (Qwen2-0.5B architecture, random, bf16)
    python benchmarks/step_time.py --phases reset4 --json r4.json      # one phase (the 4 resets before it done cheaply)
    python benchmarks/step_time.py --phases initial --profile-decode   # + the engine's decode kernels at the Initial shape
    python benchmarks/step_time.py --from-json a.json r4.json --out steps.md        # one table from several runs/GPUs
    python benchmarks/step_time.py --set training.per_device_train_batch_size=8     # a recipe override, every phase
    python benchmarks/step_time.py --smoke              # CPU, tiny model and shapes, all five phases: checks it runs
    python benchmarks/step_time.py --paths rollout_engine,compiled_generation,vanilla --steps 3 --vanilla-cap 512

Phases mode (the default): one ProRLTrainer run through the recipe's phases (default recipes/prorl_gsm8k_qwen2_0.5b.yaml)
with the recipe's settings per phase (generation batch, group size, cap, overlong buffer, sampling, LoRA rank and
targets, micro-batch, gradient accumulation, gradient checkpointing, bf16, the rollout engine, `cudnn_attention_guard`
at the recipe's value, `auto` unless `--set` changes it) and the real frozen hard reset before each phase; checkpoints,
validation, logging backends, merged saves and the final save are off. Each phase is cut to `--steps-per-phase` steps
(default 3: 1 warm-up, with the engine's capture, + 2 timed). A phase left out of `--phases` trains no step: it is
entered as the run enters it (its hard reset, its adapter shape and settings) and its adapter gets a trained-looking
B, so the phases after it start behind as many frozen parts as in a full run. Per phase: the steady step (median of the
timed steps), its split (`_step_split.StepSplit`: generation, log-prob forwards, loss forward, backward, optimizer step,
other; CUDA-synchronised timers around the trainer's methods), peak allocated / reserved memory over the phase,
rollout tokens/s, and the phase's time = steady step x the recipe's `max_steps` for it; the total over the phases, and
the same for a run of the seed's length (`--seed-plan`). A random-weights model does not stop early, and
`min_new_tokens` makes every completion run to its phase's cap: worst-case steps. Prompts are as long as the recipe's
prompt budget (`generation_max_prompt_length`, 512) unless `--prompt-tokens` says otherwise. The JSON is written after
every phase, so a call cut short keeps what it finished; where one device call cannot hold every phase, time them over
several (`--phases initial,reset1,reset2 --profile-decode`, `--phases reset3,reset4`) and join them with `--from-json`.

Paths mode (`--paths`): the Initial phase only, each path a fresh model with the same init, one after another in this
process (peak memory reset between them):
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
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import device_name, error_line, utc_now  # first: the repository on sys.path, the Hub offline

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import TrainOutput  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from _step_split import PARTS, StepSplit, profile_decode, split_of  # noqa: E402
from memory import DEFAULT_RECIPE, GRPO_FIELDS, PHASE_TO_GRPO, load_settings, lora_for, prompt_dataset  # noqa: E402
from prorl_trl import reset as reset_ops  # noqa: E402
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
def perturb_adapter(model, seed: int) -> None:
    """A trained-looking adapter: every LoRA B drawn from N(0, 1e-3) (a fresh one is zero, and a reset freezes no
    layer whose B is zero)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-3)


@torch.no_grad()
def hard_reset_timed(trainer, index: int, device: torch.device) -> float:
    """Give the adapter a trained-looking B, then time one `hard_reset()` (device-synchronised): the resets a run has
    behind it when its later phases start (`--frozen-resets`)."""
    perturb_adapter(trainer.model, index)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    trainer.hard_reset(reason="benchmark")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------- phases mode
SEED_PLAN = "reset-1=2600,reset-4=7600"  # seed 000: Reset 1 ended at about step 2,600, its best checkpoint at 7,600


def phase_key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def pick_phases(spec: str | None, names: list[str]) -> list[int]:
    """`--phases`: names (`reset4`, `reset-4`) or indices, comma separated; None or empty: every phase."""
    if not spec:
        return list(range(len(names)))
    keys = {phase_key(name): index for index, name in enumerate(names)}
    picked = []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        index = int(item) if item.isdigit() else keys.get(phase_key(item))
        if index is None or not 0 <= index < len(names):
            raise SystemExit(f"--phases {spec}: unknown phase {item!r}; the recipe's phases are {names} "
                             f"(or 0-{len(names) - 1})")  # fmt: skip
        picked.append(index)
    return sorted(set(picked))


def seed_plan_lengths(spec: str, names: list[str], planned: list[int]) -> list[int]:
    """Phase lengths of a run as long as the seed's: `PHASE=STEP` pairs give the global step where a phase ended;
    the phases between two given ones keep the recipe's `max_steps` and the given phase takes the rest, so the steps
    beyond the recipe's run at that phase's step time."""
    lengths, start, first = list(planned), 0, 0
    for item in (part for part in spec.split(",") if part.strip()):
        name, _, step = item.partition("=")
        index = pick_phases(name, names)[0]
        if not step.strip().isdigit() or index < first:
            raise SystemExit(f"--seed-plan {spec}: {item!r} must be PHASE=STEP, phases in run order")
        lengths[index] = int(step) - start - sum(planned[first:index])
        if lengths[index] < 1:
            raise SystemExit(f"--seed-plan {spec}: {name} would end before it starts (the recipe's phases before it "
                             f"take {start + sum(planned[first:index])} steps)")  # fmt: skip
        start, first = int(step), index + 1
    return lengths


class BudgetStop(TrainerCallback):
    """`--budget-s`: end the phase once the budget is spent and it has a step past its warm-up."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() > self.deadline and state.global_step >= 2:
            control.should_training_stop = True


class PhaseRunTrainer(ProRLTrainer):
    """ProRLTrainer whose phases outside `timed` train no step: entered as the run enters them (the hard reset, the
    adapter shape and settings). Every phase ends with a trained-looking B (a random model's rewards are all equal, so
    its advantages and B's gradient are zero), so each reset freezes what a real run's would. After each timed phase
    `on_phase(phase, call)` gets `StepSplit`'s record of it. No final save."""

    timed: frozenset[int] = frozenset()
    deadline = float("inf")
    split: StepSplit
    on_phase: Any = None

    def _train_phase(self, phase, checkpoint, trial, ignore_keys_for_eval, **kwargs):
        if phase.index in self.timed and time.perf_counter() < self.deadline:
            output, steps = super()._train_phase(phase, checkpoint, trial, ignore_keys_for_eval, **kwargs)
            self.on_phase(phase, self.split.calls[-1])
        else:
            output, steps = TrainOutput(0, 0.0, {}), 0
            self._enter_phase(phase)
            if phase.index in self.timed:
                self.on_phase(phase, None)
        perturb_adapter(self.model, 1000 + phase.index)  # a random model's rewards are all equal: its B stays zero
        return output, steps

    def _save_final(self) -> None:
        """Not part of any step (a merged model written to the temporary folder)."""


def phase_record(trainer: ProRLTrainer, phase, call: dict | None, planned: int, prompt_tokens: int) -> dict:
    frozen = reset_ops.frozen_layers(trainer.model)
    record = {
        "index": phase.index, "name": phase.name, "recipe_max_steps": planned, "batch": phase.generation_batch_size,
        "group": phase.num_generations, "cap": phase.max_completion_length, "overlong_buffer": phase.overlong_buffer,
        "prompt_tokens": prompt_tokens, "temperature": phase.temperature, "top_p": phase.top_p,
        "lora": {"r": phase.lora_r, "alpha": phase.lora_alpha, "targets": phase.lora_target_modules},
        "resets_before": trainer.prorl_resets, "frozen_layers": len(frozen),
        "frozen_parts": sum(len(delta.parts) for _, _, delta in frozen),
        # optimizer steps one generation serves (reset-4: 64 completions, 32 per step): a steady step is their mean
        "steps_per_generation": max(trainer.args.steps_per_generation // trainer.args.gradient_accumulation_steps, 1),
    }  # fmt: skip
    if call is None:
        return dict(record, error="skipped: --budget-s reached")
    engine = trainer.rollout_engine
    steps = [{"seconds": step["seconds"], "split": split_of(step), "rollout_seconds": step["parts"].get("rollout", 0.0),
              "tokens": step["tokens"]} for step in call["steps"]]  # fmt: skip
    record.update(steps=steps, engine_captures=None if engine is None else engine.stats.captures)
    record.update({key: call[key] for key in ("peak_allocated_gib", "peak_reserved_gib") if key in call})
    print(f"[step_time] phase {phase.name}: steps {[round(step['seconds'], 2) for step in steps]} s", flush=True)
    return record


def initial_prompt_ids(tokenizer, dataset, phase) -> list[list[int]]:
    """The Initial phase's generation batch as TRL lays it out: each prompt `num_generations` times."""
    prompts = [dataset[i]["prompt"] for i in range(phase.generation_batch_size // phase.num_generations)]
    return [tokenizer(prompt).input_ids for prompt in prompts for _ in range(phase.num_generations)]


def run_phases(options, device: torch.device) -> dict:
    """One ProRLTrainer run through the recipe's phases; the selected ones timed. JSON written after each phase."""
    tokenizer = build_tiny_tokenizer()
    with tempfile.TemporaryDirectory(prefix="prorl-steps-") as workdir:
        recipe, kwargs = load_settings(options.recipe, options.set, options.smoke, options.steps_per_phase, workdir)
        as_recipe = dict(kwargs, phases=recipe.config_kwargs(dry=options.smoke)["phases"])
        planned = [phase.max_steps for phase in resolve_phases(ProRLConfig(**as_recipe), recipe.peft_config())]
        if options.prompt_tokens:
            kwargs["generation_max_prompt_length"] = options.prompt_tokens
        prompt_tokens = kwargs.get("generation_max_prompt_length") or 512
        args = ProRLConfig(**kwargs)
        names = [phase.name for phase in resolve_phases(args, recipe.peft_config())]
        timed = pick_phases(options.phases, names)
        seed_plan_lengths(options.seed_plan, names, planned)  # a bad plan stops here, not after the measurements
        dataset = prompt_dataset(tokenizer, prompt_tokens)
        split = StepSplit(device)
        start = time.perf_counter()
        trainer = PhaseRunTrainer(
            model=build_model(options.smoke, tokenizer, device), reward_funcs=recipe.reward_functions(), args=args,
            train_dataset=dataset, processing_class=tokenizer, peft_config=recipe.peft_config(),
            callbacks=[split, BudgetStop(start + options.budget_s)],
        )  # fmt: skip
        if trainer.rollout_engine is None and options.smoke:
            trainer.rollout_engine = attach_rollout_engine(trainer, allow_cpu=True)  # exercise it on CPU
        result = {"meta": meta_of(options, device, trainer, args, prompt_tokens), "names": names, "planned": planned,
                  "timed": [names[i] for i in timed], "phases": []}  # fmt: skip
        if options.profile_decode and 0 not in timed:
            result["profile"] = {"skipped": "--profile-decode profiles the Initial shape: time the initial phase too"}

        def on_phase(phase, call):
            result["phases"].append(phase_record(trainer, phase, call, planned[phase.index], prompt_tokens))
            if call is not None and phase.index == 0 and options.profile_decode:
                result["profile"] = profile_decode(trainer, initial_prompt_ids(tokenizer, dataset, phase))
            if options.json:
                options.json.write_text(json.dumps(result, indent=1))

        trainer.timed, trainer.deadline = frozenset(timed), start + options.budget_s
        trainer.split, trainer.on_phase = split, on_phase
        split.attach(trainer)
        try:
            trainer.train()
        except Exception as error:  # the phases measured so far still make their rows
            result["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
            print(f"[step_time] FAILED in phase {trainer.current_phase.name}: {result['error']}", flush=True)
        finally:
            split.detach()
    if options.json:
        options.json.write_text(json.dumps(result, indent=1))
    return result


def meta_of(options, device: torch.device, trainer: ProRLTrainer, args: ProRLConfig, prompt_tokens: int) -> dict:
    import peft
    import transformers
    import trl

    dtype = next(reset_ops.unwrap_model(trainer.model).get_base_model().parameters()).dtype
    return {
        "device": device_name(device, cpu="CPU (smoke)"),
        "date": utc_now(),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
                    f"trl {trl.__version__}",
        "recipe": options.recipe.name, "overrides": list(options.set), "prompt_tokens": prompt_tokens,
        "steps_per_phase": options.steps_per_phase, "rollout_engine": trainer.rollout_engine is not None,
        "model": ("tiny model (smoke)" if options.smoke else "Qwen2-0.5B architecture, random weights")
        + f", {str(dtype).removeprefix('torch.')} weights, bf16 {'on' if args.bf16 else 'off'}",
        "micro_batch": args.per_device_train_batch_size, "grad_accum": args.gradient_accumulation_steps,
        "gradient_checkpointing": args.gradient_checkpointing, "cudnn_guard": trainer.cudnn_attention_guard.message,
        "smoke": options.smoke,
    }  # fmt: skip


def steady_cycles(record: dict) -> list[list[dict]]:
    """The timed steps (all but the warm-up, or the only one) in whole generation cycles: where one generation serves
    n optimizer steps, n steps in a row (one with the rollout, n - 1 without) make one cycle; a trailing part cycle is
    dropped unless it is all there is."""
    steps = record["steps"][1:] or record["steps"]
    n = record.get("steps_per_generation", 1)
    cycles = [steps[i : i + n] for i in range(0, len(steps) - n + 1, n)]
    return cycles or [steps]


def phase_summary(record: dict) -> dict:
    """The steady step (median over generation cycles of a cycle's mean step: the median step where each step
    generates), each split column likewise (`other` = the step less the rest), rollout tokens/s, the phase's time."""

    def steady(value) -> float:
        return statistics.median(statistics.fmean(value(step) for step in cycle) for cycle in cycles)

    cycles = steady_cycles(record)
    step = steady(lambda s: s["seconds"])
    split = {name: steady(lambda s, name=name: s["split"][name]) for name in PARTS}
    split["other"] = step - sum(split.values())
    timed = [s for cycle in cycles for s in cycle]
    rollout = sum(s["rollout_seconds"] for s in timed)
    return {"step": step, "first": record["steps"][0]["seconds"], "split": split,
            "tokens_per_s": sum(s["tokens"] for s in timed) / rollout if rollout > 0 else None,
            "phase_seconds": step * record["recipe_max_steps"]}  # fmt: skip


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def lora_label(lora: dict) -> str:
    targets = lora["targets"] if isinstance(lora["targets"], str) else ",".join(
        t.replace("_proj", "") for t in lora["targets"] or [])  # fmt: skip
    return f"r{lora['r']} a{lora['alpha']:g} {targets}"


def phases_table(runs: list[dict], seed_plan: str) -> str:
    """One markdown table from one or more runs (`--from-json`): each phase from the first run that timed it."""
    names, planned = runs[0]["names"], runs[0]["planned"]
    by_index: dict[int, dict] = {}
    for run in runs:
        for record in run["phases"]:
            if "steps" in record and record["steps"] and record["index"] not in by_index:
                by_index[record["index"]] = dict(record, device=run["meta"]["device"])
    metas = [run["meta"] for run in runs]
    meta = metas[0]
    devices = "; ".join(dict.fromkeys(m["device"] for m in metas))
    lines = [
        f"Device: {devices} | {', '.join(dict.fromkeys(m['date'] for m in metas))} | {meta['versions']} | recipe "
        f"{meta['recipe']}{' with ' + ', '.join(meta['overrides']) if meta['overrides'] else ''} | "
        f"{meta['model']} | micro-batch {meta['micro_batch']} x grad-accum "
        f"{meta['grad_accum']}, gradient checkpointing {'on' if meta['gradient_checkpointing'] else 'off'} | "
        f"rollout engine {'on' if meta['rollout_engine'] else 'off'} | {meta['prompt_tokens']}-token prompts | "
        f"{meta['steps_per_phase']} steps per phase (the first a warm-up) | {meta['cudnn_guard']}",
        "",
        "**Every completion runs to its phase's cap** (a random-weights model does not stop early, and `min_new_tokens` "
        "forces it): worst-case steps. Steady step and split columns: seconds per optimizer step, median of the timed "
        "steps (where one generation serves n steps, of the means over n steps in a row); generation = "
        "rollout + rewards/advantages; log-prob fwd = old/reference log-probs (no grad); optimizer = gradient "
        "clipping + step; other = the step less the rest (logging, callbacks, scheduler, data).",
        "",
        "| phase | completions (prompts x group) x cap | LoRA (resets before: frozen parts) | first step (s) | "
        "steady step (s) | generation | log-prob fwd | loss fwd | backward | optimizer | other | peak alloc / "
        "reserved (GiB) | rollout tokens/s | recipe max_steps | phase time |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summaries = {}
    for index, name in enumerate(names):
        record = by_index.get(index)
        if record is None:
            why = next((r.get("error") for run in runs for r in run["phases"] if r["index"] == index), None)
            lines.append(f"| {index} {name} | {why or 'not measured'} |" + " |" * 13 + f" {planned[index]} | - |")
            continue
        summary = summaries[index] = phase_summary(record)
        split = summary["split"]
        peak = (f"{record['peak_allocated_gib']:.2f} / {record['peak_reserved_gib']:.2f}"
                if "peak_allocated_gib" in record else "-")  # fmt: skip
        rate = f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-"
        lines.append(
            f"| {index} {name} (T={record['temperature']}, top_p={record['top_p']}) | {record['batch']} "
            f"({record['batch'] // record['group']} x {record['group']}) x {record['cap']} | {lora_label(record['lora'])} "
            f"({record['resets_before']}: {record['frozen_parts']}) | {summary['first']:.1f} | **{summary['step']:.2f}** | "
            + " | ".join(f"{split[part]:.2f}" for part in PARTS + ("other",))
            + f" | {peak} | {rate} | {record['recipe_max_steps']} | {hours(summary['phase_seconds'])} |"
        )
    lines.append("")
    missing = [names[i] for i in range(len(names)) if i not in summaries]
    recipe_total = sum(s["phase_seconds"] for s in summaries.values())
    lines.append(f"Recipe plan ({sum(planned):,} steps): {hours(recipe_total)}"
                 + (f" without {', '.join(missing)} (not measured)" if missing else "") + ".")  # fmt: skip
    lengths = seed_plan_lengths(seed_plan, names, planned)
    seed_total = sum(summaries[i]["step"] * n for i, n in enumerate(lengths) if i in summaries)
    plan = ", ".join(f"{names[i]} {n:,}" for i, n in enumerate(lengths))
    lines.append(
        f"Seed-length plan (`--seed-plan {seed_plan}`: {plan} = {sum(lengths):,} steps): {hours(seed_total)}"
        + (f" without {', '.join(missing)} (not measured)" if missing else "")
        + ". Assumption: seed 000 ended Reset 1 at about step 2,600 and its best checkpoint was at step 7,600; the "
        "phases between two given ends keep the recipe's max_steps, and every step beyond the recipe's runs at the "
        "measured steady step of the phase whose end the seed gives (Reset 1 up to 2,600, Reset 4 up to 7,600)."
    )
    for run in runs:
        if run.get("error"):
            lines.append(f"{run['meta']['device']} run stopped: {run['error']}")
        profile = run.get("profile")
        if profile and "top_kernels" in profile:
            top = "; ".join(f"{k['name'][:48]} {k['us_per_step']:.1f} us" for k in profile["top_kernels"][:5])
            lines.append(
                f"Decode profile (rollout engine, Initial shape, {profile['decode_steps_profiled']} decode steps of its "
                f"CUDA graph): {profile['kernels_per_step']:.0f} kernels per decode step, "
                f"{profile['gpu_ms_per_step']:.3f} GPU ms per step; top kernels (all 20 in the JSON): {top}"
            )
        elif profile:
            lines.append(f"Decode profile: {profile.get('skipped')}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- paths mode
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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override for every phase (repeatable), e.g. training.per_device_train_batch_size=8")
    parser.add_argument("--phases", default=None, help="phases mode: the phases to time, e.g. initial,reset4 (default all)")
    parser.add_argument("--steps-per-phase", type=int, default=3, help="phases mode: steps per timed phase (1 warm-up)")
    parser.add_argument("--seed-plan", default=SEED_PLAN,
                        help="phases mode: PHASE=STEP pairs, the global step where a phase of the seed run ended")
    parser.add_argument("--profile-decode", action="store_true",
                        help="phases mode, with initial timed: torch.profiler over the engine's decode steps")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None, help="phases mode: one table from these runs")
    parser.add_argument("--paths", default=None, help=f"paths mode: comma separated, from {PATHS}")
    parser.add_argument("--steps", type=int, default=3, help="paths mode: optimizer steps per path (the first warms up)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length and prompt budget (phases: the recipe's, paths: 256)")
    parser.add_argument("--vanilla-cap", type=int, default=None, help="paths mode: run vanilla at this completion cap")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="stop after this many seconds (phases: the phase ends, the rest is skipped), table printed")
    parser.add_argument("--frozen-resets", type=int, default=0,
                        help="paths mode: hard resets (a trained-looking adapter each) before the timed steps")
    parser.add_argument("--lora-reset-mode", default="frozen", choices=["frozen", "merge"], help="paths mode")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    if options.from_json:
        runs = [json.loads(path.read_text()) for path in options.from_json]
        return emit(phases_table(runs, options.seed_plan), {"runs": runs}, options)
    if options.steps_per_phase < 1:
        parser.error("--steps-per-phase must be >= 1")
    paths = [p for p in (options.paths or "").split(",") if p]
    if set(paths) - set(PATHS):
        parser.error(f"--paths: unknown {sorted(set(paths) - set(PATHS))}; choose from {PATHS}")
    if options.smoke and paths:
        options.set = ["training.max_completion_length=6", "training.per_device_train_batch_size=4",
                       "training.generation_batch_size=8", "training.num_generations=4", "training.bf16=false",
                       "training.use_cpu=true", "peft.r=4", "peft.lora_alpha=8"] + options.set  # fmt: skip
        options.steps = min(options.steps, 2)
    elif not options.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    device = torch.device("cpu") if options.smoke else torch.device("cuda", torch.cuda.current_device())
    if not paths:  # phases mode (load_settings applies memory.SMOKE_OVERRIDES under --smoke)
        result = run_phases(options, device)
        return emit(phases_table([result], options.seed_plan), result, options)
    meta = {
        "device": device_name(device, cpu="CPU (smoke)"),
        "date": utc_now(),
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
                results.append({"path": path, "error": error_line(error)})
                print(f"[step_time] {path} FAILED: {results[-1]['error']}", flush=True)
    result = {"meta": meta, "results": results}
    if options.json:
        options.json.write_text(json.dumps(result, indent=1))
    return emit(table(meta, results), result, options)


def emit(report: str, result: dict, options) -> dict:
    print(report, flush=True)
    if options.out:
        options.out.write_text(report + "\n")
    return result


if __name__ == "__main__":
    main()
