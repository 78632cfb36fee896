"""`prorl-trl demo`: a complete ProRL run on a laptop CPU, offline, in minutes.

It builds a tiny Qwen2 model (`prorl_trl.tiny`) and a synthetic arithmetic task (`prorl_trl.data.synthetic`),
warm-starts the model with a short supervised fine-tune (TRL `SFTTrainer`) so that it is right part of the time,
then runs the demo recipe (`recipes/demo_tiny.yaml`, embedded below) through exactly the code path of
`prorl-trl train`: two phases with a hard reset between them, validation pass@1 before, during and after.
It writes `summary.json` (`val_accuracy_before`, `val_accuracy_after`, timings), `report.md` and PNG plots.

Why a warm start: GRPO learns only from groups in which some completions are right and some wrong. A random tiny
model is never right, a fully trained one always; a short SFT lands in between, where RL has signal.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# The embedded default recipe; `recipes/demo_tiny.yaml` holds the same settings (a test keeps them equal).
# `model.name_or_path` and `training.output_dir` are replaced by the demo's own folders.
DEMO_RECIPE: dict[str, Any] = {
    "description": "Offline demo - tiny Qwen2, synthetic one-step arithmetic, 2 ProRL phases with a hard reset (CPU).",
    "model": {"name_or_path": "./prorl-demo/warm_start", "dtype": "float32"},
    "peft": None,
    "data": {
        "builder": "synthetic_arithmetic",
        "prompt_format": "plain",
        "options": {
            "num_train": 4000,
            "num_validation": 40,
            "seed": 0,
            "num_steps": 1,
            "max_value": 9,
            "style": "expression",
        },
        "validation_split": "validation",
        "validation_size": 40,
    },
    "rewards": [{"name": "boxed_answer"}],
    "training": {
        "output_dir": "prorl-demo/train",
        "use_cpu": True,
        "bf16": False,
        "learning_rate": 2.5e-4,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": 10,
        "per_device_train_batch_size": 64,
        "num_generations": 8,
        "max_completion_length": 8,
        "temperature": 1.0,
        "beta": 0.01,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "save_strategy": "no",
        "seed": 0,
    },
    "phases": [
        {"name": "explore", "max_steps": 75},
        {"name": "sharpen", "max_steps": 75, "temperature": 0.9},
    ],
    "validation": {
        "eval_steps": 25,
        "num_samples": 4,
        "temperature": 1.0,
        "max_completion_length": 8,
        "batch_size": 50,
        "at_start": True,
    },
    "logging": {"report_to": "none", "logging_steps": 5, "disable_tqdm": False},
}

# `--smoke`: the same pipeline shrunk to seconds (used by the tests); no accuracy claim is made for it.
SMOKE_OVERRIDES: list[tuple[str, Any]] = [
    ("data.options.num_train", 64),
    ("data.options.num_validation", 8),
    ("data.validation_size", 8),
    ("training.per_device_train_batch_size", 16),
    ("training.num_generations", 4),
    ("training.max_completion_length", 6),
    ("phases.0.max_steps", 2),
    ("phases.1.max_steps", 2),
    ("validation.eval_steps", 2),
    ("validation.max_completion_length", 6),
    ("logging.logging_steps", 1),
]

# The tiny model: big enough to learn one-step arithmetic from a few hundred SFT steps, small enough for 2 CPU cores.
MODEL_SIZE = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SMOKE_MODEL_SIZE = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="prorl-demo", help="output folder (created; default: ./prorl-demo)")
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of the same pipeline (tests)")
    parser.add_argument(
        "--sft-steps", type=int, default=None, help="warm-start SFT steps (default 100; 5 with --smoke)"
    )
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3, help="warm-start SFT learning rate")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (default 1: 52 s on 2 idle cores vs 42 s with 2, but 2 threads on cores other jobs "
        "share ran the demo 7x slower)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model and the SFT")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="run again into an --out that holds a demo: its own outputs are deleted first (nothing else)",
    )  # fmt: skip


# What the demo writes into --out; `--overwrite` deletes these names and nothing else (`run/` through the run's own
# manifest, as `prorl-trl train --overwrite` does).
DEMO_OUTPUTS = ("warm_start", "sft", "plots", "recipe.yaml", "summary.json", "report.md")
# Written first into --out: what marks a folder as a demo's, so `--overwrite` never deletes a user's files that
# happen to carry the demo's names.
DEMO_MARKER = ".prorl_demo"


def _is_demo_folder(out: Path) -> bool:
    """The marker, or (a demo from before the marker) a summary.json that only the demo writes."""
    if (out / DEMO_MARKER).is_file():
        return True
    try:
        return "val_accuracy_curve" in json.loads((out / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _check_arguments(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.sft_steps is not None and args.sft_steps < 0:
        problems.append(f"--sft-steps must be >= 0, got {args.sft_steps}")
    if args.sft_learning_rate <= 0:
        problems.append(f"--sft-learning-rate must be > 0, got {args.sft_learning_rate}")
    if args.threads < 1:
        problems.append(f"--threads must be >= 1, got {args.threads}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {out} exists and is not a folder")
    elif out.is_dir() and any(out.iterdir()) and not _is_demo_folder(out):
        problems.append(
            f"--out {out} is not empty and was not written by the demo: nothing was changed (--overwrite deletes only "
            "a demo's own outputs). Choose another --out (a demo interrupted before 2026-11-29 left no mark: delete "
            "its folder by hand)"
        )
    elif out.is_dir() and any(out.iterdir()) and not args.overwrite and not (out / "summary.json").is_file():
        problems.append(
            f"--out {out} holds an interrupted demo: nothing was changed. Pass --overwrite to delete the demo's own "
            "outputs there and run it again, or choose another --out"
        )
    else:
        from .recipe.output_folder import plan_start
        from .trainer.output_guard import OutputFolderError, refuse_shared_folder

        try:
            refuse_shared_folder(out, "--out")
            if args.overwrite and (out / "run").exists():  # the training run's folder: refused before any deletion
                plan_start(out / "run", overwrite=True)
        except OutputFolderError as error:
            problems.append(str(error))
    if importlib.util.find_spec("matplotlib") is None:
        problems.append(
            "the demo's plots need matplotlib: `pip install -e '.[plots]'` (or `pip install matplotlib`)"
        )
    return problems


def run_demo(args: argparse.Namespace) -> int:
    """The `prorl-trl demo` command. Exit status 0 on success, 2 on bad arguments."""
    problems = _check_arguments(args)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if (out / "summary.json").is_file() and not args.overwrite:  # a finished demo: say what it gave, change nothing
        try:
            done = json.loads((out / "summary.json").read_text())
            before, after = float(done["val_accuracy_before"]), float(done["val_accuracy_after"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"error: {out / 'summary.json'} cannot be read ({error}); pass --overwrite to run the demo again",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"{out} holds a finished demo (nothing was run or changed; --overwrite runs it again):")
        print(f"validation pass@1: {before:.1%} before RL -> {after:.1%} after. Report: {out / 'report.md'}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch

    if args.overwrite and out.is_dir():
        for name in DEMO_OUTPUTS:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    torch.set_num_threads(args.threads)
    summary = run_demo_pipeline(
        out,
        overwrite=args.overwrite,
        smoke=args.smoke,
        sft_steps=args.sft_steps if args.sft_steps is not None else (5 if args.smoke else 100),
        sft_learning_rate=args.sft_learning_rate,
        seed=args.seed,
    )
    before, after = summary["val_accuracy_before"], summary["val_accuracy_after"]
    first, last = summary["train_reward_first"], summary["train_reward_last"]
    trained = f"training reward {first:+.2f} -> {last:+.2f}; " if first is not None and last is not None else ""
    print(
        f"\n{trained}held-out validation pass@1: {before:.1%} before RL -> {after:.1%} after "
        f"({summary['seconds_total']:.0f} s). Report: {Path(args.out) / 'report.md'}, plots: {Path(args.out) / 'plots'}/"
    )
    return 0


def demo_recipe(out: Path, smoke: bool) -> dict[str, Any]:
    """The recipe mapping the demo runs: the embedded default, its folders under `out`, shrunk for `--smoke`."""
    from .recipe.reading import apply_overrides

    raw = copy.deepcopy(DEMO_RECIPE)
    overrides = [("model.name_or_path", str(out / "warm_start")), ("training.output_dir", str(out / "run"))]
    problems = apply_overrides(raw, overrides + (SMOKE_OVERRIDES if smoke else []))
    if problems:  # only if DEMO_RECIPE and SMOKE_OVERRIDES drift apart
        raise RuntimeError(f"demo recipe overrides do not apply: {problems}")
    return raw


def run_demo_pipeline(
    out: Path, smoke: bool, sft_steps: int, sft_learning_rate: float, seed: int = 0, overwrite: bool = False
) -> dict[str, Any]:
    """Warm start, RL (the recipe, via `prorl-trl train`'s code), plots and report. Returns the summary."""
    from .recipe.load import recipe_from_dict
    from .recipe.run import run_train
    from .tiny import build_tiny

    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("written by `prorl-trl demo`: its --overwrite deletes its own outputs here\n")
    size = SMOKE_MODEL_SIZE if smoke else MODEL_SIZE
    model, tokenizer = build_tiny(seed=seed, **size)
    warm_dir = out / "warm_start"
    model.save_pretrained(warm_dir)  # the random model first, so the recipe validates before any training
    tokenizer.save_pretrained(warm_dir)
    raw = demo_recipe(out, smoke)
    recipe = recipe_from_dict(copy.deepcopy(raw), "demo recipe", dry=False)
    recipe_path = out / "recipe.yaml"
    recipe_path.write_text(recipe.to_yaml())

    print(f"[demo] warm start: {sft_steps} SFT steps on the tiny model ({_count(model) / 1e6:.2f}M parameters)")
    sft_started = time.time()
    sft_loss = warm_start(model, tokenizer, recipe, sft_steps, sft_learning_rate, out / "sft", seed)
    model.save_pretrained(warm_dir)
    sft_seconds = time.time() - sft_started

    print(f"[demo] ProRL: {len(raw['phases'])} phases, recipe {recipe_path}")
    rl_started = time.time()
    status = run_train(str(recipe_path), [], overwrite=overwrite and (out / "run").exists())
    if status != 0:
        raise RuntimeError(f"the demo's training run failed with status {status}")
    rl_seconds = time.time() - rl_started

    run_dir = Path(recipe.output_dir)
    history = json.loads((run_dir / "run_summary.json").read_text())["log_history"]
    validation = validation_curve(history)
    if not validation[1]:
        raise RuntimeError("the demo's run logged no validation pass@1 (is `validation.enabled` off?)")
    rewards = [float(entry["reward"]) for entry in history if "reward" in entry and "loss" in entry]
    window = max(1, len(rewards) // 10)  # the first and last tenth of the training steps
    summary = {
        "train_reward_first": sum(rewards[:window]) / window if rewards else None,
        "train_reward_last": sum(rewards[-window:]) / window if rewards else None,
        "val_accuracy_before": validation[1][0],
        "val_accuracy_after": validation[1][-1],
        "val_accuracy_curve": {"steps": validation[0], "pass@1": validation[1]},
        "metric": (
            f"validation pass@1: {raw['validation']['num_samples']} samples at temperature "
            f"{raw['validation']['temperature']} on {raw['data']['validation_size']} held-out problems"
        ),
        "smoke": smoke,
        "model_parameters": _count(model),
        "model_size": size,
        "sft_steps": sft_steps,
        "sft_final_loss": sft_loss,
        "phases": [{k: p[k] for k in ("name", "max_steps") if k in p} for p in raw["phases"]],
        "resets": max((int(e.get("prorl/resets", 0)) for e in history), default=0),
        "seconds_warm_start": round(sft_seconds, 1),
        "seconds_rl": round(rl_seconds, 1),
        "seconds_total": round(time.time() - started, 1),
        "torch_threads": _threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} CPUs",
        "recipe": str(recipe_path),
        "run_dir": str(run_dir),
    }
    summary["plots"] = [str(p.relative_to(out)) for p in _plots(history, validation, out / "plots")]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(render_report(summary))
    return summary


def warm_start(
    model, tokenizer, recipe, steps: int, learning_rate: float, output_dir: Path, seed: int
) -> float | None:
    """Supervised fine-tune on the recipe's own training prompts with `\\boxed{answer}` targets (TRL SFTTrainer).

    The targets teach the answer format and some arithmetic; the few steps keep the model mediocre on purpose.
    Returns the last logged training loss (None for 0 steps).
    """
    if steps == 0:
        return None
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    from .attention import install_cudnn_attention_guard
    from .data import build_dataset
    from .trainer.progress import use_run_progress

    rows = build_dataset(recipe.data, "train", tokenizer)
    rows = rows.map(lambda row: {"completion": "\\boxed{" + str(row["answer"]) + "}"})
    rows = rows.select_columns(["prompt", "completion"])
    config = SFTConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        logging_steps=max(1, steps // 5),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=seed,
        disable_tqdm=False,
    )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer)
        use_run_progress(trainer)  # a bar with rate and ETA, a short line per log
        install_cudnn_attention_guard(trainer.accelerator.unwrap_model(trainer.model))  # a no-op off CUDA
        trainer.train()
    finally:
        hf_logging.set_verbosity(verbosity)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return float(losses[-1]) if losses else None


