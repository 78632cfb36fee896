"""PNG plots of an evaluation: pass@k curves (all models per chart) and per-model pass@1 histograms."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from .report import OVERALL


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out_dir: str | Path, name: str) -> Path:
    fig.tight_layout()
    path = Path(out_dir) / "plots" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _curves(ax, part: pd.DataFrame, title: str) -> None:
    for model, curve in part.groupby("model", sort=False):
        curve = curve.sort_values("k")
        ax.plot(curve["k"], curve["pass_at_k"], marker="o", label=model)
        ax.fill_between(curve["k"], curve["ci_low"], curve["ci_high"], alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_passk(passk: pd.DataFrame, out_dir: str | Path, group_by: str = OVERALL, scope: str | None = None) -> Path:
    """pass@k against k (log2 axis) with bootstrap bands; one panel per group of `group_by`, every model in each.

    `scope` names the problems when they are a subset (e.g. "problems base never solved"); None: all problems.
    """
    plt = _pyplot()
    return _save(plt, passk_figure(passk, group_by, scope), out_dir, f"pass_at_k_{group_by}.png")


def passk_figure(passk: pd.DataFrame, group_by: str = OVERALL, scope: str | None = None) -> Any:
    """The figure `plot_passk` saves (apart so its panels and legends can be inspected)."""
    plt = _pyplot()
    part = passk[passk["group_by"] == group_by]
    groups = list(dict.fromkeys(part["group"]))
    columns = min(4, len(groups))
    rows = math.ceil(len(groups) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for ax, group in zip(axes.flat, groups):
        rows_of_group = part[part["group"] == group]
        problems = int(rows_of_group["num_problems"].iloc[0])
        if group_by != OVERALL:
            title = f"{group_by} = {group} ({problems})"
        else:
            title = "all problems" if scope is None else f"{scope} ({problems})"
        _curves(ax, rows_of_group, title)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    if scope is not None and group_by != OVERALL:
        fig.suptitle(scope)
    return fig


def plot_pass1_histogram(per_problem: pd.DataFrame, model: str, out_dir: str | Path) -> Path:
    """How per-problem pass@1 (= c/n) is distributed for one model: the all-wrong and all-right ends matter most."""
    plt = _pyplot()
    part = per_problem[per_problem["model"] == model]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.hist(part["num_correct"] / part["num_samples"], bins=[i / 20 for i in range(21)], edgecolor="black")
    ax.set_xlabel("per-problem pass@1 (correct / n)")
    ax.set_ylabel("problems")
    ax.set_title(f"{model}: pass@1 over {len(part)} problems")
    return _save(plt, fig, out_dir, f"pass_at_1_hist_{model}.png")
