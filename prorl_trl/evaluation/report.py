"""Aggregation of graded samples into pass@k tables (overall, per breakdown group, always-wrong subset) and files.

Outputs: `summary.json` (everything, machine-readable), `summary.csv` (one row per model x group x k) and
`report.md` (the same tables for people, with the sample counts so an empty group is never read as a 0 score).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .passk import bootstrap_interval, pass_at_k_per_problem

OVERALL = "overall"
PASSK_COLUMNS = ["model", "group_by", "group", "k", "pass_at_k", "ci_low", "ci_high", "num_problems", "mean_reward"]
ALWAYS_WRONG_COLUMNS = ["model", "reference", "k", "num_problems", "expected_solved", "ci_low", "ci_high", "solved_any"]


def per_problem_table(
    records_by_model: dict[str, list[dict[str, Any]]], problems: list[dict[str, Any]], breakdown: Sequence[str] = ()
) -> pd.DataFrame:
    """One row per (model, problem): `num_samples`, `num_correct`, `mean_reward`, `mean_tokens` and breakdown columns."""
    info = {p["problem_id"]: {f: str(p.get(f)) for f in breakdown} for p in problems}
    rows = []
    for model, records in records_by_model.items():
        frame = pd.DataFrame.from_records(records)
        if frame.empty:
            continue
        frame["correct"] = frame["correct"].astype(bool)
        if "num_tokens" not in frame:
            frame["num_tokens"] = float("nan")
        grouped = frame.groupby("problem_id", sort=False)
        stats = grouped.agg(
            num_samples=("correct", "size"),
            num_correct=("correct", "sum"),
            mean_reward=("reward", lambda r: float(np.nanmean(r)) if np.isfinite(r).any() else float("nan")),
            mean_tokens=("num_tokens", "mean"),
        ).reset_index()
        for _, row in stats.iterrows():
            rows.append({"model": model, **row.to_dict(), **info.get(row["problem_id"], {})})
    table = pd.DataFrame(rows)
    if not table.empty:
        table["num_samples"] = table["num_samples"].astype(int)
        table["num_correct"] = table["num_correct"].astype(int)
    return table


def _interval_row(values: np.ndarray, num_resamples: int, confidence: float, seed: int) -> dict[str, float]:
    low, high = bootstrap_interval(values, num_resamples, confidence, seed)
    return {"pass_at_k": float(values.mean()) if values.size else float("nan"), "ci_low": low, "ci_high": high}


def passk_table(
    per_problem: pd.DataFrame,
    ks: Sequence[int],
    breakdown: Sequence[str] = (),
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Mean pass@k with bootstrap intervals for every model, k, and group (`group_by` = "overall" or a field)."""
    rows: list[dict[str, Any]] = []
    if per_problem.empty:  # e.g. the always-wrong reference solved everything
        return pd.DataFrame(rows, columns=PASSK_COLUMNS)
    for model, frame in per_problem.groupby("model", sort=False):
        slices = [(OVERALL, OVERALL, frame)]
        for field_ in breakdown:
            slices += [(field_, str(g), part) for g, part in sorted(frame.groupby(field_), key=lambda x: _natural(x[0]))]
        for group_by, group, part in slices:
            for k in ks:
                values = pass_at_k_per_problem(part["num_samples"], part["num_correct"], k)
                rows.append({
                    "model": model, "group_by": group_by, "group": group, "k": int(k),
                    **_interval_row(values, num_resamples, confidence, seed), "num_problems": int(len(part)),
                    "mean_reward": float(np.nanmean(part["mean_reward"])) if part["mean_reward"].notna().any() else None,
                })
    return pd.DataFrame(rows, columns=PASSK_COLUMNS)


def always_wrong_table(
    per_problem: pd.DataFrame, reference: str, ks: Sequence[int], num_resamples: int = 1000,
    confidence: float = 0.95, seed: int = 0,
) -> tuple[pd.DataFrame, list[str]]:
    """On problems `reference` never solved in its n samples: how many each other model solves at each k.

    `expected_solved` is the sum of unbiased pass@k over those problems (with a bootstrap interval of that sum);
    `solved_any` counts problems with at least one correct sample among all n.
    """
    rows: list[dict[str, Any]] = []
    if per_problem.empty:
        return pd.DataFrame(rows, columns=ALWAYS_WRONG_COLUMNS), []
    ref = per_problem[per_problem["model"] == reference]
    hard = sorted(ref.loc[ref["num_correct"] == 0, "problem_id"].tolist())
    for model, frame in per_problem.groupby("model", sort=False):
        if model == reference:
            continue
        part = frame[frame["problem_id"].isin(hard)]
        for k in ks:
            values = pass_at_k_per_problem(part["num_samples"], part["num_correct"], k)
            low, high = bootstrap_interval(values, num_resamples, confidence, seed)
            rows.append({
                "model": model, "reference": reference, "k": int(k), "num_problems": int(len(part)),
                "expected_solved": float(values.sum()), "ci_low": low * len(part), "ci_high": high * len(part),
                "solved_any": int((part["num_correct"] > 0).sum()),
            })
    return pd.DataFrame(rows, columns=ALWAYS_WRONG_COLUMNS), hard


