"""Does prolonged RL with hard resets help? Four arms x several seeds from one warm start (issue 29).

    python benchmarks/prolonged.py --out runs/prolonged --gpus 4 --per-gpu 4 --time-limit 500 --resume  # GPU; repeat
                                                   # the same command (10-minute calls) until every run is finished
                                                   # (--mps --per-gpu 8: twice the runs per GPU at small shapes)
    python benchmarks/prolonged.py --out runs/prolonged --report-only   # the report again, from rows + settings.json
    python benchmarks/prolonged.py --out runs/pilot --pilot --pilot-grid 'task_steps=1-2,1-3;learning_rate=1e-4,3e-5'
    python benchmarks/prolonged.py --out /tmp/prolonged --smoke                        # CPU, tiny model, < 90 s
    python benchmarks/prolonged.py --out runs/part1 --arms prorl,one_phase --solo-arms prorl --warm-start WARM ...
                      # arms split over calls: one warm start (--warm-start); prolonged_gather.py packs each call
                      # and gathers them into one report (refusing calls that are not one study's)

1. One warm start for every arm and seed: `learning.py`'s SFT of a ~19M-parameter Qwen2 (byte-level tokenizer) until
   greedy accuracy `--warm-start-accuracy`, here on a difficulty mix of arithmetic (`--task-steps 1-3` operations on
   numbers up to `--task-max-value`), saved in `OUT/warm_start` and reused.
2. Each (arm, seed) is a worker process (`--worker ARM --seed S`), at most `--per-gpu` per GPU (CUDA_VISIBLE_DEVICES
   round-robin). RL trains a LoRA adapter (`--lora-rank` on `--lora-targets`) on the bf16 warm start with exact
   resets (`lora_reset_mode="frozen"`), DAPO loss, clip 0.2/0.28, `--prompts-per-step` x `--num-generations`
   completions per step, the rollout engine on GPU. Arms, all `--steps` long, same data (seed S) and warm start:
   (a) one_phase: top_p 0.7, T 1.0 throughout; (b) prorl: 4 phases with a hard reset (optimizer and reference) at
   each boundary, top_p 0.7 -> 0.9 -> 1.0 -> (1.0, T 1.2, twice the group: 2 optimizer steps per generation batch,
   the prompts per generation batch kept); (c) no_reset: (b)'s phases without resets; (d) plateau: (a) plus
   `HardResetCallback(on_plateau=--plateau-patience)` on validation pass@1. Knob arms, each (c) plus one part of
   (b)'s reset at the boundaries (`RESET_PARTS`), compared with (c): opt (a fresh optimizer state and warm-up), ref (the
   KL reference moved to the policy: a reference-only copy of the live delta), adapter (a fresh adapter, the old one
   frozen for the policy only, the optimizer's moments and schedule kept).
3. Every `--eval-steps`, `ValidationCallback` samples `--val-samples` completions (T 1.0) for `--val-problems` held-out
   problems: unbiased pass@1/8/64/256 (those below n) and pass@n, never solved = 1 - pass@n. Workers append every log
   entry to `OUT/runs/<arm>-s<seed>/rows.jsonl` and each validation's per-problem correct counts to `counts.jsonl`
   (problems newly solved or lost against the warm start, the first validation; final pass@1 per number of
   operations), checkpoint every `--save-steps` and write `done.json` at the end; `--resume` skips finished runs and
   continues the others from their latest checkpoint. `--time-limit` (or SIGTERM) stops the workers after their
   current step, with a checkpoint, and still writes the report: `OUT/prolonged.md`, `prolonged.json`, PNGs. A run
   whose gradients turn NaN/inf stops there (`stop_on_nonfinite`): `stopped.json`, reported as such, not retried.
`--pilot`: arm (a), one seed, over `--pilot-grid` (any option, `;` between options, `,` between values), to choose the
task where (a) plateaus: `OUT/pilot.md` (plateaued: gain over the last half <= 2 s.e.).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from _common import determinism_restored, device_name  # first: the repository on sys.path

import learning  # noqa: E402

ARMS = {
    "one_phase": "(a) one phase",
    "prorl": "(b) 4 phases + hard resets",
    "no_reset": "(c) 4 phases, no reset",
    "plateau": "(d) one phase + resets on a plateau",
    # the knob arms: one part of (b)'s reset at each boundary of (c)'s schedule, each compared with (c)
    "opt": "opt: (c) + a fresh optimizer at each boundary",
    "ref": "ref: (c) + the KL reference moved to the policy at each boundary",
    "adapter": "adapter: (c) + a fresh adapter at each boundary (the old one frozen for the policy)",
}
# (c) - (a) is the schedule without any reset, so (b) - (a) splits into it and (b) - (c)
PAIRS = (("prorl", "one_phase"), ("prorl", "no_reset"), ("no_reset", "one_phase"), ("plateau", "one_phase"),
         ("opt", "no_reset"), ("ref", "no_reset"), ("adapter", "no_reset"))  # fmt: skip
SCHEDULED = ("prorl", "no_reset", "opt", "ref", "adapter")  # the arms on the 4-phase schedule
RESET_AT_BOUNDARIES = ("prorl", "opt", "ref", "adapter")  # ... and those of them that reset at its boundaries
# (reset_adapter, reset_optimizer, reset_reference) of the resets an arm makes; (b) and (d) reset all three
RESET_PARTS = {"opt": (False, True, False), "ref": (False, False, True), "adapter": (True, False, False)}
PILOT_HEADER = (
    "| setting | start pass@1 | start pass@n | mid | final | best | gain over the last half | plateaued? "
    "| final pass@n | curve (step:%) |"
)
SCHEDULE = ((0.7, 1.0, 1), (0.9, 1.0, 1), (1.0, 1.0, 1), (1.0, 1.2, 2))  # (top_p, temperature, group x) per phase
ROW_KINDS = (("eval_pass@1", "eval"), ("prorl/phase_start", "start"), ("reward", "train"))  # else "other" (summaries)
VALIDATION_SEED = 10_000  # one held-out set and one validation sampling seed for every arm and seed
KEEP = ("entropy", "kl", "grad_norm", "completions/mean_length", "loss", "learning_rate", "step", "clip_ratio/region_mean")
# two-sided 95% quantiles of Student's t by degrees of freedom; between rows the lower row's (wider: conservative)
T95 = {**dict(enumerate((12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
                         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
                         2.052, 2.048, 2.045, 2.042), start=1)), 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip
# option: (GPU default, --smoke default)
SIZES = {
    "seeds": ("0,1,2", "0,1"), "steps": (600, 4), "eval_steps": (50, 1), "save_steps": (50, 1),
    "val_problems": (200, 4), "val_samples": (256, 4), "prompts_per_step": (64, 2), "num_generations": (8, 4),
    "max_completion_length": (48, 12), "lora_rank": (32, 4), "warmup_steps": (10, 1), "max_sft_steps": (1500, 4),
    "plateau_patience": (3, 1), "launch": ("subprocess", "inline"),
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--seeds", help="comma separated (default 0,1,2; smoke 0,1)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma separated, from {list(ARMS)}")
    p.add_argument("--steps", type=int, help="RL optimizer steps per run (default 600; a multiple of 4 x eval steps)")
    p.add_argument("--gpus", type=int, help="GPUs to spread workers over (default: all visible)")
    p.add_argument("--per-gpu", type=int, default=4, help="concurrent workers per GPU")
    p.add_argument("--solo-arms", default="", help="comma separated arms whose runs each get a GPU to themselves")
    p.add_argument("--launch", choices=("subprocess", "inline"), help="workers as processes (default) or in-process")
    p.add_argument("--mps", action="store_true",
                   help="the workers share each GPU through an NVIDIA MPS daemon of this study's own (its pipe and "
                   "log under OUT/mps; started before the workers, quit after them): their kernels then run side by "
                   "side instead of in turns. On one H200 at round 4's shape, 8 runs took 0.66 s per step with it "
                   "and 4 runs took 0.56 s without it, so twice the runs per GPU")  # fmt: skip
    p.add_argument("--time-limit", type=float, help="seconds: then stop workers with a checkpoint and report")
    p.add_argument("--resume", action="store_true", help="skip finished runs, continue the others from checkpoints")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from OUT/runs/*/rows.jsonl")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes")
    p.add_argument("--pilot", action="store_true", help="arm one_phase, first seed, over --pilot-grid")
    p.add_argument("--pilot-grid", default="", help="e.g. 'task_steps=1-2,1-3;learning_rate=1e-4,3e-5'")
    task = p.add_argument_group("task and warm start")
    task.add_argument("--task-steps", default="1-3", help="operations per problem, 'low-high'")
    task.add_argument("--task-max-value", type=int, default=20, help="largest number in a problem")
    task.add_argument("--warm-start", help="a warm start folder made earlier (with warm_start.json), used as is")
    task.add_argument("--warm-start-sha256", help="refuse to run unless the warm start's weights have this sha256 "
                      "(runs continued on another machine, the warm start made again there; warm_start.json has it)")
    task.add_argument("--export-warm-start", metavar="DIR",
                      help="make or check OUT's warm start, write a bfloat16 copy of it to DIR and stop: half the "
                      "bytes, to carry to another machine; GPU runs read the warm start in bfloat16, so a run from the "
                      "copy is the run from the original")  # fmt: skip
    task.add_argument("--warm-start-accuracy", type=float, default=0.3, help="stop SFT at this greedy accuracy")
    task.add_argument("--max-sft-steps", type=int, help="SFT step cap (default 1500)")
    rl = p.add_argument_group("RL")
    rl.add_argument("--learning-rate", type=float, default=1e-4)
    rl.add_argument("--beta", type=float, default=0.001, help="KL coefficient")
    rl.add_argument("--lora-rank", type=int, help="LoRA rank (default 32), alpha = 2 x rank")
    rl.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    rl.add_argument("--prompts-per-step", type=int, help="prompts per optimizer step (default 64)")
    rl.add_argument("--num-generations", type=int, help="group size (default 8; twice that in (b)/(c)'s last phase)")
    rl.add_argument("--max-completion-length", type=int, help="default 48")
    rl.add_argument("--warmup-steps", type=int, help="LR warm-up, restarted every phase (default 10)")
    rl.add_argument("--save-steps", type=int, help="checkpoint every N steps (default 50)")
    rl.add_argument("--rollout-engine", choices=("on", "off"), default="on", help="GPU: the rollout engine, or generate")
    rl.add_argument("--consolidate-frozen-parts", choices=("on", "off"), default="on",
                    help="join each layer's frozen parts at a reset (one part's step cost; float32-exact)")
    rl.add_argument("--kl-clamp", choices=("on", "off"), default="on", help="bound the KL term as verl's low_var_kl")
    rl.add_argument("--cudnn-attention-guard", choices=("auto", "always", "off"), default="auto",
                    help="ProRLConfig.cudnn_attention_guard: keep cuDNN's SDPA backward from making gradients NaN")
    rl.add_argument("--full-determinism", choices=("on", "off"), default="off",
                    help="TrainingArguments.full_determinism (deterministic algorithms, cuDNN deterministic, cuBLAS "
                         "workspace): a probe of where GPU runs of one configuration part; costs speed")  # fmt: skip
    rl.add_argument("--plateau-patience", type=int, help="arm (d): evaluations without improvement (default 3)")
    rl.add_argument("--plateau-min-delta", type=float, default=0.01, help="arm (d): smallest pass@1 improvement")
    val = p.add_argument_group("validation")
    val.add_argument("--eval-steps", type=int, help="validate every N steps (default 50)")
    val.add_argument("--val-problems", type=int, help="held-out problems (default 200)")
    val.add_argument("--val-samples", type=int,
                     help="samples per problem, the n of pass@k (default 256; 2048 sequences per generate call)")
    val.add_argument("--step-split", action="store_true",
                     help="time every training step's parts (generation with its rollout, log-prob forwards, loss "
                     "forward, backward, optimizer, other; `_step_split.StepSplit`, the device synchronised at each "
                     "part's edges) into runs/<run>/split.jsonl; the report gives each arm's medians")  # fmt: skip
    internal = p.add_argument_group("worker (set by the parent)")
    internal.add_argument("--worker", help="'warm_start' or an arm")
    internal.add_argument("--seed", type=int, default=0)
    internal.add_argument("--run-dir")
    internal.add_argument("--warm-dir")
    args = p.parse_args(argv)
    for name, (gpu, smoke) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else gpu)
    args.seeds = [int(s) for s in str(args.seeds).split(",") if s]
    args.arms = [arm for arm in args.arms.split(",") if arm]
    args.solo_arms = [arm for arm in str(args.solo_arms).split(",") if arm]
    if set(args.arms + args.solo_arms) - set(ARMS):
        p.error(f"--arms, --solo-arms: choose from {list(ARMS)}")
    if args.pilot and args.warm_start_sha256:
        p.error("--warm-start-sha256 names one warm start, and --pilot trains one per task: drop one of the two")
    if args.mps and args.launch == "inline":
        p.error("--mps shares a GPU among worker processes, and --launch inline (the --smoke default) starts none: "
                "add --launch subprocess or drop --mps")
    if args.steps % 4 or (args.steps // 4) % args.eval_steps:
        p.error(f"--steps ({args.steps}) must be 4 phases of a multiple of --eval-steps ({args.eval_steps})")
    return args


def task_of(args) -> dict:
    low, high = (int(v) for v in args.task_steps.split("-"))
    return {"num_steps": (low, high), "max_value": args.task_max_value, "max_factor": 3, "style": "expression",
            "instruction": ""}  # fmt: skip


@functools.cache
def study_tokenizer():
    """The byte-level tiny tokenizer, built once (building it takes seconds)."""
    from prorl_trl.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def longest_solution_tokens(args, examples: int = 4000) -> tuple[int, dict[int, int]]:
    """Tokens (with the end token) of the longest reference solution among `examples` problems of this study's task,
    and how many problems need each length. A cap below a solution makes that problem unsolvable within the cap."""
    import random

    from prorl_trl.data.synthetic import arithmetic_example

    tokenizer, task = study_tokenizer(), task_of(args)
    lengths: dict[int, int] = defaultdict(int)
    for index in range(examples):
        solution = arithmetic_example(random.Random(f"cap-check-{index}"), **task)["solution"]
        lengths[len(tokenizer(solution, add_special_tokens=False)["input_ids"]) + 1] += 1
    return max(lengths), dict(lengths)


def check_completion_cap(args) -> None:
    """Refuses a `--max-completion-length` that cuts reference solutions of this task (GPU sizes; the smoke's tiny
    caps are meant to truncate): pass@k would then measure the cap, and "never solved" would count problems the cap
    forbids, not problems the policy cannot solve. The greedy probe of the warm start uses the same cap."""
    if args.smoke:
        return
    longest, lengths = longest_solution_tokens(args)
    if args.max_completion_length < longest:
        cut = sum(count for length, count in lengths.items() if length > args.max_completion_length)
        raise SystemExit(
            f"--max-completion-length {args.max_completion_length} cuts the reference solution of "
            f"{cut / sum(lengths.values()):.0%} of this task's problems (--task-steps {args.task_steps} "
            f"--task-max-value {args.task_max_value}: solutions up to {longest} tokens with the end token), so "
            f"pass@k would measure the cap. Set --max-completion-length {16 * math.ceil((longest + 8) / 16)} or more."
        )


def ks_of(args) -> list[int]:
    """The k of pass@k logged and reported: those of 1, 8, 64 and 256 below n, and n itself."""
    return sorted({1, *(k for k in (8, 64, 256) if k < args.val_samples), args.val_samples})


# ----------------------------------------------------------------------------------------------------- statistics
def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n)); the s.e. is nan for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def t_interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the 95% confidence interval of the mean, t distribution with n - 1 degrees of freedom."""
    mean, se = mean_se(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    t = T95[max(dof for dof in T95 if dof <= len(values) - 1)]
    return mean, mean - t * se, mean + t * se


def compared_pairs(args) -> list[tuple[str, str]]:
    return [(x, y) for x, y in PAIRS if {x, y} <= set(args.arms)]


def short(arm: str) -> str:
    """The arm's label in pairs: "(a)" .. "(d)", or the knob's name."""
    return ARMS[arm].split(" ")[0].rstrip(":")


def ci_text(low: float, high: float, scale: float) -> str:
    """A 95% interval as reports print it ("n/a" for one value)."""
    return "n/a" if math.isnan(low) else f"[{scale * low:+.1f}, {scale * high:+.1f}]"


def pair_line(label: str, seeds: list[int], diffs: list[float], scale: float = 100,
              unit: str = "pts") -> tuple[str, dict]:
    """A report line for one paired difference (mean, 95% t interval, per seed) and its JSON record."""
    mean, low, high = t_interval(diffs)
    ci = ci_text(low, high, scale)
    per_seed = ", ".join(f"s{seed} {scale * d:+.1f}" for seed, d in zip(seeds, diffs))
    line = f"- {label}: {scale * mean:+.1f} {unit}, 95% CI {ci} (n={len(diffs)}); per seed: {per_seed}"
    return line, {"mean": mean, "ci95": [low, high], "per_seed": diffs}


# ------------------------------------------------------------------------------------------------------- workers
def device_kwargs(args) -> dict:
    import torch

    return {"bf16": True} if torch.cuda.is_available() and not args.smoke else {"use_cpu": True, "bf16": False}


def run_device(args) -> str:
    import torch

    return device_name() if torch.cuda.is_available() and not args.smoke else f"CPU ({os.cpu_count()} cores)"


def run_warm_start(args) -> None:
    """`learning.warm_start` on this study's task mix, into `--warm-dir` (which must be named `warm_start`). A given
    `--warm-start` is copied there by `main` instead (`copy_warm_start`), so this worker never runs for it."""
    from prorl_trl.tiny import build_tiny_tokenizer

    warm = Path(args.warm_dir)
    if (warm / "warm_start.json").is_file():
        return
    settings = argparse.Namespace(seed=0, smoke=args.smoke, warm_start_accuracy=args.warm_start_accuracy,
                                  max_sft_steps=args.max_sft_steps, max_new_tokens=args.max_completion_length)  # fmt: skip
    path, seconds, parameters, accuracy = learning.warm_start(
        settings, build_tiny_tokenizer(), device_kwargs(args), warm.parent, task=task_of(args), deterministic=True
    )
    assert path == warm, (path, warm)
    info = {"seconds": round(seconds, 1), "parameters": parameters, "greedy_accuracy": accuracy, "task": task_of(args),
            "sha256": weights_sha256(warm)}  # fmt: skip
    (warm / "warm_start.json").write_text(json.dumps(info, indent=1))


def weights_sha256(folder: Path) -> str:
    """The sha256 of a saved model's weights files, in name order: two warm starts are the same iff these are."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def warm_start_matches(warm: Path, expected: str) -> tuple[bool, str]:
    """(whether `warm` is the warm start of sha256 `expected`, its weights' sha256): the same weights, or the intact
    bfloat16 copy of them (`warm_start.json`'s own sha256 and `made_from_sha256`)."""
    found = weights_sha256(warm)
    info = json.loads((warm / "warm_start.json").read_text())
    copy = found == info.get("sha256") and info.get("made_from_sha256") == expected
    return found == expected or copy, found


def check_warm_start_sha256(args, warm: Path) -> None:
    """`--warm-start-sha256`: runs continue only from the warm start they began from (one made again elsewhere
    must match the recorded weights bit for bit), refused before any run starts."""
    if not args.warm_start_sha256 or not (warm / "warm_start.json").is_file():
        return
    info = json.loads((warm / "warm_start.json").read_text())
    if info.get("dtype") == "bfloat16" and not device_kwargs(args)["bf16"]:
        raise SystemExit(f"the warm start in {warm} is a bfloat16 copy, and runs on this device read the warm start "
                         f"in float32: carry the float32 original (its sha256 is {info['made_from_sha256']})")  # fmt: skip
    matches, found = warm_start_matches(warm, args.warm_start_sha256)
    if not matches:
        raise SystemExit(f"the warm start in {warm} has weights sha256 {found}, not --warm-start-sha256 "
                         f"{args.warm_start_sha256}: it is not the warm start these runs began from. Carry that one "
                         f"(--warm-start) or start the runs again in a new --out.")  # fmt: skip


def export_bf16_warm_start(warm: Path, dest: Path) -> dict:
    """A bfloat16 copy of `warm` in `dest/warm_start`: the weights cast as `from_pretrained(dtype=bfloat16)` casts them
    (so GPU runs read the same numbers), its own sha256, and `made_from_sha256` naming the float32 original."""
    import torch
    from transformers import AutoModelForCausalLM

    info = json.loads((warm / "warm_start.json").read_text())
    if info.get("dtype") == "bfloat16":
        raise SystemExit(f"the warm start in {warm} is already a bfloat16 copy")
    copy = dest / "warm_start"
    if copy.exists():
        raise SystemExit(f"{copy} exists: --export-warm-start writes a new folder, give another DIR")
    AutoModelForCausalLM.from_pretrained(warm, dtype=torch.bfloat16).save_pretrained(copy)
    info = {**info, "dtype": "bfloat16", "made_from_sha256": info["sha256"], "sha256": weights_sha256(copy)}
    (copy / "warm_start.json").write_text(json.dumps(info, indent=1))
    return info


def copy_warm_start(args, warm: Path) -> None:
    """`--warm-start` copied into `warm`, refused when it was trained on another task than this study's."""
    info = json.loads((Path(args.warm_start) / "warm_start.json").read_text())
    task = json.loads(json.dumps(task_of(args)))  # as the JSON file holds it (lists, not tuples)
    if info["task"] != task:
        raise SystemExit(f"--warm-start {args.warm_start} was trained on {info['task']}, not this study's {task}")
    shutil.copytree(args.warm_start, warm, dirs_exist_ok=True)


def phases_of(arm: str, args) -> list:
    from prorl_trl.config import PhaseConfig

    if arm not in SCHEDULED:
        return [PhaseConfig(name="single", max_steps=args.steps)]
    return [
        PhaseConfig(name=f"phase-{i}", max_steps=args.steps // 4, hard_reset=arm in RESET_AT_BOUNDARIES and i > 0,
                    top_p=top_p, temperature=temperature, num_generations=args.num_generations * group)
        for i, (top_p, temperature, group) in enumerate(SCHEDULE)
    ]  # fmt: skip


def make_rows_callback(path: Path, attempt: int):
    """A callback appending every log entry (the keys the report reads) to `path`, one JSON line each, as it goes."""
    from transformers import TrainerCallback

    started = time.time()

    class Rows(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            row = {k: v for k, v in (logs or {}).items() if k in KEEP or k.startswith(("eval_", "prorl/", "reward"))}
            row.update(_attempt=attempt, _seconds=round(time.time() - started, 2))
            with path.open("a") as file:
                file.write(json.dumps(row) + "\n")

    return Rows()


def make_split_callback(path: Path, attempt: int, device):
    """`--step-split`: a `StepSplit` that appends each step's split to `path` as the step closes (one JSON line: the
    training call it belongs to, its seconds, completion tokens and `split_of`'s parts), so a run stopped at a time
    limit keeps what it measured. A step with a validation in it has the validation in "other"."""
    from _step_split import StepSplit, split_of

    class SplitRows(StepSplit):
        def _close_step(self) -> None:
            closed = len(self._steps)
            super()._close_step()
            if len(self._steps) > closed:
                step = self._steps[-1]
                row = {"call": len(self.calls), "_attempt": attempt, "seconds": round(step["seconds"], 4),
                       "tokens": step["tokens"], **{k: round(v, 4) for k, v in split_of(step).items()}}  # fmt: skip
                with path.open("a") as file:
                    file.write(json.dumps(row) + "\n")

    return SplitRows(device)


def split_lines(runs: list[dict]) -> list[str]:
    """The report's step split (`--step-split`): per arm, the median seconds of each part over every timed step of
    its runs, and the median step."""
    from _step_split import PARTS

    columns = (*PARTS, "other")
    lines = []
    for arm in ARMS:
        steps = [step for run in runs if run["arm"] == arm for step in run["split"]]
        if steps:
            medians = [statistics.median(step[column] for step in steps) for column in columns]
            total = statistics.median(step["seconds"] for step in steps)
            cells = " | ".join(f"{median:.3f}" for median in medians)
            lines.append(f"| {ARMS[arm]} | {len(steps)} | {total:.3f} | {cells} |")
    if not lines:
        return []
    return ["## Where a training step goes (`--step-split`; median seconds over the timed steps)", "",
            "| arm | steps | step | " + " | ".join(columns) + " |", "| --- " * (len(columns) + 3) + "|", *lines,
            "", "The parts' medians need not add up to the step's; a step with a validation has it in other."]  # fmt: skip


def make_counts_callback(path: Path, attempt: int, validation, num_steps: list[int]):
    """A callback appending each validation's per-problem correct counts (`validation.last_correct`, of
    `--val-samples`) and the problems' numbers of operations to `path`, one JSON line per validation, keyed by step:
    what "newly solved" and pass@1 by difficulty are computed from. A resumed run's re-run validation appends a line
    that replaces the earlier one (`read_counts`), so the counts always match the rows the report reads."""
    from transformers import TrainerCallback

    class Counts(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "eval_pass@1" in (logs or {}):
                line = {"step": logs.get("prorl/global_step", state.global_step), "_attempt": attempt,
                        "num_samples": validation.settings.num_samples, "correct": validation.last_correct,
                        "num_steps": num_steps}  # fmt: skip
                with path.open("a") as file:
                    file.write(json.dumps(line) + "\n")

    return Counts()


def run_worker(args) -> int:
    """One (arm, seed) run into `--run-dir`; 0 when finished, 143 when stopped by a signal (checkpoint written)."""
    import torch

    threads = torch.get_num_threads()
    if args.smoke:  # a tiny model: one thread is fastest, and far faster on a busy machine
        torch.set_num_threads(1)
    try:
        with determinism_restored():  # `full_determinism`'s process-wide switches: smoke workers share the caller's
            if args.worker != "warm_start" and args.full_determinism == "on":
                os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before this process's first cuBLAS handle
            return _run_worker(args)
    finally:
        torch.set_num_threads(threads)


def _run_worker(args) -> int:
    if args.worker == "warm_start":
        run_warm_start(args)
        return 0
    from peft import LoraConfig
    from transformers.utils import logging as hf_logging

    from prorl_trl.config import ProRLConfig
    from prorl_trl.data.synthetic import make_arithmetic_dataset
    from prorl_trl.evaluation.validation import ValidationCallback
    from prorl_trl.reset.checkpoint import latest_checkpoint
    from prorl_trl.tiny import build_tiny_tokenizer
    from prorl_trl.trainer import (
        HardResetCallback,
        NonFiniteUpdate,
        ProRLTrainer,
        RunInterrupted,
        stop_on_signals,
    )
    from rewards import get_reward

    hf_logging.set_verbosity_error()
    run_dir, arm, started = Path(args.run_dir), args.worker, time.time()
    checkpoint = latest_checkpoint(run_dir / "trainer") if args.resume else None
    if checkpoint is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    earlier = read_jsonl(run_dir / "rows.jsonl")
    attempt = 1 + max((row["_attempt"] for row in earlier), default=-1)
    with (run_dir / "attempts.jsonl").open("a") as file:
        file.write(json.dumps({"attempt": attempt, "resumed_from": str(checkpoint) if checkpoint else None}) + "\n")
    cuda = device_kwargs(args)["bf16"]
    task = task_of(args)
    validation = make_arithmetic_dataset(args.val_problems, seed=VALIDATION_SEED, **task)
    held_out = set(validation["prompt"])
    train = make_arithmetic_dataset(256 if args.smoke else max(20000, args.steps * args.prompts_per_step),
                                    seed=args.seed + 1, **task).filter(lambda row: row["prompt"] not in held_out)  # fmt: skip
    config = ProRLConfig(
        output_dir=str(run_dir / "trainer"), phases=phases_of(arm, args), hard_reset_between_phases=arm in RESET_AT_BOUNDARIES,
        **dict(zip(("reset_adapter", "reset_optimizer", "reset_reference"), RESET_PARTS.get(arm, (True, True, True)))),
        learning_rate=args.learning_rate, lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup_steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, temperature=1.0,
        top_p=0.7, beta=args.beta, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, lora_reset_mode="frozen",
        consolidate_frozen_parts=args.consolidate_frozen_parts == "on", kl_clamp=args.kl_clamp == "on",
        cudnn_attention_guard=args.cudnn_attention_guard, full_determinism=args.full_determinism == "on", save_strategy="steps", save_steps=args.save_steps, save_total_limit=2, save_merged_on_reset=False,
        rollout_engine=cuda and args.rollout_engine == "on", plateau_metric="eval_pass@1", report_to=[], logging_steps=1, disable_tqdm=True,
        seed=args.seed, model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, **device_kwargs(args),
    )  # fmt: skip
    # 2048 sequences per generate call whatever n (8 problems at n = 256): the tiny model's KV cache for them is
    # ~1.3 GB at 80 positions (8 layers, 4 KV heads of 64, bf16), so --per-gpu 4 workers fit one GPU
    validator = ValidationCallback(
        validation, "boxed_answer", eval_steps=args.eval_steps, num_generations=args.val_samples, temperature=1.0,
        max_completion_length=args.max_completion_length, ks=ks_of(args), batch_size=max(1, 2048 // args.val_samples),
        at_start=True, seed=VALIDATION_SEED,
    )  # fmt: skip
    callbacks = [
        validator, make_rows_callback(run_dir / "rows.jsonl", attempt),
        make_counts_callback(run_dir / "counts.jsonl", attempt, validator, list(validation["num_steps"])),
    ]
    if arm == "plateau":
        callbacks.append(HardResetCallback(on_plateau=args.plateau_patience, min_delta=args.plateau_min_delta))
    targets = args.lora_targets.split(",")
    trainer = ProRLTrainer(
        model=args.warm_dir, reward_funcs=[get_reward("boxed_answer")], args=config, train_dataset=train,
        processing_class=build_tiny_tokenizer(), callbacks=callbacks,
        peft_config=LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=targets),
    )  # fmt: skip
    if args.step_split:
        import torch

        split = make_split_callback(run_dir / "split.jsonl", attempt, torch.device("cuda" if cuda else "cpu"))
        trainer.add_callback(split)
        split.attach(trainer)
    try:
        with stop_on_signals(trainer):
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except RunInterrupted as stop:
        print(f"[{run_dir.name}] {stop}", flush=True)
        return 143
    except NonFiniteUpdate as stop:  # the run's own outcome (a collapse), kept in the report, not retried
        print(f"[{run_dir.name}] {stop}", flush=True)
        stopped = {"arm": arm, "seed": args.seed, "device": run_device(args), "step": stop.global_step,
                   "grad_norm": str(stop.norm), "reason": "non-finite gradient"}  # fmt: skip
        (run_dir / "stopped.json").write_text(json.dumps(stopped, indent=1))
        return 3
    earlier_seconds = sum(attempt_seconds(earlier).values())
    done = {"arm": arm, "seed": args.seed, "device": run_device(args), "steps": trainer.prorl_global_step,
            "seconds": round(earlier_seconds + time.time() - started, 1), "attempts": attempt + 1,
            "rollout_engine": getattr(trainer, "rollout_engine", None) is not None}  # fmt: skip
    (run_dir / "done.json").write_text(json.dumps(done, indent=1))
    return 0


# ------------------------------------------------------------------------------------------------------ the parent
def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip() and line.rstrip().endswith("}")]  # a cut last line


def attempt_seconds(rows: list[dict]) -> dict[int, float]:
    seconds = defaultdict(float)
    for row in rows:
        seconds[row["_attempt"]] = max(seconds[row["_attempt"]], row["_seconds"])
    return seconds


def read_rows(path: Path) -> list[dict]:
    """rows.jsonl in step order, one row per (kind, phase, step): a resumed attempt's row replaces the earlier one."""
    kept = {}
    for row in read_jsonl(path):
        kind = next((kind for key, kind in ROW_KINDS if key in row), "other")
        key = (kind, row.get("prorl/phase"), row.get("prorl/global_step"))
        kept.pop(key, None)
        kept[key] = row
    return sorted(kept.values(), key=lambda row: row.get("prorl/global_step", 0))


def read_counts(path: Path) -> dict[int, dict]:
    """counts.jsonl by step; a resumed attempt's line for a step replaces the earlier one (as in `read_rows`)."""
    return {line["step"]: line for line in read_jsonl(path)}


def reset_steps(rows: list[dict]) -> list[float]:
    """The step after which each hard reset happened: the last step logged before `prorl/resets` reached k."""
    total = max((row.get("prorl/resets", 0) for row in rows), default=0)
    return [
        max(row["prorl/global_step"] for row in rows if row.get("prorl/resets", 0) < k) for k in range(1, total + 1)
    ]


def worker_argv(argv: list[str], worker: str, seed: int, run_dir: Path | None, warm: Path, extra=()) -> list[str]:
    tail = ["--worker", worker, "--seed", str(seed), "--warm-dir", str(warm)]
    return [*argv, *extra, *tail, *(["--run-dir", str(run_dir)] if run_dir else [])]


def is_solo(args, run_name: str) -> bool:
    """Whether run `<arm>-s<seed>` gets a GPU to itself (`--solo-arms`)."""
    return run_name.rpartition("-s")[0] in args.solo_arms


def run_jobs(args, jobs: list[tuple[str, list[str]]], deadline: float) -> None:
    """Run `(name, argv)` jobs: in-process one after another, or as processes, at most `--per-gpu` per GPU. At the
    deadline or on SIGTERM/SIGINT, workers get SIGTERM (they finish their step and checkpoint); no new job starts."""
    if args.launch == "inline":
        for name, job in jobs:
            if time.time() < deadline:
                print(f"[prolonged] {name}", flush=True)
                run_worker(parse_args(job))
        return
    import torch

    gpus = args.gpus or max(torch.cuda.device_count(), 1)
    if args.mps and not hasattr(args, "mps_env"):
        raise RuntimeError("--mps: run_jobs called outside study_mps(), so its workers would run without MPS")
    mps_env = getattr(args, "mps_env", {})
    lock_fds = (args.lock_fd,) if hasattr(args, "lock_fd") else ()  # the study's lock, held by its workers too
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or list(range(gpus))
    threads = max(1, (os.cpu_count() or 1) // (gpus * args.per_gpu))  # CPU threads shared fairly
    stopping, stop_sent = [], None
    handlers = {s: signal.signal(s, lambda *_: stopping.append(1)) for s in (signal.SIGTERM, signal.SIGINT)}
    pending, running = list(jobs), {}
    try:
        while pending or running:
            for process in [p for p in running if p.poll() is not None]:
                name, gpu, _ = running.pop(process)
                print(f"[prolonged] {name} ended (exit {process.returncode}) on GPU {gpu}", flush=True)
            if (stopping or time.time() >= deadline) and stop_sent is None:
                print(f"[prolonged] stopping: {len(running)} run(s) checkpoint, {len(pending)} not started", flush=True)
                pending, stop_sent = [], time.time()
                for process in running:
                    process.send_signal(signal.SIGTERM)
            if stop_sent is not None and time.time() - stop_sent > 180:  # a worker that does not stop
                for process in running:
                    process.kill()
            while pending:
                name, job = pending[0]
                weight = args.per_gpu if is_solo(args, name) else 1
                load = [sum(w for _, g, w in running.values() if g == gpu) for gpu in range(gpus)]
                gpu = load.index(min(load))
                if load[gpu] + weight > args.per_gpu:
                    break
                pending.pop(0)
                env = {**os.environ, **mps_env, "CUDA_VISIBLE_DEVICES": str(visible[gpu]),
                       "OMP_NUM_THREADS": str(threads)}  # fmt: skip
                with (Path(args.out) / "logs" / f"{name}.log").open("a") as log:
                    process = subprocess.Popen([sys.executable, __file__, *job], stdout=log, stderr=subprocess.STDOUT,
                                               env=env, pass_fds=lock_fds)  # fmt: skip
                running[process] = (name, gpu, weight)
                print(f"[prolonged] {name} started on GPU {gpu}", flush=True)
            time.sleep(0.5)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


MPS_CONTROL = "nvidia-cuda-mps-control"
STUDY_LOCK = "study.lock"  # OUT/study.lock: `study_lock`


def mps_control() -> str:
    """The MPS control program's path; a clear refusal where there is none, or where CUDA_VISIBLE_DEVICES names GPUs
    by indices the daemon would renumber, before any work."""
    control = shutil.which(MPS_CONTROL)
    if control is None:
        raise SystemExit(f"--mps: {MPS_CONTROL} is not on PATH (it comes with NVIDIA's driver): run without --mps, "
                         "or where the driver's tools are installed")  # fmt: skip
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    renumbered = [d for position, d in enumerate(visible) if d.isdigit() and int(d) != position]
    if renumbered:  # the daemon inherits the variable and serves those GPUs as 0, 1, ...; a worker asking for
        # GPU "1" would then ask for one it does not serve (NVIDIA's MPS docs; seen on a 2 x H200 in 2026-11)
        raise SystemExit(f"--mps with CUDA_VISIBLE_DEVICES={','.join(visible)}: the MPS daemon renumbers the GPUs it "
                         f"serves from 0, so the workers' GPU {renumbered[0]} would not exist for it. Name the GPUs by "
                         "UUID (`nvidia-smi -L`), e.g. CUDA_VISIBLE_DEVICES=GPU-3c93a829..., which the daemon and the "
                         "workers read the same way")  # fmt: skip
    return control


@contextlib.contextmanager
def study_mps(args, out: Path):
    """With `--mps` (and work to do), one MPS daemon for the whole call: the warm start's job and the runs' jobs, or
    a pilot's, all run under it (`args.mps_env`, what `run_jobs` gives its workers); it is quit when the call ends."""
    if not args.mps or args.report_only:
        yield
        return
    args.mps_env = start_mps_daemon(out)
    try:
        yield
    finally:
        quit_mps_daemon(args.mps_env)


def start_mps_daemon(out: Path) -> dict[str, str]:
    """Starts an MPS control daemon private to this study and returns the environment its clients need. Without MPS,
    processes on one GPU take turns on it, so at this study's small kernels the GPU is full at about 4 runs; with
    it their kernels share the multiprocessors. The pipe and log folders sit in OUT, so nothing is written outside
    it and no other user's daemon is touched; a daemon left by an earlier call that was killed is quit first."""
    control, folder = mps_control(), (out / "mps").resolve()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    if len(env["CUDA_MPS_PIPE_DIRECTORY"]) > 90:  # the pipe's unix socket path must stay under 108 bytes
        raise SystemExit(f"--mps: the MPS pipe folder {folder / 'pipe'} is too long for a socket path (at most 90 "
                         "characters): use a shorter --out")  # fmt: skip
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    if (folder / "pipe" / "control").exists():
        quit_mps_daemon(env)
    started = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    if started.returncode:
        raise SystemExit(f"--mps: `{MPS_CONTROL} -d` failed (exit {started.returncode}): "
                         f"{(started.stdout + started.stderr).strip()}; its log: {folder / 'log'}")  # fmt: skip
    print(f"[prolonged] MPS daemon started (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})", flush=True)
    return env


def quit_mps_daemon(env: dict[str, str]) -> None:
    """Asks the study's MPS daemon to quit (it stops its server once no client is left)."""
    subprocess.run([mps_control()], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True,
                   timeout=60)  # fmt: skip


def main(argv: list[str] | None = None) -> dict | int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.mps and not args.report_only:
        mps_control()  # refused before anything is written
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.time() + (args.time_limit or math.inf)
    with study_lock(args, out), study_mps(args, out):
        return run_study(args, argv, out, deadline)


@contextlib.contextmanager
def study_lock(args, out: Path):
    """One call at a time per OUT: two calls would run the same runs twice into the same folders. The lock is a
    `flock` on OUT/study.lock that every worker inherits (`args.lock_fd`, passed to it), so it holds for as long as
    any of the call's processes lives, even where the parent was killed and its workers went on. `--report-only`
    only reads, and takes none."""
    if args.report_only:
        yield
        return
    handle = (out / STUDY_LOCK).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise SystemExit(f"{out} is in use by another prolonged.py call ({holder}), or by its workers: a second call "
                         "would train the same runs into the same folders. Wait for it to end, or stop it and its "
                         "workers, then call again (with --resume to go on); or use another --out") from None  # fmt: skip
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, started {datetime.datetime.now().isoformat(timespec='seconds')}\n")
    handle.flush()
    args.lock_fd = handle.fileno()
    try:
        yield
    finally:
        del args.lock_fd
        handle.close()


def run_study(args, argv: list[str], out: Path, deadline: float) -> dict | int:
    """The warm start (made, copied or checked), the runs not yet finished, then the report (or the pilot's)."""
    if args.pilot:
        return run_pilot(args, argv, out, deadline)
    if not args.report_only:
        check_completion_cap(args)
        (out / "settings.json").write_text(json.dumps(vars(args), indent=1))  # what --report-only reports
        warm = out / "warm_start"
        if args.warm_start and not (warm / "warm_start.json").is_file():
            copy_warm_start(args, warm)
        if not (warm / "warm_start.json").is_file():
            run_jobs(args, [("warm_start", worker_argv(argv, "warm_start", 0, None, warm))], deadline)
        check_warm_start_sha256(args, warm)
        if args.export_warm_start:
            if not (warm / "warm_start.json").is_file():
                raise SystemExit(f"--export-warm-start: no warm start in {warm} to copy (its training did not finish: "
                                 f"{out / 'logs' / 'warm_start.log'}); nothing was written to {args.export_warm_start}")  # fmt: skip
            print(json.dumps(export_bf16_warm_start(warm, Path(args.export_warm_start))), flush=True)
            return 0
        jobs = []
        for seed, arm in itertools.product(args.seeds, args.arms):
            run_dir = out / "runs" / f"{arm}-s{seed}"
            ended = (run_dir / "done.json").is_file() or (run_dir / "stopped.json").is_file()
            if not (args.resume and ended):
                jobs.append((run_dir.name, worker_argv(argv, arm, seed, run_dir, warm)))
        jobs.sort(key=lambda job: not is_solo(args, job[0]))  # solo runs take whole GPUs first
        if (warm / "warm_start.json").is_file():
            run_jobs(args, jobs, deadline)
    return write_report(args, out)


def run_pilot(args, argv: list[str], out: Path, deadline: float) -> dict:
    """Arm (a), the first seed, for every combination of `--pilot-grid`; one warm start per task."""
    grid = [part.split("=", 1) for part in args.pilot_grid.split(";") if part.strip()]
    warms, runs, settings = {}, [], []
    for combination in itertools.product(*[[(key.strip(), v) for v in values.split(",")] for key, values in grid]):
        extra = [item for key, value in combination for item in (f"--{key.replace('_', '-')}", value)]
        name = "_".join(f"{key}-{value}" for key, value in combination) or "base"
        setting = parse_args([*argv, *extra])
        if not args.report_only:
            check_completion_cap(setting)
        task = f"task-{setting.task_steps}-max{setting.task_max_value}-acc{setting.warm_start_accuracy:g}"
        warm = out / "pilot" / task / "warm_start"
        warms[warm] = (f"warm_start-{warm.parent.name}", worker_argv(argv, "warm_start", 0, None, warm, extra))
        run_dir = out / "pilot" / name
        settings.append((name, setting, run_dir))
        ended = (run_dir / "done.json").is_file() or (run_dir / "stopped.json").is_file()
        if not (args.resume and ended):  # a stopped run (NaN) is an outcome: a resume does not run it again
            runs.append((name, worker_argv(argv, "one_phase", args.seeds[0], run_dir, warm, extra)))
    if not args.report_only:
        run_jobs(args, [job for warm, job in warms.items() if not (warm / "warm_start.json").is_file()], deadline)
        run_jobs(args, runs, deadline)
    rows, curves = [], {}
    for name, setting, run_dir in settings:
        evals = [row for row in read_rows(run_dir / "rows.jsonl") if "eval_pass@1" in row]
        if not evals:
            rows.append(f"| {name} | not run |" + " |" * 8)
            continue
        steps, values = [row["prorl/global_step"] for row in evals], [row["eval_pass@1"] for row in evals]
        curves[name] = (steps, values)
        middle = min(range(len(steps)), key=lambda i: abs(steps[i] - steps[-1] / 2))
        gain = values[-1] - values[middle]
        two_se = learning.two_standard_errors(values[-1], values[middle], setting.val_problems)
        n = ks_of(setting)[-1]
        plateau = "yes" if gain <= two_se else "no"
        finished = "" if (run_dir / "done.json").is_file() else " (unfinished)"
        if (run_dir / "stopped.json").is_file():
            finished = f" (stopped before step {json.loads((run_dir / 'stopped.json').read_text())['step']}: NaN/inf)"
        curve = " ".join(f"{step}:{100 * v:.0f}" for step, v in zip(steps, values))
        start_n = f"{100 * evals[0][f'eval_pass@{n}']:.1f}" if f"eval_pass@{n}" in evals[0] else "-"
        rows.append(f"| {name}{finished} | {100 * values[0]:.1f} | {start_n} | {100 * values[middle]:.1f} (step {steps[middle]}) "
                    f"| {100 * values[-1]:.1f} (step {steps[-1]}) | {100 * max(values):.1f} | {100 * gain:+.1f} "
                    f"(2 s.e. {100 * two_se:.1f}) | {plateau} | {100 * evals[-1][f'eval_pass@{n}']:.1f} (n={n}) "
                    f"| {curve} |")  # fmt: skip
    lines = [f"# Pilot: arm (a), seed {args.seeds[0]}, {args.steps} steps ({datetime.date.today()})", "",
             PILOT_HEADER, "| --- " * 10 + "|", *rows]  # fmt: skip
    (out / "pilot.md").write_text("\n".join(lines) + "\n")
    pilot = {"grid": args.pilot_grid, "settings": [name for name, _, _ in settings], "curves": curves}
    (out / "pilot.json").write_text(json.dumps(pilot, indent=1))
    if curves:
        plot_lines(out / "pilot.png", "Pilot: validation pass@1 of arm (a)", "pass@1",
                   {name: [curve] for name, curve in curves.items()})  # fmt: skip
    print("\n".join(lines))
    return {"curves": curves}


# ------------------------------------------------------------------------------------------------------ the report
def load_runs(out: Path) -> list[dict]:
    runs = []
    for folder in sorted((out / "runs").glob("*-s*")):
        arm, _, seed = folder.name.rpartition("-s")
        rows = read_rows(folder / "rows.jsonl")
        done = json.loads((folder / "done.json").read_text()) if (folder / "done.json").is_file() else None
        stopped = json.loads((folder / "stopped.json").read_text()) if (folder / "stopped.json").is_file() else None
        seconds = done["seconds"] if done else sum(attempt_seconds(read_jsonl(folder / "rows.jsonl")).values())
        runs.append({"arm": arm, "seed": int(seed), "done": done, "stopped": stopped, "rows": rows,
                     "resets": reset_steps(rows), "counts": read_counts(folder / "counts.jsonl"),
                     "split": read_jsonl(folder / "split.jsonl"),
                     "evals": [row for row in rows if "eval_pass@1" in row], "seconds": seconds})  # fmt: skip
    return sorted(
        (run for run in runs if run["arm"] in ARMS), key=lambda run: (list(ARMS).index(run["arm"]), run["seed"])
    )


def number(values, scale: float = 1) -> str:
    """Mean ± s.e. of `values` times `scale`, one decimal ("-" for none; no s.e. for one value)."""
    if not values:
        return "-"
    mean, se = mean_se(values)
    return f"{scale * mean:.1f}" + ("" if math.isnan(se) else f" ± {scale * se:.1f}")


def pct(values) -> str:
    return number(values, scale=100)


def runs_planned(args, runs: list[dict], gathered: bool) -> dict[str, int]:
    """Runs each arm was to make: one per seed of the call; in a gathered folder (`prolonged_gather.py`, whose
    sources each ran their own arms and seeds: round 4's knob arms 4 seeds, (a)-(c) 6) the runs gathered for it."""
    if gathered:
        return {arm: sum(run["arm"] == arm for run in runs) for arm in ARMS}
    return {arm: len(args.seeds) for arm in ARMS}


def write_report(args, out: Path) -> dict:
    report_only = args.report_only
    if report_only and (out / "settings.json").is_file():
        args = argparse.Namespace(**json.loads((out / "settings.json").read_text()))
    runs = load_runs(out)
    if report_only:  # runs made by several calls (each its own arms) and gathered into one folder
        args.arms = [arm for arm in ARMS if any(run["arm"] == arm for run in runs)] or args.arms
        args.seeds = sorted({run["seed"] for run in runs}) or args.seeds
    ks = ks_of(args)
    n = ks[-1]
    if not (out / "warm_start" / "warm_start.json").is_file():
        raise SystemExit(f"No warm start in {out / 'warm_start'}: see {out / 'logs' / 'warm_start.log'}.")
    warm = json.loads((out / "warm_start" / "warm_start.json").read_text())
    for run in runs:  # final and best of finished runs
        if run["done"] and run["evals"]:
            run["final"], run["best"] = final_and_best(run, ks, args.steps)
    finished = {arm: [run for run in runs if run["arm"] == arm and "final" in run] for arm in ARMS}
    devices = sorted({(run["done"] or run["stopped"])["device"] for run in runs if run["done"] or run["stopped"]})
    devices = devices or ["(no finished run)"]
    header = "| arm | runs finished | " + " | ".join(f"final pass@{k} | best pass@{k}" for k in ks)
    gathered = (out / "gathered.json").is_file()  # runs of several calls (`prolonged_gather.py`)
    planned = runs_planned(args, runs, gathered)
    counts = {planned[arm] for arm in args.arms}
    design = (f"{len(args.arms)} arms x {len(args.seeds)} seeds" if counts == {len(args.seeds)} else
              f"{len(args.arms)} arms, {sum(planned[arm] for arm in args.arms)} runs")  # fmt: skip
    lines = [
        f"# Prolonged RL with hard resets: {design}", "",
        f"{', '.join(devices)}; {datetime.date.today()}{' (smoke)' if args.smoke else ''}.", "",
        settings_text(args, warm, "CPU" in devices[0], n), "",
        "## Results (%, mean ± s.e. across seeds)", "",
        f"{header} | never solved (1 - pass@{n}) | wall per run (s) |",
        "| --- " * (3 + 2 * len(ks)) + "| --- |",
    ]  # fmt: skip
    summary = {}
    for arm, done in finished.items():
        if arm not in args.arms:
            continue
        seconds = [run["seconds"] for run in done]
        summary[arm] = {f"{which}_pass@{k}": mean_se([run[which][k] for run in done]) for which in ("final", "best")
                        for k in ks} if done else {}  # fmt: skip
        cells = [f"{pct([run['final'][k] for run in done])} | {pct([run['best'][k] for run in done])}" for k in ks]
        never = pct([1 - run["final"][n] for run in done]) if done else "-"
        wall = f"{sum(seconds) / len(seconds):.0f}" if seconds else "-"
        row = " | ".join(cells) if done else " | ".join(["-"] * 2 * len(ks))
        stopped = sum(bool(run["stopped"]) for run in runs if run["arm"] == arm)
        count = f"{len(done)} of {planned[arm]}" + (f" ({stopped} stopped: non-finite gradient)" if stopped else "")
        if gathered:  # which seeds were gathered: a lease left out shows
            count += " (seeds " + ", ".join(str(seed) for seed in sorted(r["seed"] for r in runs if r["arm"] == arm)) + ")"
        lines.append(f"| {ARMS[arm]} | {count} | {row} | {never} | {wall} |")
    engine = sum(bool(run["done"].get("rollout_engine")) for run in runs if run["done"])
    note = (
        "Best is the maximum over the validations of a run after step 0 (biased upward by validation noise). Wall: "
        f"one run, with up to {args.per_gpu} runs sharing a GPU; the rollout engine generated in {engine} of "
        f"{sum(bool(run['done']) for run in runs)} finished runs. Stopped by a non-finite (NaN/inf) gradient: "
        f"{sum(bool(run['stopped']) for run in runs)} of {len(runs)} runs; continued from a checkpoint in a later "
        f"attempt: {sum((run['done'] or {}).get('attempts', 1) > 1 for run in runs)}."
    )
    lines += ["", note, "",
              "## Paired differences (final, points; 95% CI, t with n - 1 degrees of freedom)", ""]  # fmt: skip
    pairs = {}
    for x, y in compared_pairs(args):
        by_seed = {run["seed"]: run for run in finished[y]}
        pairs_xy = [(run["seed"], run, by_seed[run["seed"]]) for run in finished[x] if run["seed"] in by_seed]
        for k in ks:
            diffs = [a["final"][k] - b["final"][k] for _, a, b in pairs_xy]
            label = f"{short(x)} - {short(y)} pass@{k}"
            if not diffs:
                lines.append(f"- {label}: no seed with both runs finished")
                continue
            line, pairs[f"{x}-{y}@{k}"] = pair_line(label, [seed for seed, _, _ in pairs_xy], diffs)
            lines.append(line)
    outcomes, summary_outcomes, pairs_outcomes = outcome_lines(args, finished, n)
    for arm, values in summary_outcomes.items():
        summary[arm].update(values)
    pairs.update(pairs_outcomes)
    lines += ["", *outcomes, "", *common_step_lines(args, runs, ks)]
    knobs = knob_lines(pairs, ks)
    lines += ["", *knobs] if knobs else []
    split = split_lines(runs)
    lines += ["", *split] if split else []
    lines += ["", "## Plateau of arm (a)", "", *plateau_lines(args, finished["one_phase"]), "",
              "## Hard resets (global step after which each happened)", ""]  # fmt: skip
    for run in runs:
        last = max((row["prorl/global_step"] for row in run["rows"]), default=0)
        state = "" if run["done"] else f" (unfinished, last step {last})"
        if run["stopped"]:
            state = f" (stopped before step {run['stopped']['step']}: {run['stopped']['reason']})"
        device = (run["done"] or run["stopped"] or {}).get("device")
        state += f" [{device}]" if device and len(devices) > 1 else ""
        lines.append(f"- {ARMS[run['arm']]} s{run['seed']}{state}: {', '.join(map(str, run['resets'])) or 'none'}")
    plots = write_plots(args, out, runs, n)
    lines += ["", "## Plots", "", *[f"![{path.stem}]({path.name})" for path in plots]]
    (out / "prolonged.md").write_text("\n".join(lines) + "\n")
    result = {
        "devices": devices, "date": str(datetime.date.today()), "warm_start": warm, "summary": summary,
        "pairs": pairs, "plots": [p.name for p in plots],
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "seed", "run_dir", "warm_dir")},
        "runs": [{"arm": r["arm"], "seed": r["seed"], "finished": bool(r["done"]), "seconds": r["seconds"],
                  "resets": r["resets"], "final": r.get("final"), "best": r.get("best"),
                  "outcomes": r.get("outcomes"),
                  "curves": {f"pass@{k}": ([e["prorl/global_step"] for e in r["evals"]],
                                           [e[f"eval_pass@{k}"] for e in r["evals"]]) for k in ks}} for r in runs],
    }  # fmt: skip
    (out / "prolonged.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return result


KNOBS = ("opt", "ref", "adapter")  # the knob arms, each one part of (b)'s reset, read against (c)


def knob_lines(pairs: dict, ks: list[int]) -> list[str]:
    """Which part of the reset does what, by a rule fixed before round 4's data: a part *carries* (b)'s effect on a
    metric when its final difference from (c) has a 95% CI that excludes 0 with the sign of (b) - (c)'s mean; it
    *moves* the metric the other way when the CI excludes 0 with the opposite sign. One table (each cell the paired
    mean and its CI, bold where the CI excludes 0) and one sentence per metric. `pairs`: `write_report`'s records."""
    knobs = [knob for knob in KNOBS if any(key.startswith(f"{knob}-no_reset@") for key in pairs)]
    if not knobs:
        return []
    metrics = [(f"@{k}", f"pass@{k}", 100, "pts") for k in ks]
    metrics += [("@newly_solved", "newly solved", 1, "problems"), ("@newly_lost", "newly lost", 1, "problems")]
    columns = ["prorl", *knobs]
    lines = [
        "## Which part of the reset does what (final, each arm against (c); 95% CI)", "",
        "Rule, fixed before the data: a part carries (b)'s effect on a metric when its difference from (c) has a "
        "95% CI that excludes 0 with the sign of (b) - (c); bold: the CI excludes 0. No correction for the "
        f"{len(knobs)} parts x {len(metrics)} metrics compared: a bold cell is a lead, not a finding.", "",
        "| metric | " + " | ".join(f"{short(arm)} - (c)" for arm in columns) + " |",
        "| --- " * (1 + len(columns)) + "|",
    ]  # fmt: skip

    def side(record) -> int:
        """+1 / -1: the CI lies above / below 0; 0: it holds 0, or there is none."""
        low, high = record["ci95"]
        return 0 if math.isnan(low) or low <= 0 <= high else (1 if low > 0 else -1)

    readings = []
    for suffix, label, scale, unit in metrics:
        records = {arm: pairs[f"{arm}-no_reset{suffix}"] for arm in columns if f"{arm}-no_reset{suffix}" in pairs}
        cells = []
        for arm in columns:
            if arm not in records:
                cells.append("-")
                continue
            record = records[arm]
            cell = f"{scale * record['mean']:+.1f} {ci_text(*record['ci95'], scale)} (n={len(record['per_seed'])})"
            cells.append(f"**{cell}**" if side(record) else cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        reset = records.get("prorl")
        if reset is None:
            continue
        direction = (reset["mean"] > 0) - (reset["mean"] < 0)
        if direction == 0:  # no sign for a part to share: the rule says no part carries it
            moved = [f"{knob} {'up' if side(records[knob]) > 0 else 'down'}" for knob in knobs
                     if knob in records and side(records[knob])]  # fmt: skip
            alone = f"{', '.join(moved)} significantly, on its own" if moved else "no part of the reset alone moves it"
            readings.append(f"- {label}: (b) - (c) {scale * reset['mean']:+.1f} {unit}, no effect to carry; {alone}.")
            continue
        carry = [knob for knob in knobs if knob in records and side(records[knob]) == direction]
        against = [knob for knob in knobs if knob in records and side(records[knob]) == -direction]
        significant = "significant" if side(reset) else "not significant"
        said = f"(b) - (c) {scale * reset['mean']:+.1f} {unit}, {significant}"
        if carry or against:
            carries = f"{', '.join(carry)} carr{'ies' if len(carry) == 1 else 'y'} it"
            if carry and not side(reset):  # the rule's letter, but (b) shows no effect of its own to carry
                carries += " by the rule's letter, though (b)'s own difference is not significant: a lead at most"
            parts = [carries if carry else "",
                     f"{', '.join(against)} move{'s' if len(against) == 1 else ''} it the other way" if against
                     else ""]  # fmt: skip
            readings.append(f"- {label}: {said}; " + "; ".join(part for part in parts if part) + ".")
        else:
            readings.append(f"- {label}: {said}; no part of the reset alone moves it significantly.")
    return [*lines, "", *readings]


def common_step_lines(args, runs: list[dict], ks: list[int]) -> list[str]:
    """Every run (finished or cut off) at the last validation step all of them reached: per-arm mean ± s.e. and the
    paired differences there, so arms compare at equal steps even when a time limit cut some runs short."""
    evaluated = [run for run in runs if run["evals"] and run["arm"] in args.arms]
    if not evaluated:
        return []
    common = min(run["evals"][-1]["prorl/global_step"] for run in evaluated)
    at = {(run["arm"], run["seed"]): next(row for row in run["evals"] if row["prorl/global_step"] == common)
          for run in evaluated}  # fmt: skip
    lines = [f"## At step {common}, the last validation every run reached (%, mean ± s.e. across seeds)", "",
             "| arm | runs | " + " | ".join(f"pass@{k}" for k in ks) + " |", "| --- " * (2 + len(ks)) + "|"]  # fmt: skip
    for arm in [arm for arm in ARMS if arm in args.arms]:
        rows = [row for (name, _), row in at.items() if name == arm]
        lines.append(f"| {ARMS[arm]} | {len(rows)} | " + " | ".join(pct([r[f"eval_pass@{k}"] for r in rows]) for k in ks)
                     + " |")  # fmt: skip
    lines += ["", f"Paired differences at step {common} (points; 95% CI, t with n - 1 degrees of freedom):", ""]
    for x, y in compared_pairs(args):
        seeds = sorted(seed for arm, seed in at if arm == x and (y, seed) in at)
        for k in ks:
            diffs = [at[(x, seed)][f"eval_pass@{k}"] - at[(y, seed)][f"eval_pass@{k}"] for seed in seeds]
            if diffs:
                lines.append(pair_line(f"{short(x)} - {short(y)} pass@{k}", seeds, diffs)[0])
    return lines


# ------------------------------------------------------------------------------------------- per-problem outcomes
OUTCOMES = {"newly_solved": "newly solved", "newly_lost": "newly lost", "solved_start": "solved at step 0",
            "solved_end": "solved at the end"}  # fmt: skip


def newly_solved_and_lost(start: list[int], end: list[int]) -> tuple[int, int]:
    """Problems with no correct sample at the start and at least one at the end (newly solved), and the reverse
    (newly lost), from the correct counts of the same problems at two validations.

    Example:
        >>> newly_solved_and_lost([0, 0, 2, 1], [3, 0, 0, 1])
        (1, 1)
    """
    if len(start) != len(end):
        raise ValueError(f"correct counts of {len(start)} and of {len(end)} problems: not the same held-out set")
    return sum(s == 0 < e for s, e in zip(start, end)), sum(e == 0 < s for s, e in zip(start, end))


def pass1_by_operations(correct: list[int], num_samples: int, num_steps: list[int]) -> dict[int, float]:
    """Mean pass@1 (correct / n, the unbiased estimate) of the problems of each number of operations.

    Example:
        >>> pass1_by_operations([4, 0, 2], 4, [1, 2, 2])
        {1: 1.0, 2: 0.25}
    """
    buckets = defaultdict(list)
    for count, steps in zip(correct, num_steps, strict=True):
        buckets[steps].append(count / num_samples)
    return {steps: sum(values) / len(values) for steps, values in sorted(buckets.items())}


def final_and_best(run: dict, ks: list[int], steps: int) -> tuple[dict, dict]:
    """A finished run's pass@k at its last validation and the best of its validations after step 0: the warm start's
    (step 0) is every arm's, and counting it made the best pass@64 of a sharpening arm the warm start's. Refused
    unless the validations run from step 0 to `steps`: "final" and the per-problem outcomes read them by position,
    so a missing line would silently compare other validations."""
    logged = [row["prorl/global_step"] for row in run["evals"]]
    if logged[0] != 0 or logged[-1] != steps:
        raise SystemExit(
            f"runs/{run['arm']}-s{run['seed']}: validations at steps {logged}, but a finished run validates at step 0 "
            f"and at its last step ({steps}); a line of rows.jsonl is missing: run this (arm, seed) again."
        )
    broken = [(row["prorl/global_step"], k) for row in run["evals"] for k in ks if math.isnan(row[f"eval_pass@{k}"])]
    if broken:  # max() over NaN depends on the order: "best" would silently be NaN or skip it
        raise SystemExit(f"runs/{run['arm']}-s{run['seed']}: pass@{broken[0][1]} of the validation at step "
                         f"{broken[0][0]} is NaN: its counts.jsonl line is broken; run this (arm, seed) again.")
    trained = run["evals"][1:] or run["evals"]
    final = {k: run["evals"][-1][f"eval_pass@{k}"] for k in ks}
    return final, {k: max(row[f"eval_pass@{k}"] for row in trained) for k in ks}


def problem_outcomes(run: dict, n: int) -> dict | None:
    """A finished run's per-problem outcomes from counts.jsonl: its first validation (step 0, the warm start) against
    its last. None when the file lacks either line (runs made before the counts were written, 2026-11-28). Counts
    that disagree with the logged pass@1 or n are refused: the report would mix two held-out sets."""
    first, last = (run["counts"].get(run["evals"][i]["prorl/global_step"]) for i in (0, -1))
    if first is None or last is None:
        return None
    where = f"runs/{run['arm']}-s{run['seed']}/counts.jsonl"
    for line, row in ((first, run["evals"][0]), (last, run["evals"][-1])):
        from_counts = sum(line["correct"]) / (line["num_samples"] * len(line["correct"]))
        if line["num_samples"] != n or abs(from_counts - row["eval_pass@1"]) > 1e-6:
            raise SystemExit(
                f"{where}, step {line['step']}: {line['num_samples']} samples and pass@1 {from_counts} from the "
                f"counts, but the report's n is {n} and rows.jsonl logged pass@1 {row['eval_pass@1']}: the counts "
                "are of another validation; run this (arm, seed) again."
            )
    solved, lost = newly_solved_and_lost(first["correct"], last["correct"])
    return {"newly_solved": solved, "newly_lost": lost, "solved_start": sum(c > 0 for c in first["correct"]),
            "solved_end": sum(c > 0 for c in last["correct"]), "num_steps": last["num_steps"],
            "start_by_operations": pass1_by_operations(first["correct"], n, first["num_steps"]),
            "by_operations": pass1_by_operations(last["correct"], n, last["num_steps"])}  # fmt: skip


def outcome_lines(args, finished: dict[str, list[dict]], n: int) -> tuple[list[str], dict, dict]:
    """The report's per-problem sections: problems newly solved and lost per arm (mean ± s.e. across seeds, paired
    differences as for pass@k) and the final pass@1 per number of operations; with their summary and pair records."""
    arms = [arm for arm in ARMS if arm in args.arms]
    for run in [run for arm in arms for run in finished[arm]]:
        run["outcomes"] = problem_outcomes(run, n)
    outcomes = {(arm, run["seed"]): run["outcomes"] for arm in arms for run in finished[arm]}
    known = {key: value for key, value in outcomes.items() if value}
    by_arm = {arm: [value for (name, _), value in known.items() if name == arm] for arm in arms}
    lines = ["## Problems newly solved and newly lost (the final validation against the warm start)", ""]
    if not known:
        return [*lines, "No finished run has per-problem counts (counts.jsonl, written since 2026-11-28)."], {}, {}
    operations = next(iter(known.values()))["num_steps"]
    if any(value["num_steps"] != operations for value in known.values()):
        raise SystemExit(
            "The runs' counts.jsonl hold different held-out problems (their numbers of operations differ): these "
            "runs were made with different --val-problems or task settings; report them apart."
        )
    lines += [
        (f"Of {len(operations)} held-out problems x {n} samples: newly solved = 0 of {n} correct at step 0 (the warm "
         "start: every run's first validation, same problems and sampling seed) and at least 1 at the final "
         "validation; newly lost = the reverse. Problems, mean ± s.e. across seeds."), "",
        table_row("arm", "runs", OUTCOMES.values()), "| --- " * (2 + len(OUTCOMES)) + "|",
    ]  # fmt: skip
    summary, pairs = {}, {}
    for arm, values in by_arm.items():
        summary[arm] = {key: mean_se([v[key] for v in values]) for key in OUTCOMES} if values else {}
        lines.append(table_row(ARMS[arm], len(values), [number([v[key] for v in values]) for key in OUTCOMES]))
    lines += ["", "Paired differences (problems; 95% CI, t with n - 1 degrees of freedom):", ""]
    for x, y in compared_pairs(args):
        seeds = sorted(seed for arm, seed in known if arm == x and (y, seed) in known)
        for key in ("newly_solved", "newly_lost") if seeds else ():
            diffs = [known[(x, seed)][key] - known[(y, seed)][key] for seed in seeds]
            label = f"{short(x)} - {short(y)} {OUTCOMES[key]}"
            line, pairs[f"{x}-{y}@{key}"] = pair_line(label, seeds, diffs, scale=1, unit="problems")
            lines.append(line)
    buckets = sorted(set(operations))
    header = [f"{b} operation{'s' * (b > 1)} ({operations.count(b)} problems)" for b in buckets]
    starts = [pct([v["start_by_operations"][b] for v in known.values()]) for b in buckets]
    lines += ["", "## Final pass@1 by number of operations (%, mean ± s.e. across seeds)", "",
              table_row("arm", "runs", header), "| --- " * (2 + len(buckets)) + "|",
              table_row("warm start (step 0 of every run)", len(known), starts)]  # fmt: skip
    for arm, values in by_arm.items():
        finals = {b: [v["by_operations"][b] for v in values] for b in buckets}
        if values:
            summary[arm]["pass@1_by_operations"] = {b: mean_se(finals[b]) for b in buckets}
        lines.append(table_row(ARMS[arm], len(values), [pct(finals[b]) for b in buckets]))
    left_out = [f"{short(arm)} s{seed}" for (arm, seed), value in outcomes.items() if value is None]
    if left_out:
        lines += ["", f"Left out of both tables (no counts at their first and last validation): {', '.join(left_out)}."]
    return lines, summary, pairs


def table_row(label: str, count, cells) -> str:
    return f"| {label} | {count} | " + " | ".join(cells) + " |"


def settings_text(args, warm: dict, cpu: bool, n: int) -> str:
    joined = getattr(args, "consolidate_frozen_parts", "off") == "on"  # round 2's settings predate the option
    parts = "each layer's parts joined at a reset" if joined else "one frozen part per reset"
    clamp = " (KL term bounded as verl's low_var_kl)" if getattr(args, "kl_clamp", "off") == "on" else ""
    guard = getattr(args, "cudnn_attention_guard", "off")  # rounds 1-3 ran before the guard existed
    guard_text = f"cuDNN attention guard {guard}" if guard != "off" else "no cuDNN attention guard"
    return (
        f"Warm start (the same for every arm and seed): {warm['parameters'] / 1e6:.1f}M-parameter Qwen2, greedy "
        f"accuracy {warm['greedy_accuracy']:.1%} after {warm['seconds']:.0f} s of SFT. Task: arithmetic, "
        f"{args.task_steps} operations on numbers up to {args.task_max_value}. {args.steps} RL steps of "
        f"{args.prompts_per_step} prompts x {args.num_generations} completions (at most {args.max_completion_length} "
        f"tokens); LoRA r{args.lora_rank} (alpha {2 * args.lora_rank}) on {args.lora_targets} over the "
        f"{'float32' if cpu else 'bf16'} warm start, exact (frozen) resets ({parts}); lr {args.learning_rate:g} "
        "(constant, "
        f"{args.warmup_steps} warm-up steps per phase), beta {args.beta:g}{clamp}, DAPO loss, clip 0.2/0.28, "
        f"{guard_text}. (b), (c), opt, ref, adapter: phases of {args.steps // 4} steps, top_p 0.7 -> 0.9 -> 1.0 -> "
        "1.0 with T 1.2 and twice the group (the prompts per generation batch kept: 2 optimizer steps per generation "
        "batch); (b) hard-resets (adapter, optimizer, reference) at each boundary; each knob arm makes one part of "
        "that reset there and carries the other two on: opt a fresh optimizer state and LR schedule, ref the KL "
        "reference moved to the policy, adapter a fresh adapter over the old one frozen into the policy. (d): a "
        f"reset after {args.plateau_patience} validations without a "
        f"{100 * args.plateau_min_delta:g}-point pass@1 gain. Validation every {args.eval_steps} steps: "
        f"{args.val_problems} held-out problems x {n} samples at T 1.0 (one sampling seed for all runs). Data: seed S "
        "gives every arm the same problems, in the same order for phase 0 and for all of (a) and (d)."
    )


def plateau_lines(args, runs: list[dict]) -> list[str]:
    """Per seed: pass@1 gain over the last half of the steps and the first step within 1 point of its best."""
    if not runs:
        return ["No finished run of arm (a)."]
    gains, lines = [], []
    for run in runs:
        steps = [row["prorl/global_step"] for row in run["evals"]]
        values = [row["eval_pass@1"] for row in run["evals"]]
        middle = min(range(len(steps)), key=lambda i: abs(steps[i] - args.steps / 2))
        gains.append(values[-1] - values[middle])
        near = next(step for step, value in zip(steps, values) if value >= max(values) - 0.01)
        two_se = learning.two_standard_errors(values[-1], values[middle], args.val_problems)
        lines.append(f"- s{run['seed']}: pass@1 {100 * values[middle]:.1f} at step {steps[middle]} -> "
                     f"{100 * values[-1]:.1f} at step {steps[-1]} ({100 * gains[-1]:+.1f} pts, 2 s.e. {100 * two_se:.1f});"
                     f" within 1 point of its best ({100 * max(values):.1f}) from step {near}")  # fmt: skip
    mean, low, high = t_interval(gains)
    ci = "" if math.isnan(low) else f", 95% CI [{100 * low:+.1f}, {100 * high:+.1f}]"
    return [f"Gain over the last half: {100 * mean:+.1f} pts{ci} (n={len(gains)}).", "", *lines, "",
            *last_third_lines(args, runs)]  # fmt: skip


PLATEAU_MAX_GAIN = 0.01  # the pre-set criterion (2026-11-29, before any round-4 run finished): see last_third_gains


def last_third_start(args) -> int:
    return math.ceil(2 * args.steps / 3)


def last_third_gains(args, runs: list[dict]) -> dict[str, list[float]]:
    """Per seed, what (a) still gained over the last third of its steps: validation pass@1 at the end minus at the
    first validation at or after 2/3 of the steps, and the mean training reward of the last sixth of the steps minus
    that of the sixth before it. Arm (a) has plateaued, by the criterion set before round 4's runs finished, when the
    mean validation gain across seeds is under `PLATEAU_MAX_GAIN` and its 95% CI holds 0: flat pooled pass@1 over
    the last third, not merely too few seeds to see a rise (the mean bound) nor a fall read as flat (the CI)."""
    start, sixth = last_third_start(args), args.steps / 6
    gains = {"pass@1": [], "reward": [], "from": []}
    for run in runs:
        evals = {row["prorl/global_step"]: row["eval_pass@1"] for row in run["evals"]}
        first = min((step for step in evals if step >= start), default=None)
        if first is None or first == max(evals):
            continue
        gains["pass@1"].append(evals[max(evals)] - evals[first])
        gains["from"].append(first)
        rewards = [(row["prorl/global_step"], row["reward"]) for row in run["rows"] if "reward" in row]
        last = [r for step, r in rewards if step > args.steps - sixth]
        before = [r for step, r in rewards if args.steps - 2 * sixth < step <= args.steps - sixth]
        if last and before:
            gains["reward"].append(sum(last) / len(last) - sum(before) / len(before))
    return gains


def last_third_lines(args, runs: list[dict]) -> list[str]:
    gains = last_third_gains(args, runs)
    if not gains["pass@1"]:
        return ["Over the last third: no run has a validation inside it before its last."]
    mean, low, high = t_interval(gains["pass@1"])
    flat = not math.isnan(low) and mean < PLATEAU_MAX_GAIN and low <= 0 <= high
    first = "/".join(str(step) for step in sorted(set(gains["from"])))
    lines = [f"Over the last third (from the validation at step {first}, the first at or after step "
             f"{last_third_start(args)}), pooled across seeds: validation "
             f"pass@1 {100 * mean:+.2f} pts, 95% CI [{100 * low:+.2f}, {100 * high:+.2f}] (n={len(gains['pass@1'])}); "
             f"plateaued by the pre-set criterion (mean gain under {100 * PLATEAU_MAX_GAIN:g} pt and its CI holding "
             f"0): **{'yes' if flat else 'no'}**."]  # fmt: skip
    if gains["reward"]:
        mean, low, high = t_interval(gains["reward"])
        ci = "n/a" if math.isnan(low) else f"[{low:+.4f}, {high:+.4f}]"
        lines.append(f"Training reward, last sixth minus the sixth before: {mean:+.4f}, 95% CI {ci} "
                     f"(n={len(gains['reward'])}).")  # fmt: skip
    return lines


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot_lines(path: Path, title: str, ylabel: str, groups: dict, marks: dict | None = None, window: int = 1) -> Path:
    """One color per group: a thin line per member curve, a thick line for their mean per step; `marks` are vertical
    lines (group -> steps; the key None for grey dashed phase boundaries)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, (label, curves) in enumerate(groups.items()):
        color, by_step = f"C{index}", defaultdict(list)
        for steps, values in curves:
            axis.plot(steps, moving_average(values, window), color=color, alpha=0.35, linewidth=0.7)
            for step, value in zip(steps, values):
                by_step[step].append(value)
        steps = sorted(by_step)
        means = moving_average([sum(by_step[s]) / len(by_step[s]) for s in steps], window)
        axis.plot(steps, means, color=color, linewidth=2, label=f"{label} (n={len(curves)})")
        for step in sorted(set((marks or {}).get(label, []))):
            axis.axvline(step, color=color, linestyle=":", linewidth=1, alpha=0.7)
    for step in (marks or {}).get(None, []):
        axis.axvline(step, color="grey", linestyle="--", linewidth=1)
    axis.set(title=title, xlabel="optimizer step", ylabel=ylabel)
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(0, -0.14))  # below the axes: 6 arms hid curves
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path


def write_plots(args, out: Path, runs: list[dict], n: int) -> list[Path]:
    """pass@1, pass@n, entropy, KL, length against step; resets dotted (arm color), phase boundaries grey dashed."""
    from prorl_trl.plots import series

    arms = [arm for arm in ARMS if any(run["arm"] == arm for run in runs)]
    marks = {ARMS[arm]: [s for run in runs if run["arm"] == arm for s in run["resets"]] for arm in arms}
    if set(SCHEDULED) & set(arms):
        marks[None] = [args.steps // 4 * i for i in (1, 2, 3)]
    window = max(1, args.steps // 60)
    figures = (("pass1", "eval_pass@1", "Validation pass@1", 1), (f"pass{n}", f"eval_pass@{n}",
               f"Validation pass@{n}", 1), ("entropy", "entropy", "Policy entropy (nats/token)", window),
               ("kl", "kl", "KL to the reference", window),
               ("length", "completions/mean_length", "Mean completion length (tokens)", window))  # fmt: skip
    written = []
    for stem, key, title, smooth in figures:
        groups = {ARMS[arm]: [series(run["rows"], (key,)) for run in runs if run["arm"] == arm] for arm in arms}
        groups = {label: [c for c in curves if c[0]] for label, curves in groups.items()}
        if any(groups.values()):
            groups = {label: curves for label, curves in groups.items() if curves}
            written.append(plot_lines(out / f"{stem}.png", title, key, groups, marks, smooth))
    return written


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
