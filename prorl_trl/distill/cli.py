"""`prorl-trl distill`: one flag per `DistillConfig` field (help from the fields), exit 2 on bad settings or an `--out`
that is not the distillation's to write (checked by `run.distill` first), before any model is loaded."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields
from typing import Any, get_type_hints

from .config import DistillConfig
from .run import check_names, check_teacher, distill


def _mapping(text: str) -> dict[str, Any]:
    import yaml

    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON/YAML mapping such as \'{{"split": "train"}}\', got {text!r}'
        )
    return value


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "y"):
        return True
    if lowered in ("false", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _optional(kind: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_distill_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per `DistillConfig` field (`--out` is short for `--output_dir`); help comes from the fields.
    (`prorl-trl distill` accepts each flag as --kebab-case and --snake_case.)"""
    hints = get_type_hints(DistillConfig)
    for spec in fields(DistillConfig):
        hint, required = str(hints[spec.name]), spec.default is MISSING and spec.default_factory is MISSING
        names = ["--out", "--output_dir"] if spec.name == "output_dir" else [f"--{spec.name}"]
        kwargs: dict[str, Any] = {"dest": spec.name, "help": spec.metadata["help"], "required": required}
        if not required:
            kwargs["default"] = spec.default_factory() if callable(spec.default_factory) else spec.default
        if "dict" in hint:
            kwargs["type"] = _mapping
        elif "bool" in hint:
            kwargs.update(type=_bool, metavar="{true,false}")
        elif "list" in hint:
            kwargs["nargs"] = "+"
        elif "int" in hint:
            kwargs["type"] = _optional(int) if "None" in hint else int
        elif "float" in hint:
            kwargs["type"] = _optional(float) if "None" in hint else float
        parser.add_argument(*names, **kwargs)
    parser.add_argument(  # not a `DistillConfig` field: it decides where the run may write, not what it computes
        "--allow-other-files", dest="allow_other_files", action="store_true",
        help="write into an --out that holds files distill did not write; they are kept (never a folder holding "
        "another command's run or files named like distill's outputs, nor the filesystem root or $HOME)",
    )  # fmt: skip
    return parser


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    values = {spec.name: getattr(args, spec.name) for spec in fields(DistillConfig) if hasattr(args, spec.name)}
    modules = values.get("lora_target_modules")
    if isinstance(modules, list) and len(modules) == 1 and modules[0] == "all-linear":
        values["lora_target_modules"] = "all-linear"
    return DistillConfig(**values)


def run_distill(args: argparse.Namespace) -> int:
    """`prorl-trl distill`: exit 0 on success, 2 on bad settings or output folder (reported before any model is
    loaded)."""
    try:
        config = config_from_args(args)
        if config.student is None:
            raise ValueError("--student is required.")
        check_names(config)
        check_teacher(config.teacher)
    except (ValueError, FileNotFoundError) as error:
        print(f"prorl-trl distill: {error}", file=sys.stderr)
        return 2
    from ..evaluation.runner import SampledWithOtherSettings
    from ..trainer.output_guard import OutputFolderError

    try:
        summary = distill(config, allow_other_files=getattr(args, "allow_other_files", False))
    except OutputFolderError as error:  # checked first thing: nothing loaded or written
        print(f"prorl-trl distill: {error.render()}", file=sys.stderr)
        return 2
    except SampledWithOtherSettings as error:  # refused before any sampling
        print(f"prorl-trl distill: {error}", file=sys.stderr)
        return 2
    from accelerate import PartialState

    if PartialState().is_main_process:
        shown = {key: value for key, value in summary.items() if key not in ("sampling", "settings")}
        print(json.dumps(shown, indent=2))
    return 0