def _natural(value: Any) -> tuple:
    text = str(value)
    return (0, float(text), text) if _is_number(text) else (1, 0.0, text)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def _passk_markdown(table: pd.DataFrame, ks: Sequence[int], group_by: str) -> str:
    part = table[table["group_by"] == group_by]
    header = ([] if group_by == OVERALL else [group_by]) + ["model", "problems"] + [f"pass@{k}" for k in ks]
    rows = []
    groups = list(dict.fromkeys(part["group"]))
    for group in groups:
        for model in dict.fromkeys(part["model"]):
            cells = part[(part["group"] == group) & (part["model"] == model)].set_index("k")
            if cells.empty:
                continue
            values = [
                f"{_fmt(cells.at[k, 'pass_at_k'])} [{_fmt(cells.at[k, 'ci_low'])}, {_fmt(cells.at[k, 'ci_high'])}]"
                for k in ks
            ]
            rows.append(([] if group_by == OVERALL else [group]) + [model, int(cells["num_problems"].iloc[0])] + values)
    return markdown_table(header, rows)


def write_outputs(
    out_dir: str | Path,
    settings: dict[str, Any],
    passk: pd.DataFrame,
    ks: Sequence[int],
    breakdown: Sequence[str],
    throughput: dict[str, dict[str, Any]],
    always_wrong: pd.DataFrame | None = None,
    always_wrong_problems: list[str] | None = None,
    regressions: dict[str, pd.DataFrame] | None = None,
    plots: Sequence[str] = (),
) -> dict[str, Path]:
    """Write summary.json, summary.csv and report.md; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    confidence = settings.get("confidence", 0.95)
    summary = {
        "settings": settings,
        "throughput": throughput,
        "pass_at_k": passk.to_dict(orient="records"),
        "always_wrong": None if always_wrong is None else {
            "reference": settings.get("always_wrong"), "problems": always_wrong_problems,
            "table": always_wrong.to_dict(orient="records"),
        },
        "regression": {m: t.to_dict(orient="records") for m, t in (regressions or {}).items()},
    }
    paths = {"json": out / "summary.json", "csv": out / "summary.csv", "md": out / "report.md"}
    paths["json"].write_text(json.dumps(_clean(summary), indent=2, default=_json_default, allow_nan=False))
    passk.to_csv(paths["csv"], index=False)

    lines = [f"# Evaluation: {settings.get('dataset')}", ""]
    lines.append(
        f"n = {settings['num_samples']} samples per problem, temperature {settings['temperature']}, top_p "
        f"{settings['top_p']}, max {settings['max_completion_length']} new tokens, reward `{settings['reward']}`. "
        f"Unbiased pass@k (Chen et al. 2021), mean over problems, [{confidence:.0%} bootstrap interval over problems, "
        f"{settings.get('num_resamples')} resamples, seed {settings.get('seed')}]."
    )
    lines += ["", "## pass@k", ""]
    if settings.get("always_wrong") is not None:
        lines += [
            f"Over the {len(always_wrong_problems or [])} problems `{settings['always_wrong']}` never solved "
            f"(`--subset always-wrong:{settings['always_wrong']}`), here and in the breakdowns below.", "",
        ]
    lines += [_passk_markdown(passk, ks, OVERALL), ""]
    for field_ in breakdown:
        lines += [f"## pass@k by {field_}", "", _passk_markdown(passk, ks, field_), ""]
    if always_wrong is not None:
        ref = settings.get("always_wrong")
        lines += [
            f"## Problems `{ref}` never solved ({len(always_wrong_problems or [])} problems)", "",
            f"Expected number of these problems each model solves with k samples (sum of pass@k, with interval), "
            f"and how many it solved at least once in all n samples.", "",
        ]
        awk = sorted(set(always_wrong["k"])) if not always_wrong.empty else []
        rows = []
        for model, part in always_wrong.groupby("model", sort=False):
            part = part.set_index("k")
            rows.append([model, int(part["solved_any"].iloc[0])] + [
                f"{part.at[k, 'expected_solved']:.2f} [{part.at[k, 'ci_low']:.2f}, {part.at[k, 'ci_high']:.2f}]"
                for k in awk
            ])
        lines += [markdown_table(["model", "solved at least once"] + [f"k={k}" for k in awk], rows), ""]
    for model, table in (regressions or {}).items():
        lines += [f"## Regression of per-problem pass@{max(ks)} on problem features: `{model}`", ""]
        lines += [markdown_table(
            ["term", "coef", "std err", "t", "p"],
            [[r.term, _fmt(r.coef), _fmt(r.std_err), _fmt(r.t, 2), _fmt(r.p, 4)] for r in table.itertuples()],
        ), ""]
    lines += ["## Throughput", "", markdown_table(
        ["model", "backend", "new completions", "seconds", "completions/s", "tokens/s"],
        [[m, f"{t.get('backend')} (an earlier run into this folder)" if t.get("earlier_run") else t.get("backend"),
          t.get("completions"), _fmt(t.get("seconds"), 1), _fmt(t.get("completions_per_s"), 2),
          _fmt(t.get("tokens_per_s"), 1)] for m, t in throughput.items()],
    ), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).relative_to(out).as_posix()})" for p in plots] + [""]
    paths["md"].write_text("\n".join(lines))
    return paths


def _clean(value: Any) -> Any:
    """JSON has no NaN: missing numbers become null."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return None if np.isnan(value) else float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
