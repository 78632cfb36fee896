"""Does ProRL learn? Validation pass@1 of (a) a multi-phase ProRL run with hard resets vs (b) one phase without resets.

    python benchmarks/learning.py --out runs/learning            # GPU (cuda + bf16): ~20M-parameter Qwen2, <= 8 min
    python benchmarks/learning.py --out /tmp/learning --smoke    # CPU, tiny model, < 60 s: checks the script runs
    python benchmarks/learning.py --out runs/learning --compare-rollout-engine   # also (a), (b) with the engine: one
                                                                 # table, same warm start and seed, one GPU

Everything happens in one process, offline:
1. A Qwen2 of tens of millions of parameters (`prorl_trl.tiny.build_tiny_model`, random init, byte-level tokenizer) is
   warm-started with TRL's `SFTTrainer` on generated arithmetic (`prorl_trl.data.synthetic`, one operation on numbers
   up to 20: `(a op b) = ?`) whose targets are the worked step and `\\boxed{answer}`. SFT stops as soon as greedy accuracy on held-out problems reaches
   `--warm-start-accuracy` (a mediocre start leaves RL something to learn, whatever the hardware's speed).
2. From that same checkpoint: (a) `ProRLTrainer` with `--phases` phases and a hard reset at each boundary (fresh
   optimizer, KL reference moved to the policy); (b) `ProRLTrainer` with one phase of the same total steps. Same
   seed, data, rewards (`boxed_answer`) and settings otherwise.
3. Both runs validate pass@1 (`ValidationCallback`: samples at temperature 1.0 on held-out problems) every
   `--eval-steps`. Outputs in `--out`: `validation.png` (both curves, phase boundaries of (a)), `learning.md` (one
   table: device, warm start, (a) final, (b) final, wall times), `learning.json` (curves and settings).
With `--compare-rollout-engine`, (a) and (b) run again with `rollout_engine` from the same warm start and seed (issue
14: the same result within noise, faster): one table row per generation path and a line per run saying whether the
engine's final pass@1 is within two standard errors of the first path's, with both wall times; the plots show the
first path.
With `--lora-rank R` the runs train a LoRA adapter (rank R on `--lora-targets`) on the bf16 warm start, as the recipes
do, and `--arms` chooses them (default then `resets,merge,no_reset`): (a) hard resets keeping each phase's delta as
frozen factors (`lora_reset_mode: frozen`, the default), (a') the same resets merging it into the bf16 weights
(`merge`), (b) one phase. Each reset is bracketed by two validations with the same sampling seed, right before (the
phase's last step) and right after it (before the next phase's first step): a reset that is a no-op on the policy
gives the same pass@1 twice (issue 27's table: what a plain merge costs at a recipe-like learning rate).
Targets: (a) >= 20 points above the warm start. Whether (a) beats (b) is reported as measured, not assumed: "yes"
only when the gap exceeds two standard errors (each validation problem counted as one Bernoulli trial, conservative).
Both runs share the seed, so their curves nearly coincide until (a)'s first reset.
Measured (H200, 2026-11-26): warm start 24.6%, (a) 59.9%, (b) 57.0%, about 4 min in all (benchmarks/results/learning.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from _common import determinism_restored, device_name  # first: the repository on sys.path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from prorl_trl.config import PhaseConfig, ProRLConfig  # noqa: E402
from prorl_trl.data.synthetic import make_arithmetic_dataset  # noqa: E402
from prorl_trl.evaluation.validation import ValidationCallback  # noqa: E402
from prorl_trl.plots import phase_boundaries, plot_training_curves, series  # noqa: E402
from prorl_trl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from prorl_trl.trainer import ProRLTrainer  # noqa: E402

# arm -> (run folder, label, lora_reset_mode or None for one phase)
ARMS = {
    "resets": ("a_prorl_resets", "(a) {phases} phases + hard resets (frozen factors)", "frozen"),
    "merge": ("a_merge_resets", "(a') {phases} phases + hard resets merging into the base", "merge"),
    "no_reset": ("b_no_reset", "(b) one phase, no reset", None),
}
TASK = {"num_steps": 1, "max_value": 20, "max_factor": 3, "style": "expression", "instruction": ""}
GPU_MODEL = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4}
SMOKE_MODEL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes, < 60 s")
    parser.add_argument("--steps", type=int, default=None, help="RL optimizer steps per run (default 240; smoke 3)")
    parser.add_argument("--phases", type=int, default=3, help="phases of run (a), hard reset at each boundary")
    parser.add_argument("--eval-steps", type=int, default=None, help="validate every N steps (default 20; smoke 1)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="RL learning rate (both runs)")
    parser.add_argument(
        "--beta", type=float, default=0.02, help="KL coefficient (both runs; resets move (a)'s reference)"
    )
    parser.add_argument("--warm-start-accuracy", type=float, default=0.3, help="stop SFT at this greedy accuracy")
    parser.add_argument("--max-sft-steps", type=int, default=None, help="SFT step cap (default 1500; smoke 4)")
    parser.add_argument(
        "--compiled-generation", action="store_true", help="static KV cache + compiled decode step (GPU; ProRLConfig)"
    )
    parser.add_argument(
        "--rollout-engine", action="store_true", help="CUDA-graph decode loop for rollouts and validation (GPU; ProRLConfig)"
    )
    parser.add_argument(
        "--compare-rollout-engine", action="store_true",
        help="run (a) and (b) again with the rollout engine from the same warm start: one row each in the table",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: all weights)")
    parser.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target modules")
    parser.add_argument(
        "--arms", default=None,
        help=f"comma separated, from {list(ARMS)} (default: resets,no_reset; with --lora-rank: resets,merge,no_reset)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    default_arms = "resets,merge,no_reset" if args.lora_rank else "resets,no_reset"
    args.arms = [arm for arm in (args.arms or default_arms).split(",") if arm]
    if set(args.arms) - set(ARMS) or ("merge" in args.arms and not args.lora_rank):
        parser.error(f"--arms: choose from {list(ARMS)} ('merge' needs --lora-rank)")
    args.steps = args.steps or (3 if args.smoke else 240)
    args.eval_steps = args.eval_steps or (1 if args.smoke else 20)
    args.max_sft_steps = args.max_sft_steps or (4 if args.smoke else 1500)
    if args.phases < 2 or args.steps < args.phases:
        parser.error(f"--phases must be >= 2 and <= --steps (got {args.phases} phases, {args.steps} steps)")
    return args


class StopAtAccuracy(TrainerCallback):
    """Greedy accuracy on held-out problems every `every` SFT steps; stops training once it reaches `target`."""

    def __init__(self, tokenizer, rows, target: float, every: int, max_new_tokens: int = 40):
        self.tokenizer, self.rows, self.target, self.every = tokenizer, rows, target, every
        self.max_new_tokens = max_new_tokens  # the RL cap: a longer task's solutions must fit the probe too
        self.accuracy = 0.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self.accuracy = greedy_accuracy(model, self.tokenizer, self.rows, self.max_new_tokens)
            print(f"[warm start] step {state.global_step}: greedy accuracy {self.accuracy:.1%}", flush=True)
            control.should_training_stop = self.accuracy >= self.target


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows, max_new_tokens: int = 40) -> float:
    from rewards import get_reward

    reward = get_reward("boxed_answer")
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    batch = tokenizer(list(rows["prompt"]), return_tensors="pt", padding=True).to(model.device)
    output = model.generate(
        **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    scores = reward(prompts=list(rows["prompt"]), completions=texts, answer=list(rows["answer"]))
    return sum(score > 0 for score in scores) / len(scores)


def warm_start(args, tokenizer, device_kwargs, out: Path, task: dict | None = None,
               deterministic: bool = False) -> tuple[Path, float, int, float]:
    """SFT until `args.warm_start_accuracy` on `task` (make_arithmetic_dataset's settings; default `TASK`).

    `deterministic`: HF's `full_determinism` (deterministic kernels, a fixed cuBLAS workspace), so the same settings
    make the same weights again on another machine of the same kind: a study whose runs continue on a later machine
    makes its warm start there again instead of carrying it."""
    task = TASK if task is None else task
    started = time.time()
    model = build_tiny_model(tokenizer, seed=args.seed, **(SMOKE_MODEL if args.smoke else GPU_MODEL))
    train = make_arithmetic_dataset(512 if args.smoke else 20000, seed=args.seed, **task)
    train = train.map(lambda row: {"completion": row["solution"]}).select_columns(["prompt", "completion"])
    probe = make_arithmetic_dataset(8 if args.smoke else 128, seed=args.seed + 7, **task)
    stopper = StopAtAccuracy(tokenizer, probe, args.warm_start_accuracy, every=2 if args.smoke else 25,
                             max_new_tokens=getattr(args, "max_new_tokens", 40))
    config = SFTConfig(
        output_dir=str(out / "sft"),
        max_steps=args.max_sft_steps,
        per_device_train_batch_size=8 if args.smoke else 64,
        learning_rate=1e-3 if args.smoke else 3e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=25,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        full_determinism=deterministic,
        disable_tqdm=True,
        **device_kwargs,
    )
    with determinism_restored():  # full_determinism switches process-wide state; callers may train in this process
        SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer, callbacks=[stopper]).train()
    path = out / "warm_start"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    parameters = sum(p.numel() for p in model.parameters())
    return path, time.time() - started, parameters, stopper.accuracy


class AroundResets(TrainerCallback):
    """Validates right before each hard reset (when a phase's `train()` ends) and right after it (when the next one
    begins, the reset done), with the same sampling seed: `pairs` holds (global step, pass@1 before, pass@1 after)."""

    def __init__(self, validation: ValidationCallback):
        self.validation, self.pairs, self._before = validation, [], None

    def on_train_end(self, args, state, control, **kwargs):
        self._before = self.validation.evaluate()["eval_pass@1"]

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.validation.trainer
        if self._before is not None and trainer.prorl_resets > len(self.pairs):
            after = self.validation.evaluate()["eval_pass@1"]
            self.pairs.append((trainer.prorl_global_step, self._before, after))
        self._before = None


def rl_run(args, name: str, phases: list[PhaseConfig], warm: Path, tokenizer, device_kwargs, out: Path,
           rollout_engine: bool, lora_reset_mode: str = "frozen"):
    """One ProRLTrainer run from the warm start; returns (log history, wall seconds, pass@1 around each reset)."""
    started = time.time()
    train = make_arithmetic_dataset(256 if args.smoke else 20000, seed=args.seed + 1, **TASK)
    validation = make_arithmetic_dataset(validation_problems(args), seed=args.seed + 2, **TASK)
    max_completion_length = 12 if args.smoke else 40
    config = ProRLConfig(
        output_dir=str(out / name),
        phases=phases,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup",  # restarts at each reset: eases the fresh optimizer in
        warmup_steps=1 if args.smoke else 10,
        per_device_train_batch_size=8
        if args.smoke
        else 512,  # 64 prompts x 8: a GPU generates them at little extra cost
        num_generations=4 if args.smoke else 8,
        max_completion_length=max_completion_length,
        temperature=1.0,
        beta=args.beta,
        epsilon_high=0.28,
        save_strategy="no",
        save_merged_on_reset=False,
        compiled_generation=args.compiled_generation,
        rollout_engine=rollout_engine,
        lora_reset_mode=lora_reset_mode,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
        model_init_kwargs={"dtype": "bfloat16" if device_kwargs["bf16"] else "float32"},
        **device_kwargs,
    )
    callback = ValidationCallback(
        validation,
        "boxed_answer",
        eval_steps=args.eval_steps,
        num_generations=4 if not args.smoke else 2,
        temperature=1.0,
        max_completion_length=max_completion_length,
        batch_size=50,
        at_start=True,
        seed=args.seed,
    )
    around = AroundResets(callback)
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        targets = args.lora_targets.split(",")
        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=targets)
    trainer = ProRLTrainer(
        model=str(warm),
        reward_funcs=[_boxed()],
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[callback, around],
        peft_config=peft_config,
    )
    trainer.train()
    return trainer.prorl_log_history, time.time() - started, around.pairs


def validation_problems(args) -> int:
    return 8 if args.smoke else 200


def _boxed():
    from rewards import get_reward

    return get_reward("boxed_answer")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device_kwargs = {"bf16": True} if cuda else {"use_cpu": True, "bf16": False}
    device = device_name() if cuda else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    hf_logging.set_verbosity_error()
    tokenizer = build_tiny_tokenizer()

    warm, sft_seconds, parameters, sft_accuracy = warm_start(args, tokenizer, device_kwargs, out)
    base, extra = divmod(args.steps, args.phases)
    prorl_phases = [
        PhaseConfig(name=f"phase-{i}", max_steps=base + (1 if i < extra else 0), hard_reset=i > 0)
        for i in range(args.phases)
    ]
    if args.lora_rank or args.arms != ["resets", "no_reset"]:
        return compare_resets(args, out, warm, tokenizer, device_kwargs, prorl_phases, device, parameters,
                              sft_seconds, sft_accuracy)  # fmt: skip
    first_path = "rollout_engine" if args.rollout_engine else (
        "compiled_generation" if args.compiled_generation else "generate")  # fmt: skip
    paths = [first_path] + (["rollout_engine"] if args.compare_rollout_engine and not args.rollout_engine else [])
    runs = []
    for path in paths:
        suffix = "" if path == first_path else f"_{path}"  # the first path keeps the folder names it always had
        engine = path == "rollout_engine"
        history_a, seconds_a, _ = rl_run(args, "a_prorl_resets" + suffix, prorl_phases, warm, tokenizer, device_kwargs,
                                         out, engine)  # fmt: skip
        single = [PhaseConfig(name="single", max_steps=args.steps)]
        history_b, seconds_b, _ = rl_run(args, "b_no_reset" + suffix, single, warm, tokenizer, device_kwargs, out,
                                         engine)  # fmt: skip
        curve_a, curve_b = series(history_a, ("eval_pass@1",)), series(history_b, ("eval_pass@1",))
        runs.append({
            "generation": path, "warm_start_pass@1": curve_a[1][0],
            "a_final_pass@1": curve_a[1][-1], "b_final_pass@1": curve_b[1][-1],
            "a_best_pass@1": max(curve_a[1]), "b_best_pass@1": max(curve_b[1]),
            "seconds": {"warm_start": round(sft_seconds, 1), "a": round(seconds_a, 1), "b": round(seconds_b, 1)},
            "curves": {"a": curve_a, "b": curve_b}, "history_a": history_a,
        })  # fmt: skip

    first = runs[0]
    history_a = first.pop("history_a")  # the plots show the first path's runs
    training_a = [entry for entry in history_a if "reward" in entry]
    for run in runs[1:]:
        run.pop("history_a")
    plots = plot_training_curves(
        training_a,
        out,
        validation={f"(a) ProRL, {args.phases} phases + resets": first["curves"]["a"],
                    "(b) one phase, no reset": first["curves"]["b"]},  # fmt: skip
        boundaries=phase_boundaries(history_a),
        prefix="",
    )
    result = {
        "device": device,
        "parameters": parameters,
        "steps": args.steps,
        "phases": args.phases,
        "learning_rate": args.learning_rate,
        "beta": args.beta,
        "smoke": args.smoke,
        "validation_problems": validation_problems(args),
        "warm_start_greedy_accuracy": sft_accuracy,
        **first,  # the first path's figures at the top level, as before
        "runs": runs,
        "plots": [p.name for p in plots],
    }
    table = render_table(result)
    (out / "learning.md").write_text(table + "\n")
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print(table)
    return result


def compare_resets(args, out: Path, warm: Path, tokenizer, device_kwargs, prorl_phases, device, parameters,
                   sft_seconds, sft_accuracy) -> dict:
    """`--arms` (with `--lora-rank`, issue 27): each arm from the same warm start; one table with the final and best
    pass@1 of each and pass@1 right before and right after each of its resets."""
    arms = {}
    for arm in args.arms:
        folder, label, mode = ARMS[arm]
        phases = prorl_phases if mode else [PhaseConfig(name="single", max_steps=args.steps)]
        history, seconds, pairs = rl_run(args, folder, phases, warm, tokenizer, device_kwargs, out,
                                         args.rollout_engine, lora_reset_mode=mode or "frozen")  # fmt: skip
        steps, values = series(history, ("eval_pass@1",))
        arms[arm] = {"label": label.format(phases=args.phases), "curve": (steps, values), "seconds": round(seconds, 1),
                     "final_pass@1": values[-1], "best_pass@1": max(values), "around_resets": pairs,
                     "history": history}  # fmt: skip
    first = next(iter(arms.values()))
    plots = plot_training_curves(
        [entry for entry in first["history"] if "reward" in entry], out,
        validation={arm["label"]: arm["curve"] for arm in arms.values()},
        boundaries=phase_boundaries(first["history"]), prefix="",
    )  # fmt: skip
    for arm in arms.values():
        del arm["history"]
    result = {
        "device": device, "parameters": parameters, "steps": args.steps, "phases": args.phases,
        "learning_rate": args.learning_rate, "beta": args.beta, "smoke": args.smoke,
        "lora": {"r": args.lora_rank, "targets": args.lora_targets} if args.lora_rank else None,
        "validation_problems": validation_problems(args), "warm_start_greedy_accuracy": sft_accuracy,
        "warm_start_pass@1": first["curve"][1][0], "warm_start_seconds": round(sft_seconds, 1),
        "arms": arms, "plots": [p.name for p in plots],
    }  # fmt: skip
    table = render_reset_table(result)
    (out / "learning.md").write_text(table + "\n")
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print(table)
    return result


def render_reset_table(r: dict) -> str:
    """One row per arm: final and best pass@1 (points over the warm start), pass@1 before -> after each reset, wall
    time; then each arm against the first, with two standard errors."""
    lora = f", LoRA r{r['lora']['r']} on {r['lora']['targets']}" if r["lora"] else ", all weights"
    lines = [
        f"| {r['device']}{' (smoke)' if r['smoke'] else ''}, {r['parameters'] / 1e6:.1f}M params (bf16 where on GPU)"
        f"{lora}, lr {r['learning_rate']:g}, {r['steps']} RL steps | final pass@1 | best pass@1 | "
        "pass@1 right before -> right after each reset | wall (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    start = r["warm_start_pass@1"]
    for arm in r["arms"].values():
        around = "; ".join(f"step {step}: {before:.1%} -> {after:.1%}" for step, before, after in arm["around_resets"])
        lines.append(
            f"| {arm['label']} | {arm['final_pass@1']:.1%} ({100 * (arm['final_pass@1'] - start):+.1f} pts) "
            f"| {arm['best_pass@1']:.1%} | {around or '-'} | {arm['seconds']:.0f} |"
        )
    arms = list(r["arms"].values())
    lines.append("")
    lines.append(f"warm start pass@1 {start:.1%} ({r['warm_start_seconds']:.0f} s of SFT)")
    for arm in arms[1:]:
        a, b = arms[0]["final_pass@1"], arm["final_pass@1"]
        two_se = two_standard_errors(a, b, r["validation_problems"])
        verdict = "significant" if abs(a - b) > two_se else "within noise"
        lines.append(
            f"{arms[0]['label']} vs {arm['label']}: {100 * (a - b):+.1f} pts (2 s.e. {100 * two_se:.1f}, {verdict})"
        )
    return "\n".join(lines)


def two_standard_errors(a: float, b: float, problems: int) -> float:
    """Two standard errors of the difference of two pass rates, each problem one Bernoulli trial (conservative)."""
    return 2 * math.sqrt((a * (1 - a) + b * (1 - b)) / problems)


def render_table(r: dict) -> str:
    """One header and one row per generation path (`r["runs"]`; results from before it are one run at the top level)."""
    runs = r.get("runs") or [r]
    several = len(runs) > 1
    header = (
        f"| {r['device']}{' (smoke)' if r['smoke'] else ''}, {r['parameters'] / 1e6:.1f}M params, {r['steps']} RL steps"
        + (" " if several else f", {runs[0].get('generation', 'generate')} ")
        + "| warm start pass@1 | (a) ProRL final | (b) no-reset final | (a) beats (b)? | wall time warm start / (a) / (b) (s) |"
    )
    rows = []
    for run in runs:
        gain_a, gain_b = (
            100 * (run["a_final_pass@1"] - run["warm_start_pass@1"]),
            100 * (run["b_final_pass@1"] - run["warm_start_pass@1"]),
        )
        a, b = run["a_final_pass@1"], run["b_final_pass@1"]
        two_se = two_standard_errors(a, b, r["validation_problems"])
        if a - b > two_se:
            verdict = f"yes, {100 * (a - b):+.1f} pts (2 s.e. {100 * two_se:.1f})"
        elif b - a > two_se:
            verdict = f"no, (b) is better: {100 * (a - b):+.1f} pts (2 s.e. {100 * two_se:.1f})"
        else:
            verdict = f"not significantly: {100 * (a - b):+.1f} pts (2 s.e. {100 * two_se:.1f})"
        seconds = run["seconds"]
        rows.append(
            f"| validation pass@1 (T=1.0), (a) = {r['phases']} phases + hard resets"
            + (f", {run['generation']} " if several else " ")
            + f"| {run['warm_start_pass@1']:.1%} | {run['a_final_pass@1']:.1%} ({gain_a:+.1f} pts) "
            f"| {run['b_final_pass@1']:.1%} ({gain_b:+.1f} pts) | {verdict} "
            f"| {seconds['warm_start']:.0f} / {seconds['a']:.0f} / {seconds['b']:.0f} |"
        )
    lines = [header, "| --- | --- | --- | --- | --- | --- |", *rows]
    for run in runs[1:]:  # the same runs on another generation path: same result within noise, and how fast
        lines.append("")
        for key, label in (("a", "(a)"), ("b", "(b)")):
            first, other = runs[0][f"{key}_final_pass@1"], run[f"{key}_final_pass@1"]
            two_se = two_standard_errors(first, other, r["validation_problems"])
            same = "within noise" if abs(other - first) <= two_se else "NOT within noise"
            lines.append(
                f"{label} {run['generation']} vs {runs[0]['generation']}: {100 * (other - first):+.1f} pts "
                f"(2 s.e. {100 * two_se:.1f}, {same}); wall {runs[0]['seconds'][key]:.0f} -> {run['seconds'][key]:.0f} s"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