def validation_curve(history: list[dict[str, Any]], key: str = "eval_pass@1") -> tuple[list[float], list[float]]:
    """(run-wide steps, values) of the validation metric, in log order."""
    from .plots import series

    return series(history, (key,))


def _plots(history: list[dict[str, Any]], validation: tuple[list[float], list[float]], folder: Path) -> list[Path]:
    from .plots import phase_boundaries, plot_training_curves

    training = [entry for entry in history if "reward" in entry or "entropy" in entry]
    return plot_training_curves(
        training, folder, validation={"validation pass@1": validation}, boundaries=phase_boundaries(history)
    )


def render_report(summary: dict[str, Any]) -> str:
    """The markdown report: what ran, accuracy before/after, timings, plots."""
    before, after = summary["val_accuracy_before"], summary["val_accuracy_after"]
    phases = ", ".join(f"{p['name']} ({p['max_steps']} steps)" for p in summary["phases"])
    lines = [
        "# prorl-trl offline demo",
        "",
        "A tiny Qwen2 model ("
        + f"{summary['model_parameters'] / 1e6:.2f}M parameters) learns one-step arithmetic: a short "
        f"SFT warm start ({summary['sft_steps']} steps), then ProRL phases {phases} with "
        f"{summary['resets']} hard reset(s), graded by `boxed_answer`."
        + (" **Smoke run: numbers mean nothing.**" if summary["smoke"] else ""),
        "",
        "| | validation pass@1 |",
        "|---|---|",
        f"| after the SFT warm start (before RL) | {before:.1%} |",
        f"| after ProRL | {after:.1%} |",
        f"| change | {100 * (after - before):+.1f} points |",
        "",
        f"Metric: {summary['metric']}.",
        "",
        "| optimizer step | " + " | ".join(f"{step:.0f}" for step in summary["val_accuracy_curve"]["steps"]) + " |",
        "|---|" + "---|" * len(summary["val_accuracy_curve"]["steps"]),
        "| validation pass@1 | "
        + " | ".join(f"{value:.1%}" for value in summary["val_accuracy_curve"]["pass@1"])
        + " |",
        "",
        (
            f"Time: {summary['seconds_total']:.0f} s in all (warm start {summary['seconds_warm_start']:.0f} s, RL "
            f"{summary['seconds_rl']:.0f} s) on {summary['machine']}, {summary['torch_threads']} torch threads."
        ),
        "",
        f"Recipe: `{summary['recipe']}`; run folder (log history, final model): `{summary['run_dir']}`.",
        "",
    ]
    for plot in summary["plots"]:
        lines += [f"![{Path(plot).stem}]({plot})", ""]
    return "\n".join(lines)


def _count(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def _threads() -> int:
    import torch

    return torch.get_num_threads()
