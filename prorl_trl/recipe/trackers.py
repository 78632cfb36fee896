"""Is every tracker a recipe reports to (`report_to`) installed, and can it log in? Checked before anything loads.

HF builds the tracker callbacks only when the trainer is created, after the model is loaded, and then fails with a
long traceback. `check_trackers` answers the same question from the modules HF's `is_<tracker>_available` looks for
(`importlib.util.find_spec`, no import), so `validate` and `train` can say which package to install.
`check_credentials` does the same for W&B's login: `wandb.init` without a terminal stops the run when it finds no API
key, so its credential sources are read here, as wandb documents them, without importing wandb.
"""

from __future__ import annotations

import configparser
import importlib.util
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

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
        fix = f"pip install -e '.[{TRACKERS_EXTRA}]' (or just {package})" if in_extra else f"pip install {package}"
        problems.append(RecipeProblem(key_path, f"reports to `{name}`, which is not installed: {fix}", name))
    return problems


WANDB_HOST = "https://api.wandb.ai"
WANDB_NO_LOGIN_MODES = ("offline", "dryrun", "disabled")


def _wandb_settings(environ: Mapping[str, str]) -> list[dict[str, str]]:
    """The `[default]` sections of W&B's system settings file (`$WANDB_CONFIG_DIR/settings`, else
    `~/.config/wandb/settings`) and of the workspace's (`./wandb/settings`, under `$WANDB_DIR` when set)."""
    system = Path(environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
    workspace = Path(environ.get("WANDB_DIR") or ".") / "wandb" / "settings"
    sections = []
    for path in (workspace, system):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_section("default"):
            sections.append(dict(parser["default"]))
    return sections


def _netrc_has(host: str, environ: Mapping[str, str]) -> bool:
    """Whether a netrc file (`$NETRC`, else `~/.netrc` or `~/_netrc`) holds a password for `host` (`wandb login`)."""
    paths = [Path(environ["NETRC"])] if environ.get("NETRC") else [Path.home() / ".netrc", Path.home() / "_netrc"]
    for path in paths:
        try:
            entry = netrc.netrc(str(path)).authenticators(host)
        except (netrc.NetrcParseError, OSError):
            continue
        if entry and entry[2]:
            return True
    return False


def wandb_can_log_in(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `wandb.init` would start without asking for a key: an offline/disabled mode, an API key or identity
    token in the environment, an `api_key` in a settings file, or a netrc entry for the W&B host."""
    environ = os.environ if environ is None else environ
    settings = _wandb_settings(environ)
    modes = [environ.get("WANDB_MODE", "")] + [section.get("mode", "") for section in settings]
    if any(mode.strip().lower() in WANDB_NO_LOGIN_MODES for mode in modes):
        return True
    if any(section.get("disabled", "").strip().lower() == "true" for section in settings):  # `wandb disabled`
        return True
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    if any(section.get("api_key") for section in settings):
        return True
    base_url = environ.get("WANDB_BASE_URL") or next((s["base_url"] for s in settings if s.get("base_url")), WANDB_HOST)
    return _netrc_has(urlparse(base_url).hostname or base_url, environ)


def check_credentials(report_to: Any, key_path: str = "logging.report_to") -> list[RecipeProblem]:
    """A problem when an installed W&B (named, or picked by `report_to: all`) has no credentials on this machine."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if not ("wandb" in names or "all" in names) or not _installed("wandb") or wandb_can_log_in():
        return []
    return [
        RecipeProblem(
            key_path,
            "reports to `wandb`, which has no credentials on this machine (no WANDB_API_KEY, no api_key in its "
            "settings, no ~/.netrc entry for its host): `train` would stop at W&B's login after loading the model. "
            "Log in with `wandb login` (or export WANDB_API_KEY), or log offline with WANDB_MODE=offline (upload "
            "later with `wandb sync`), or drop wandb from report_to",
            "wandb",
        )
    ]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_recipe_trackers(recipe: Any) -> list[RecipeProblem]:
    """`check_trackers` for a loaded recipe, against the key the recipe set (`logging.` or `training.report_to`)."""
    where = "logging" if "report_to" in (recipe.raw.get("logging") or {}) else "training"
    report_to = recipe.training.get("report_to", "none")
    return check_trackers(report_to, f"{where}.report_to") + check_credentials(report_to, f"{where}.report_to")
