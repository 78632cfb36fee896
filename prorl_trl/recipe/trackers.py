"""Is every tracker a recipe reports to (`report_to`) installed? Checked before anything is loaded.

HF builds the tracker callbacks only when the trainer is created, after the model is loaded, and then fails with a
long traceback. `check_trackers` answers the same question from the modules HF's `is_<tracker>_available` looks for
(`importlib.util.find_spec`, no import), so `validate` and `train` can say which package to install.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .schema import RecipeProblem

TRACKERS_EXTRA = "trackers"  # setup.cfg: tensorboard, trackio, wandb, mlflow-skinny
# report_to name -> (modules, any of which HF's callback accepts; what to install; in the `trackers` extra)
TRACKERS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard", True),
    "trackio": (("trackio",), "trackio", True),
    "wandb": (("wandb",), "wandb", True),
    "mlflow": (("mlflow",), "mlflow-skinny", True),
    "comet_ml": (("comet_ml",), "comet-ml", False),
    "clearml": (("clearml",), "clearml", False),
    "dvclive": (("dvclive",), "dvclive", False),
    "neptune": (("neptune",), "neptune", False),
    "swanlab": (("swanlab",), "swanlab", False),
    "codecarbon": (("codecarbon",), "codecarbon", False),
}


def report_to_names(report_to: Any) -> list[str]:
    """`report_to` as a list of tracker names ("none" and "all" name none: HF then picks what is installed)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return [name for name in names if name not in ("none", "all")]


def missing_trackers(report_to: Any) -> list[tuple[str, str, bool]]:
    """(tracker, package to install, whether the `trackers` extra has it) for each named tracker not installed."""
    missing = []
    for name in report_to_names(report_to):
        modules, package, in_extra = TRACKERS.get(name, ((name,), name, False))
        if not any(_installed(module) for module in modules):
            missing.append((name, package, in_extra))
    return missing


def check_trackers(report_to: Any, key_path: str = "logging.report_to") -> list[RecipeProblem]:
    """One problem per tracker that is not installed, naming what to install."""
    problems = []
    for name, package, in_extra in missing_trackers(report_to):
        fix = f"pip install 'prorl-trl[{TRACKERS_EXTRA}]' (or just {package})" if in_extra else f"pip install {package}"
        problems.append(RecipeProblem(key_path, f"reports to `{name}`, which is not installed: {fix}", name))
    return problems


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_recipe_trackers(recipe: Any) -> list[RecipeProblem]:
    """`check_trackers` for a loaded recipe, against the key the recipe set (`logging.` or `training.report_to`)."""
    where = "logging" if "report_to" in (recipe.raw.get("logging") or {}) else "training"
    return check_trackers(recipe.training.get("report_to", "none"), f"{where}.report_to")
