"""Evaluation: unbiased pass@k with bootstrap intervals, sampling, grading with the reward registry, reports, plots.

Light names are imported eagerly; the pipeline (`evaluate`) and `ValidationCallback` load transformers on demand.
"""

from .passk import bootstrap_interval, pass_at_k, pass_at_k_curve, pass_at_k_per_problem
from .sampling import SamplingSettings

__all__ = [
    "SamplingSettings",
    "ValidationCallback",
    "bootstrap_interval",
    "evaluate",
    "pass_at_k",
    "pass_at_k_curve",
    "pass_at_k_per_problem",
]


def __getattr__(name: str):
    if name == "ValidationCallback":
        from .validation import ValidationCallback

        return ValidationCallback
    if name == "evaluate":
        from .evaluate import evaluate

        return evaluate
    raise AttributeError(f"module 'prorl_trl.evaluation' has no attribute {name!r}")
