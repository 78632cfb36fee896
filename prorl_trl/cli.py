"""`prorl-trl` (also `python -m prorl_trl`, and `accelerate launch -m prorl_trl ...`).

    prorl-trl train RECIPE [--key.path VALUE ...]     run a recipe (all phases), overrides as YAML scalars
    prorl-trl validate RECIPE [--key.path VALUE ...]  check a recipe without loading a model or data (exit 0 or 2)
    prorl-trl ablate GRID [--parallel N]              run the variants of a grid file and tabulate them
    prorl-trl demo [--out DIR]                        offline tiny-model demo
    prorl-trl eval ...                                pass@k evaluation
    prorl-trl distill --teacher T --student S ...     distil a teacher's verified solutions into a student (SFT)

Subcommand modules are imported only when their subcommand runs, so `validate` stays fast and a missing optional
module disables only its own subcommand. Exit status: 0 success, 1 failure while running, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import __version__
from .recipe.schema import RecipeError

# Subcommands owned by other modules: name -> (module, add-arguments function, run function, help).
PLUGGED_COMMANDS = {
    "demo": ("prorl_trl.demo", "add_demo_arguments", "run_demo", "offline demo: tiny model, synthetic task, report"),
    "eval": ("prorl_trl.evaluation.cli", "add_eval_arguments", "run_eval", "sample, grade and report pass@k"),
    "distill": ("prorl_trl.distill.cli", "add_distill_arguments", "run_distill", "distil a teacher into a tiny model"),
}

OVERRIDES_HELP = (
    "Recipe overrides, after RECIPE: `--section.key VALUE` or `--section.key=VALUE`, values read as YAML "
    "(`--training.learning_rate 1e-6`, `--phases.2.temperature 1.2`, `--peft.target_modules '[q_proj,v_proj]'`). "
    "A key with no section means `training.` (`--learning_rate 1e-6`)."
)


def _module_file_exists(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    base = Path(__file__).resolve().parent / relative
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _unavailable(name: str, error: Exception) -> Callable[[Any], int]:
    def handler(args: Any) -> int:
        print(f"error: `prorl-trl {name}` is unavailable in this install: {error}", file=sys.stderr)
        return 1

    return handler


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prorl-trl", description="Prolonged RL (ProRL) on top of TRL.")
    parser.add_argument("--version", action="version", version=f"prorl-trl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train", help="run a recipe (all phases)", description="Run a recipe. " + OVERRIDES_HELP
    )
    train.add_argument("recipe", help="recipe YAML file")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    train.set_defaults(handler=_run_train)

    validate = commands.add_parser(
        "validate", help="check a recipe (no model or data loaded)", description="Check a recipe. " + OVERRIDES_HELP
    )
    validate.add_argument(
        "--num-processes", type=int, default=None, help="processes the run will use (batch divisibility); default 1"
    )
    validate.add_argument("recipe", help="recipe YAML file")
    validate.add_argument("overrides", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    validate.set_defaults(handler=_run_validate)

    ablate = commands.add_parser("ablate", help="run a grid of recipe variants and tabulate them")
    _add_ablate_arguments(ablate)

    selected = next((token for token in argv if not token.startswith("-")), None)
    for name, (module, add_arguments, run, help_text) in PLUGGED_COMMANDS.items():
        if not _module_file_exists(module):
            continue
        sub = commands.add_parser(name, help=help_text)
        if name != selected:
            continue
        try:
            loaded = importlib.import_module(module)
            getattr(loaded, add_arguments)(sub)
            sub.set_defaults(handler=getattr(loaded, run))
        except (ImportError, AttributeError) as error:
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            sub.set_defaults(handler=_unavailable(name, error))
    return parser


def _add_ablate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("grid", help="grid YAML: `base` recipe, shared `overrides`, `variants` (and/or `grid` axes)")
    parser.add_argument("--parallel", type=int, default=1, help="variants run at the same time (processes)")
    parser.add_argument("--out", default=None, help="output folder (default: the grid's `output_dir`)")
    parser.add_argument("--force", action="store_true", help="re-run variants that already finished")
    parser.add_argument("--only", nargs="+", default=None, help="run only these variant names")
    parser.add_argument("--validate-only", action="store_true", help="validate every variant, run nothing")
    parser.add_argument(
        "--launcher",
        default=None,
        help="command that runs one variant before `-m prorl_trl train` (default: this Python; e.g. "
        "'accelerate launch --config_file recipes/accelerate/single_gpu.yaml')",
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated GPU ids; parallel slot i gets CUDA_VISIBLE_DEVICES=ids[i %% n]",
    )
    parser.add_argument("--metric", default=None, help="validation metric for the table (default: auto-detected)")
    parser.set_defaults(handler=_run_ablate)


def _run_validate(args: argparse.Namespace) -> int:
    from .recipe.load import load_recipe
    from .recipe.run import describe_recipe

    recipe = load_recipe(args.recipe, args.overrides, world_size=args.num_processes, dry=True)
    for warning in recipe.warnings:
        print(f"note: {warning}", file=sys.stderr)
    print(describe_recipe(recipe, world_size=args.num_processes or 1))
    print(f"ok: {args.recipe} is valid (training would write to {recipe.output_dir}/)")
    return 0


def _run_train(args: argparse.Namespace) -> int:
    from .recipe.run import run_train

    return run_train(args.recipe, args.overrides)


def _run_ablate(args: argparse.Namespace) -> int:
    from .recipe.ablate import run_ablate

    return run_ablate(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    if any(token in ("-h", "--help") for token in getattr(args, "overrides", None) or []):
        parser.parse_args([args.command, "--help"])  # `train RECIPE --help`: the subcommand's help, exit 0
    try:
        return int(args.handler(args) or 0)
    except RecipeError as error:
        print(f"error: {error.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
