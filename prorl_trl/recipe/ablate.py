"""`prorl-trl ablate GRID`: run every variant of one base recipe and write the comparison table.

A grid file:

```yaml
base: ../qwen3_0.6b_grpo_lora.yaml      # relative to the grid file
output_dir: runs/ablations/qwen3        # one sub-folder per variant, plus summary.md / summary.csv
metric: eval_pass@1                     # validation metric in the table (default: eval_pass@1, else eval_reward)
overrides: {training.max_steps: 200}    # applied to every variant (same dotted keys as on the command line)
variants:                               # name -> overrides
  r32: {}
  r16: {peft.r: 16, peft.lora_alpha: 32}
grid:                                   # optional: the cartesian product of axes, named `<level>_<level>...`
  rank: {r32: {peft.r: 32}, r8: {peft.r: 8}}
  gens: {g6: {}, g7: {training.num_generations: 7}}
```

Every variant is validated before any runs (exit 2 on a bad one). Each runs as its own process
(`python -m prorl_trl train`, or `--launcher "accelerate launch ..."`), `--parallel N` at a time; a variant whose
`run_summary.json` exists is skipped (`--force` re-runs it with `train --overwrite`) unless the grid has changed
a setting that alters its training since it ran (then it is reported `stale`, without its old numbers), an
interrupted one continues (`train --resume`), and a failed variant is reported in the table without stopping the
others. `--devices 0,1` gives each running variant a GPU that no other running variant has (with `--parallel` above
the number of devices, each device takes its share).

The output folder is checked before anything is validated or written (`trainer.output_guard.check_output_folder`): an
ablation's own folder is used again, a folder holding anything else needs `--allow-other-files`, and one that holds a
training run (or a distillation) is refused. What the ablation writes there (`summary.*`, `recipes/`, `logs/`, one
folder per variant) is recorded in its `.prorl_manifest.json` first; it deletes nothing itself (`--force` re-runs a
variant with `train --overwrite`, which deletes only what that run recorded).
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..console import eta_text
from ..files import UnreadableFileError, read_yaml
from ..trainer.manifest import OutputKind, present_outputs, record_outputs
from ..trainer.output_guard import check_output_folder
from .reading import read_recipe_file
from .schema import RecipeError, RecipeProblem, suggest

GRID_KEYS = ("base", "output_dir", "metric", "overrides", "variants", "grid", "description")
METRIC_PREFERENCE = ("eval_pass@1", "eval_reward")
OVERRIDES_SHAPE = "recipe key paths to values (e.g. {peft.r: 8})"


def legacy_ablation(folder: Path) -> list[str]:
    """The outputs of an ablation from before manifests: evidence only an ablation leaves is `recipes/<name>.yaml`
    whose `training.output_dir` is `<folder>/<name>`; then its tables, `recipes/`, `logs/` and those run folders."""
    recipes, variants = folder / "recipes", []
    for recipe in sorted(recipes.glob("*.yaml")) if recipes.is_dir() and not recipes.is_symlink() else []:
        try:
            training = read_yaml(recipe).get("training")
        except UnreadableFileError:
            continue
        written = Path(str(training.get("output_dir", ""))) if isinstance(training, dict) else Path()
        if (written.parent.name, written.name) == (folder.name, recipe.stem):
            variants.append(f"{recipe.stem}/")
    if not variants:
        return []
    return present_outputs(folder, [*ABLATE.writes, *variants])


ABLATE = OutputKind("ablate", "--out", legacy_ablation, ("summary.csv", "summary.md", "recipes/", "logs/"))


@dataclass
class Variant:
    name: str
    overrides: dict[str, Any]
    raw: dict[str, Any] = field(default_factory=dict)
    status: str = "pending"
    seconds: float | None = None
    summary: dict[str, Any] | None = None


def load_grid(path: str | Path) -> tuple[dict[str, Any], list[Variant]]:
    """Read a grid file and expand it into variants (explicit `variants` first, then the `grid` product)."""
    path = Path(path)
    grid = read_recipe_file(path, kind="grid")
    problems = []
    for key in grid:
        if key not in GRID_KEYS:
            problems.append(RecipeProblem(str(key), f"unknown key{suggest(key, GRID_KEYS)}", grid[key]))
    if "base" not in grid:
        problems.append(RecipeProblem("base", "is required: the recipe every variant starts from"))
    problems += _shape_problems(grid)
    if problems:  # the expansion below needs mappings everywhere
        raise RecipeError(str(path), problems)
    variants = []
    for name, overrides in (grid.get("variants") or {}).items():
        variants.append(Variant(str(name), dict(overrides or {})))
    axes = grid.get("grid") or {}
    if axes:
        for combination in itertools.product(*[list(levels.items()) for levels in axes.values()]):
            merged: dict[str, Any] = {}
            for _, overrides in combination:
                merged.update(overrides or {})
            variants.append(Variant("_".join(str(level) for level, _ in combination), merged))
    names = [v.name for v in variants]
    if not variants:
        problems.append(RecipeProblem("variants", "the grid has no variants (give `variants` and/or `grid`)"))
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(RecipeProblem(f"variants.{name}", "variant name used twice"))
    for name in names:
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            problems.append(RecipeProblem(f"variants.{name}", "variant names may use letters, digits, - _ . only"))
    if problems:
        raise RecipeError(str(path), problems)
    grid["base"] = (
        str((path.parent / grid["base"]).resolve()) if not Path(grid["base"]).is_absolute() else grid["base"]
    )
    grid.setdefault("output_dir", str(Path("runs") / "ablations" / path.stem))
    return grid, variants


def _shape_problems(grid: dict[str, Any]) -> list[RecipeProblem]:
    """`overrides`, `variants` and `grid` must be mappings down to each set of overrides (`{}` or null: none)."""

    def mapping_problem(key_path: str, value: Any, of: str = OVERRIDES_SHAPE) -> list[RecipeProblem]:
        return [] if value is None or isinstance(value, dict) else [
            RecipeProblem(key_path, f"expected a mapping of {of}", value)
        ]

    problems = mapping_problem("overrides", grid.get("overrides"))
    variants = grid.get("variants")
    problems += mapping_problem("variants", variants, "variant names to overrides")
    if isinstance(variants, dict):
        for name, overrides in variants.items():
            problems += mapping_problem(f"variants.{name}", overrides)
    axes = grid.get("grid")
    problems += mapping_problem("grid", axes, "axis names to levels")
    if isinstance(axes, dict):
        for axis, levels in axes.items():
            problems += mapping_problem(f"grid.{axis}", levels, "level names to overrides")
            if isinstance(levels, dict):
                for level, overrides in levels.items():
                    problems += mapping_problem(f"grid.{axis}.{level}", overrides)
    return problems


def prepare_variants(grid: dict[str, Any], variants: list[Variant], out: Path, machine: bool = True) -> None:
    """Apply overrides to the base recipe and check every variant as `validate` does (recipe, this machine, local
    data; `machine=False`: the recipe alone; nothing is written); one `RecipeError` lists every variant's problems,
    each problem the variants share once (`shared_problems`)."""
    from .checks import other_machine_hint
    from .load import recipe_and_problems
    from .preflight import preflight

    found: dict[str, list[RecipeProblem]] = {}
    skipped: list[str] = []
    base = read_recipe_file(grid["base"])
    data_checked: set[str] = set()  # variants usually share their data: read it once
    for variant in variants:
        raw = copy.deepcopy(base)
        overrides = list((grid.get("overrides") or {}).items()) + list(variant.overrides.items())
        overrides.append(("training.output_dir", str(out / variant.name)))
        recipe, problems = recipe_and_problems(raw, f"{grid['base']} [{variant.name}]", overrides, dry=not machine)
        if recipe is not None:
            data_key = repr((recipe.data, recipe.rewards, recipe.validation))
            problems += preflight(recipe, machine=machine, data=data_key not in data_checked)
            data_checked.add(data_key)
            skipped += recipe.skipped
        found[variant.name] = problems
        variant.raw = raw
    if any(found.values()):
        problems = shared_problems(found)
        file = grid.get("_file", "grid")
        command = shlex.join(["prorl-trl", "ablate", str(file), "--validate-only", "--no-machine-checks"])
        raise RecipeError(file, problems, notes=skipped, hints=other_machine_hint(problems, command))


def shared_problems(found: dict[str, list[RecipeProblem]]) -> list[RecipeProblem]:
    """Each variant's problems under `variants.<name>: ...`, except that a problem several variants share is listed
    once, naming them (`(all 8 variants): training.bf16 = True: ...`)."""
    who: dict[tuple[str, str, str], list[str]] = {}
    first: dict[tuple[str, str, str], RecipeProblem] = {}
    for name, problems in found.items():
        for problem in problems:
            key = (problem.path, problem.message, repr(problem.value))
            who.setdefault(key, []).append(name)
            first.setdefault(key, problem)
    merged = []
    for key, names in who.items():
        problem = first[key]
        if len(names) == 1:
            where = f"variants.{names[0]}"
        elif len(names) == len(found):
            where = f"(all {len(names)} variants)"
        else:
            where = f"variants {', '.join(names)}"
        merged.append(RecipeProblem(f"{where}: {problem.path}", problem.message, problem.value))
    return merged


def write_variant_recipes(variants: list[Variant], out: Path) -> None:
    recipes_dir = out / "recipes"
    recipes_dir.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        (recipes_dir / f"{variant.name}.yaml").write_text(
            yaml.safe_dump(variant.raw, sort_keys=False, allow_unicode=True)
        )


def _launch_command(launcher: str | None, recipe: Path, force: bool = False) -> list[str]:
    """`train` for one variant: `--overwrite` when re-running it (`--force`), else `--resume`, which continues a
    variant that was interrupted (and starts one that never ran)."""
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    return prefix + ["-m", "prorl_trl", "train", str(recipe), "--overwrite" if force else "--resume"]


def stale_changes(run_dir: Path, raw: dict[str, Any]) -> list[str]:
    """The training-altering changes (`key: old -> new`) of a variant's recipe (`raw`) against the recipe its finished
    run in `run_dir` recorded; empty when none (or when the run recorded no recipe)."""
    from .changes import ChangedRecipeError, changes_since_recorded

    try:
        changes = changes_since_recorded(run_dir, raw)
    except ChangedRecipeError:  # a damaged recipe.yaml: what the run was trained with is unknown
        return [f"{run_dir / 'recipe.yaml'} cannot be read"]
    return [change.describe() for change in changes or [] if change.alters_training]


def _stale_status(name: str, changes: list[str]) -> str:
    shown = "; ".join(changes[:3]) + (f"; {len(changes) - 3} more" if len(changes) > 3 else "")
    return f"stale (ran with other settings: {shown}; re-run it with --only {name} --force)"


def device_slots(devices: str | None, parallel: int) -> queue.Queue | None:
    """The GPUs variants may take (`--devices 0,1`), each listed once per variant it may run at a time: one each
    while `parallel` <= the number of devices, else as evenly shared as `parallel` asks. None: no `--devices`."""
    ids = [device.strip() for device in (devices or "").split(",") if device.strip()]
    if not ids:
        return None
    free: queue.Queue = queue.Queue()
    for slot in range(max(parallel, len(ids))):
        free.put(ids[slot % len(ids)])
    return free


def run_variant(variant: Variant, out: Path, launcher: str | None, env: dict[str, str], force: bool = False) -> None:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(logs / f"{variant.name}.log", "w") as log:
        result = subprocess.run(
            _launch_command(launcher, out / "recipes" / f"{variant.name}.yaml", force),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=os.getcwd(),
        )
    variant.seconds = time.time() - started
    summary_file = out / variant.name / "run_summary.json"
    if result.returncode == 0 and summary_file.is_file():
        variant.status, variant.summary = "done", _read_summary(summary_file)
    else:
        variant.status = f"failed (exit {result.returncode}; logs/{variant.name}.log)"


def _read_summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    data.pop("log_history", None)
    return data


def pick_metric(variants: list[Variant], requested: str | None) -> str | None:
    seen = {key for v in variants if v.summary for key in v.summary.get("final_eval", {})}
    if requested:
        return requested
    return next((m for m in METRIC_PREFERENCE if m in seen), min(seen) if seen else None)


def write_summary(variants: list[Variant], out: Path, metric: str | None) -> tuple[Path, Path]:
    """`summary.csv` and `summary.md`: one row per variant, the final validation metric and per-reward means."""
    reward_names = sorted({name for v in variants if v.summary for name in v.summary.get("reward_means", {})})
    header = [
        "variant",
        "status",
        "steps",
        metric or "validation",
        *[f"{name} (mean)" for name in reward_names],
        "minutes",
        "overrides",
    ]
    rows = []
    for variant in variants:
        summary = variant.summary or {}
        value = summary.get("final_eval", {}).get(metric) if metric else None
        means = summary.get("reward_means", {})
        seconds = variant.seconds if variant.seconds is not None else summary.get("seconds")
        rows.append(
            [
                variant.name,
                variant.status,
                summary.get("steps", ""),
                "" if value is None else f"{value:.4f}",
                *["" if means.get(n) is None else f"{means[n]:.4f}" for n in reward_names],
                "" if seconds is None else f"{seconds / 60:.1f}",
                "; ".join(f"{k}={json.dumps(v)}" for k, v in variant.overrides.items()) or "(base)",
            ]
        )
    csv_path, md_path = out / "summary.csv", out / "summary.md"
    with open(csv_path, "w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
    escape = lambda cell: str(cell).replace("|", "\\|")  # noqa: E731
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *["| " + " | ".join(escape(c) for c in row) + " |" for row in rows],
    ]
    note = (
        f"\n`{metric}`: last validation value of each run; reward means: average of `rewards/<name>/mean` over all "
        "logged training steps.\n"
    )
    md_path.write_text("\n".join(lines) + "\n" + note)
    return csv_path, md_path


def run_ablate(args: Any) -> int:
    grid, variants = load_grid(args.grid)
    grid["_file"] = str(args.grid)
    out = Path(args.out or grid["output_dir"])
    if args.only:
        unknown = [name for name in args.only if name not in {v.name for v in variants}]
        if unknown:
            raise RecipeError(
                str(args.grid),
                [
                    RecipeProblem(
                        "--only", f"no such variant{suggest(unknown[0], [v.name for v in variants])}", unknown
                    )
                ],
            )
        variants = [v for v in variants if v.name in args.only]
    run_folders = [f"{variant.name}/" for variant in variants]
    check_output_folder(out, ABLATE, run_folders, getattr(args, "allow_other_files", False))  # exit 2, nothing written
    prepare_variants(grid, variants, out, machine=not getattr(args, "no_machine_checks", False))
    print(f"{len(variants)} variants of {grid['base']} validated")
    if args.validate_only:
        return 0
    record_outputs(out, [*ABLATE.writes, *run_folders], kind=ABLATE)  # before writing them
    write_variant_recipes(variants, out)
    todo, stale = [], []
    for variant in variants:
        summary_file = out / variant.name / "run_summary.json"
        if summary_file.is_file() and not args.force:
            changes = stale_changes(out / variant.name, variant.raw)
            if changes:  # its numbers are not those of the grid's variant: shown as stale, without them
                variant.status = _stale_status(variant.name, changes)
                stale.append(variant)
            else:
                variant.status, variant.summary = "done (earlier run)", _read_summary(summary_file)
        else:
            todo.append(variant)
    skipped = len(variants) - len(todo) - len(stale)
    print(
        f"running {len(todo)} (skipping {skipped} already finished"
        + (f", {len(stale)} stale" if stale else "")
        + f"), {max(1, args.parallel)} at a time"
    )
    for variant in stale:
        print(f"  {variant.name}: {variant.status}", file=sys.stderr, flush=True)
    requested = args.metric or grid.get("metric")
    lock, finished, started = threading.Lock(), [0], time.time()
    free_devices = device_slots(getattr(args, "devices", None), max(1, args.parallel))

    def work(variant: Variant) -> None:
        env = dict(os.environ)
        device = free_devices.get() if free_devices is not None else None  # waits for a GPU no variant is using
        try:
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            variant.status = "running"
            print(f"  start  {variant.name}  (log: {out / 'logs' / (variant.name + '.log')})", flush=True)
            run_variant(variant, out, args.launcher, env, force=args.force)
        finally:
            if device is not None:
                free_devices.put(device)
        with lock:
            finished[0] += 1
            metric = pick_metric(variants, requested)
            value = (variant.summary or {}).get("final_eval", {}).get(metric or "")
            shown = f", {metric}={value:.4f}" if isinstance(value, float) else ""
            print(
                f"[{finished[0]}/{len(todo)}] {variant.name}: {variant.status} in {variant.seconds / 60:.1f} min"
                f"{shown} ({eta_text(finished[0], len(todo), time.time() - started)})",
                flush=True,
            )
            write_summary(variants, out, metric)

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        list(pool.map(work, todo))
    csv_path, md_path = write_summary(variants, out, pick_metric(variants, requested))
    print(md_path.read_text())
    failed = [v.name for v in variants if v.status.startswith("failed")]
    print(f"summary: {md_path}  {csv_path}\nruns:    {out}/<variant>/  logs: {out / 'logs'}/")
    if failed:
        print(f"{len(failed)} variant(s) failed: {', '.join(failed)}", file=sys.stderr)
    if stale:
        print(
            f"{len(stale)} variant(s) stale (finished with settings the grid has since changed): "
            f"{', '.join(v.name for v in stale)}; re-run them with --only {' '.join(v.name for v in stale)} --force",
            file=sys.stderr,
        )
    return 1 if failed or stale else 0
