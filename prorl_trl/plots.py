"""Training-curve plots from a (multi-phase) log history, with phase boundaries marked.

A ProRL run's interesting events are at phase boundaries (a hard reset, a new temperature or context cap), so every
figure draws them as vertical lines. The input is a plain list of log dicts (`trainer.state.log_history`, or the
accumulated history of a `ProRLTrainer` across phases), so the demo, the GPU benchmark and `prorl-trl train` share
one function. matplotlib is an optional dependency (`pip install -e '.[plots]'`) and is imported only here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

STEP_KEYS = ("prorl/global_step", "step")
# One figure per entry: file stem, title, y label, the log keys drawn (label -> key; the first key present wins).
FIGURES: tuple[tuple[str, str, str, dict[str, tuple[str, ...]]], ...] = (
    ("reward", "Training reward", "reward", {"reward": ("reward",)}),
    (
        "completion_length",
        "Completion length",
        "tokens",
        {
            "max": ("completions/max_length",),
            "mean": ("completions/mean_length",),
            "min": ("completions/min_length",),
        },
    ),
    ("entropy", "Policy entropy", "nats / token", {"entropy": ("entropy",)}),
    ("kl", "KL to the reference policy", "KL", {"kl": ("kl",)}),
    (
        "truncated",
        "Truncated completions (completions/clipped_ratio)",
        "fraction cut at max_completion_length",
        {"truncated": ("completions/clipped_ratio",)},
    ),
    (  # the fraction of tokens whose importance ratio PPO's clip cut; 0 while every step is on-policy
        "clip_ratio",
        "PPO clip fraction (clip_ratio/*)",
        "fraction of tokens",
        {
            "low or high (region_mean)": ("clip_ratio/region_mean", "clip_ratio"),
            "low (low_mean)": ("clip_ratio/low_mean",),
            "high (high_mean)": ("clip_ratio/high_mean",),
        },
    ),
)


def _matplotlib():
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Plots need matplotlib: `pip install -e '.[plots]'` (or `pip install matplotlib`)."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_of(entry: dict[str, Any]) -> float | None:
    """The run-wide step of a log entry: `prorl/global_step` (continuous across phases) or TRL's `step`."""
    for key in STEP_KEYS:
        if entry.get(key) is not None:
            return float(entry[key])
    return None


def phase_boundaries(history: Iterable[dict[str, Any]], phase_key: str = "prorl/phase") -> list[float]:
    """Steps at which `phase_key` changes: the last step logged in the ending phase (where a hard reset happens)."""
    boundaries, previous, last_step = [], None, None
    for entry in history:
        phase, step = entry.get(phase_key), step_of(entry)
        if phase is None or step is None:
            continue
        if previous is not None and phase != previous:
            boundaries.append(last_step)
        previous, last_step = phase, step
    return boundaries


def on_demand_resets(history: Iterable[dict[str, Any]], key: str = "prorl/reset_on_demand") -> list[float]:
    """Steps where a phase was ended on demand (`prorl-trl reset`): their entry carries `key`."""
    return [step for entry in history if entry.get(key) is not None and (step := step_of(entry)) is not None]


def series(history: Iterable[dict[str, Any]], keys: Sequence[str]) -> tuple[list[float], list[float]]:
    """(steps, values) of the first key in `keys` each entry has; entries without a step or value are skipped."""
    steps, values = [], []
    for entry in history:
        step = step_of(entry)
        value = next((entry[key] for key in keys if entry.get(key) is not None), None)
        if step is not None and value is not None:
            steps.append(step)
            values.append(float(value))
    return steps, values


def _mark_boundaries(axis, boundaries: Sequence[float], on_demand: Sequence[float] = ()) -> None:
    """Phase boundaries as grey dashed lines; those a reset on demand made in red, labelled so."""
    planned = [step for step in boundaries if step not in on_demand]
    for index, step in enumerate(planned):
        axis.axvline(step, color="grey", linestyle="--", linewidth=1, label="phase boundary" if index == 0 else None)
    for index, step in enumerate(on_demand):
        axis.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="reset on demand" if index == 0 else None)


def plot_training_curves(
    history: Sequence[dict[str, Any]],
    out_dir: str | Path,
    validation: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    boundaries: Sequence[float] | None = None,
    prefix: str = "",
) -> list[Path]:
    """Write one PNG per metric found in `history` (and `validation.png`) to `out_dir`; return their paths.

    Args:
        history: log dicts in step order, e.g. `trainer.state.log_history` or a ProRL run's accumulated history.
        out_dir: folder for the PNGs (created).
        validation: optional curves `label -> (steps, accuracies)`, e.g. validation pass@1 of one or more runs.
        boundaries: steps to mark as phase boundaries; default: where `prorl/phase` changes in `history`.
        prefix: prepended to every file name (several runs in one folder).
    """
    plt = _matplotlib()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    boundaries = phase_boundaries(history) if boundaries is None else list(boundaries)
    on_demand = on_demand_resets(history)
    written = []
    if validation:
        figure, axis = plt.subplots(figsize=(6, 4))
        for label, (steps, values) in validation.items():
            axis.plot(steps, values, marker="o", label=label)
        _finish(axis, boundaries, "Validation accuracy", "accuracy", on_demand)
        written.append(_save(plt, figure, out_dir / f"{prefix}validation.png"))
    for stem, title, ylabel, curves in FIGURES:
        drawn = {label: series(history, keys) for label, keys in curves.items()}
        drawn = {label: points for label, points in drawn.items() if points[0]}
        if not drawn:
            continue
        figure, axis = plt.subplots(figsize=(6, 4))
        for label, (steps, values) in drawn.items():
            axis.plot(steps, values, label=label)
        _finish(axis, boundaries, title, ylabel, on_demand)
        written.append(_save(plt, figure, out_dir / f"{prefix}{stem}.png"))
    return written


def _finish(axis, boundaries: Sequence[float], title: str, ylabel: str, on_demand: Sequence[float] = ()) -> None:
    _mark_boundaries(axis, boundaries, on_demand)
    axis.set_title(title)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
