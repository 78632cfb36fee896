"""What a long run prints: each warning once, banners never cut, and progress with rate and ETA.

Nothing heavy is imported here (the `prorl-trl` command imports this module); `prorl_trl.trainer.progress` holds
the training progress callback.

* `each_warning_once()`: Python shows a warning once per code location, but any `warnings.catch_warnings` or
  filter change (TRL and accelerate enter them every step) resets that memory, so a deprecation from TRL's
  generation context printed at every save and validation (14 times in an 8-step run). Inside this context a
  warning with the same category and text is shown once.
* `quiet_console()`: the above for a training run, plus no `transformers` progress bars inside it.
* `loading_models()`: one line for the models a trainer loads, instead of transformers' "Loading weights" bar per
  load (TRL loads the reference as a second copy of the same files, so a full fine-tuning run showed two bars).
* `announce()`: rich's `Console` crops at 80 columns when it does not write to a terminal, which cut the phase
  banner (temperature, top_p, LoRA) in log files; here long lines are printed whole.
* `duration`, `eta_text`, `metrics_line`: the pieces of a progress line.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

# Metrics a progress line shows when a log has them, in this order (reward columns are added as they appear).
PROGRESS_METRICS = (
    "loss", "reward", "reward_std", "kl", "entropy", "completions/mean_length", "completions/clipped_ratio",
    "prorl/dropped_groups", "eval_pass@1", "eval_reward", "eval_loss", "learning_rate",
)  # fmt: skip
# `truncated`: the fraction of completions cut at max_completion_length (TRL logs it as `completions/clipped_ratio`;
# not the PPO clip fraction, `clip_ratio/*`, which the plots call "PPO clip fraction").
SHORT_NAMES = {"completions/mean_length": "length", "completions/clipped_ratio": "truncated", "learning_rate": "lr"}


@contextlib.contextmanager
def each_warning_once() -> Iterator[None]:
    """Show every distinct warning (category + text) once while inside, however often it is raised, and none of
    `LIBRARY_NOISE`."""
    with warnings.catch_warnings():
        for category, message in LIBRARY_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
        with _once():
            yield


# Warnings the libraries we extend raise about their own calls, which no setting of a recipe changes: transformers
# 5's rename of gradient checkpointing to activation checkpointing (TRL 1.16 and PEFT call the old names, at every
# start and reset), and the DataLoader's pin_memory on a machine without an accelerator.
LIBRARY_NOISE = (
    (FutureWarning, r"`(is_)?gradient_checkpointing\w*` is deprecated"),
    (UserWarning, r"'pin_memory' argument is set as true but no accelerator is found"),
)


@contextlib.contextmanager
def _once() -> Iterator[None]:
    shown: set[tuple[type, str]] = set()
    previous = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in shown:
            shown.add(key)
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once
    try:
        yield
    finally:
        if warnings.showwarning is show_once:
            warnings.showwarning = previous


@contextlib.contextmanager
def quiet_console() -> Iterator[None]:
    """For the length of a training run: each warning once, and no `transformers` progress bars (a "Writing model
    shards" bar at every checkpoint and merged save); the run's own progress is `RunProgress`."""
    with without_transformers_bars(), each_warning_once():
        yield


@contextlib.contextmanager
def without_transformers_bars() -> Iterator[None]:
    """`transformers`' progress bars off inside, back as they were after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def loading_models(what: str, show: bool = True) -> Iterator[None]:
    """`loading <what> ...` then `loaded in 3s`, with `transformers`' per-load progress bars off in between."""
    import sys
    import time

    started = time.monotonic()
    if show:
        print(f"loading {what} ...", file=sys.stderr, flush=True)
    with without_transformers_bars():
        yield
    if show:
        print(f"loaded in {duration(time.monotonic() - started)}", file=sys.stderr, flush=True)


def announce(message: str, rule: bool = False) -> None:
    """A banner on stderr: bold on a terminal, whole on one line everywhere (never cropped to 80 columns)."""
    from rich.console import Console
    from rich.text import Text

    console = Console(stderr=True, soft_wrap=True)
    if rule:
        console.rule(style="dim")
    console.print(Text(message, style="bold"))


def duration(seconds: float) -> str:
    """`75` -> `1m15s`; `4000` -> `1h06m`."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_text(done: int, total: int, elapsed: float) -> str:
    """`3/10 done in 1m00s, 20.0 s each, ETA 2m20s` (rate and remaining time from the mean so far)."""
    each = elapsed / done if done else float("nan")
    return f"{done}/{total} done in {duration(elapsed)}, {each:.1f} s each, ETA {duration(each * (total - done))}"


def metrics_line(logs: dict[str, Any]) -> str:
    """The main metrics of one log entry, short: `reward 0.31, boxed_answer 0.31, kl 0.0021, length 7.5`."""
    keys = [key for key in PROGRESS_METRICS if key in logs]
    rewards = sorted(key for key in logs if key.startswith("rewards/") and key.endswith("/mean"))
    at = keys.index("reward") + 1 if "reward" in keys else len(keys)
    keys[at:at] = rewards
    parts = []
    for key in keys:
        value = logs[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name = key[len("rewards/") : -len("/mean")] if key in rewards else SHORT_NAMES.get(key, key)
            parts.append(f"{name} {value:.4g}")
    return ", ".join(parts)
