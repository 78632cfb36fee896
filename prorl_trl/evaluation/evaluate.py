"""The evaluation pipeline behind `prorl-trl eval`: sample -> grade -> aggregate -> files and plots."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .grading import grade, reward_name
from .regression import feature_regression
from .report import OVERALL, always_wrong_table, passk_table, per_problem_table, write_outputs
from .passk import pass_at_k_per_problem
from .runner import ModelSpec, sample_model
from .sampling import SamplingSettings


# Completions graded per reward call (the progress bar moves once per chunk).
GRADING_CHUNK = 512


def grade_records(
    records: list[dict[str, Any]], rows: dict[str, dict[str, Any]], reward: Callable, progress: bool = False,
    desc: str = "grading",
) -> None:
    """Add `reward` and `correct` to every sample record in place (in chunks, with a progress bar when asked:
    symbolic grading of tens of thousands of completions takes minutes)."""
    from tqdm.auto import tqdm

    chunk = GRADING_CHUNK
    with tqdm(total=len(records), desc=desc, unit="completion", disable=not progress) as bar:
        for start in range(0, len(records), chunk):
            part = records[start : start + chunk]
            chosen = [rows[r["problem_id"]] for r in part]
            rewards, correct = grade(reward, [row["prompt"] for row in chosen], [r["completion"] for r in part], chosen)
            for record, value, ok in zip(part, rewards, correct):
                record["reward"], record["correct"] = value, ok
            bar.update(len(part))


def evaluate(
    rows: list[dict[str, Any]],
    models: Sequence[ModelSpec],
    ks: Sequence[int],
    settings: SamplingSettings,
    reward: Callable,
    out: str | Path,
    breakdown: Sequence[str] = (),
    reference: str | None = None,
    dataset: str = "",
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
    trust_remote_code: bool = False,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    plots: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the whole evaluation and write its files under `out`; returns the paths and the pass@k table."""
    out = Path(out)
    by_id = {row["problem_id"]: row for row in rows}
    order = sorted(models, key=lambda m: m.name != reference)  # the reference first: it decides the subset
    evaluated, hard = rows, None
    records_by_model: dict[str, list[dict[str, Any]]] = {}
    throughput: dict[str, dict[str, Any]] = {}
    earlier = _earlier_throughput(out)
    for spec in order:
        records, stats = sample_model(spec, evaluated, settings, out, backend, device, dtype, trust_remote_code, progress)
        grade_records(records, by_id, reward, progress, desc=f"grading {spec.name}")
        records_by_model[spec.name] = records
        seconds = stats["seconds"]
        throughput[spec.name] = {
            **stats, "completions_per_s": stats["completions"] / seconds if seconds else None,
            "tokens_per_s": stats["completion_tokens"] / seconds if seconds else None,
        }
        if not stats["completions"] and (earlier.get(spec.name) or {}).get("completions"):
            throughput[spec.name] = {**earlier[spec.name], "earlier_run": True}  # every sample read back: keep its rate
        if spec.name == reference:
            solved = {r["problem_id"] for r in records if r["correct"]}
            evaluated = [row for row in rows if row["problem_id"] not in solved]
            hard = [row["problem_id"] for row in evaluated]
    with open(out / "samples.jsonl", "w", encoding="utf-8") as handle:
        for name, records in records_by_model.items():
            for record in records:
                handle.write(json.dumps({"model": name, **record}) + "\n")

    per_problem = per_problem_table(records_by_model, rows, breakdown)
    if hard is not None:  # every table is over the problems the reference never solved
        per_problem = per_problem[per_problem["problem_id"].isin(hard)].reset_index(drop=True)
    seed = settings.seed
    passk = passk_table(per_problem, ks, breakdown, num_resamples, confidence, seed)
    always_wrong = problems = None
    if reference is not None:
        always_wrong, problems = always_wrong_table(per_problem, reference, ks, num_resamples, confidence, seed)
    regressions = _regressions(per_problem, max(ks), breakdown)
    plot_paths: list[Path] = []
    if plots and not per_problem.empty:
        from .plots import plot_pass1_histogram, plot_passk

        try:
            scope = None if reference is None else f"problems {reference} never solved"
            plot_paths = [plot_passk(passk, out, group_by, scope) for group_by in [OVERALL, *breakdown]]
            plot_paths += [plot_pass1_histogram(per_problem, spec.name, out) for spec in models]
        except ImportError:
            print("prorl-trl eval: plots skipped: they need matplotlib (pip install -e '.[plots]').")
    per_problem.to_csv(out / "per_problem.csv", index=False)
    run_settings = {
        "dataset": dataset, "models": {m.name: m.path for m in models}, "num_problems": len(rows),
        "num_evaluated": int(per_problem["problem_id"].nunique()) if not per_problem.empty else 0,
        **settings.to_dict(), "k": list(ks), "reward": reward_name(reward), "breakdown": list(breakdown),
        "always_wrong": reference, "num_resamples": num_resamples, "confidence": confidence,
    }
    paths = write_outputs(out, run_settings, passk, ks, breakdown, throughput, always_wrong, problems, regressions,
                          plot_paths)
    _print_summary(passk, ks, throughput)
    print(f"prorl-trl eval: report {paths['md']} (summary.json, per_problem.csv and samples beside it)")
    return {"paths": paths, "plots": plot_paths, "pass_at_k": passk, "per_problem": per_problem}


def _earlier_throughput(out: Path) -> dict[str, dict[str, Any]]:
    """The throughput an earlier evaluation into `out` recorded (its `summary.json`), per model; {} if none or
    unreadable. A re-run that reads every sample back reports that, not "0 completions"."""
    try:
        recorded = json.loads((out / "summary.json").read_text()).get("throughput") or {}
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return {name: stats for name, stats in recorded.items() if isinstance(stats, dict)} if isinstance(recorded, dict) else {}


def _regressions(per_problem, k: int, features: Sequence[str]) -> dict[str, Any]:
    """Per model: OLS of per-problem pass@k on the breakdown indicators (skipped when there are too few problems)."""
    if not features or per_problem.empty:
        return {}
    tables = {}
    for model, part in per_problem.groupby("model", sort=False):
        part = part.assign(outcome=pass_at_k_per_problem(part["num_samples"], part["num_correct"], k))
        try:
            tables[model] = feature_regression(part, "outcome", features)
        except ValueError as error:
            print(f"prorl-trl eval: regression for {model} skipped: {error}")
        except ImportError:
            print("prorl-trl eval: regression table skipped: it needs scipy (pip install -e '.[plots]').")
            return {}
    return tables


def _print_summary(passk, ks: Sequence[int], throughput: dict[str, dict[str, Any]]) -> None:
    overall = passk[passk["group_by"] == OVERALL]
    for model, part in overall.groupby("model", sort=False):
        values = "  ".join(f"pass@{int(r.k)}={r.pass_at_k:.3f}" for r in part.itertuples())
        print(f"{model}: {values}")
    for model, stats in throughput.items():
        if stats.get("completions_per_s"):
            print(f"{model}: sampled {stats['completions']} completions in {stats['seconds']:.1f}s "
                  f"({stats['completions_per_s']:.2f} completions/s, {stats['tokens_per_s']:.1f} tokens/s, "
                  f"{stats['backend']})")
