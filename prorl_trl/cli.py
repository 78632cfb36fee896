"""`prorl-trl` (also `python -m prorl_trl`, and `accelerate launch -m prorl_trl ...`).

    prorl-trl train RECIPE [--key.path VALUE ...]     run a recipe (all phases), overrides read by the key's type
                  [--resume [CHECKPOINT] | --overwrite]   continue the run in the output folder / start it again
                  [--allow-other-files]               start it in a folder that holds files it did not write
    prorl-trl validate RECIPE [--key.path VALUE ...]  check a recipe, this machine and local data (exit 0 or 2)
    prorl-trl launch [ACCELERATE OPTIONS] train RECIPE ...   `accelerate launch -m prorl_trl train` with a clean stop
                  (no launcher traceback; exit 75 when interrupted and resumable: `prorl_trl/launch.py`)
    prorl-trl reset OUTPUT_DIR [--to-phase N] [--reason TEXT]   ask the running job to end its phase at the next
                  step, hard-reset and start the next phase (or phase N): `prorl_trl/recipe/reset_request.py`
    prorl-trl ablate GRID [--parallel N]              run the variants of a grid file and tabulate them
    prorl-trl demo [--out DIR]                        offline tiny-model demo
    prorl-trl eval ...                                pass@k evaluation
    prorl-trl distill --teacher T --student S ...     distil a teacher's verified solutions into a student (SFT)

Every option has a `--kebab-case` and a `--snake_case` spelling (as in Hugging Face's argument parser), `--help`
shows every default, and the options of `train`/`validate` may come before or after RECIPE.
Subcommand modules are imported only when their subcommand runs, so `validate` stays fast and a missing optional
module disables only its own subcommand. Exit status: 0 success, 1 failure while running, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import __version__
from .console import each_warning_once
from .data.checks import DataError
from .recipe.schema import RecipeError
from .trainer.output_guard import OutputFolderError

# Subcommands owned by other modules: name -> (module, add-arguments function, run function, help).
PLUGGED_COMMANDS = {
    "demo": ("prorl_trl.demo", "add_demo_arguments", "run_demo", "offline demo: tiny model, synthetic task, report"),
    "eval": ("prorl_trl.evaluation.cli", "add_eval_arguments", "run_eval", "sample, grade and report pass@k"),
    "distill": ("prorl_trl.distill.cli", "add_distill_arguments", "run_distill", "distil a teacher into a tiny model"),
    "convert": ("prorl_trl.recipe.translate", "add_convert_arguments", "run_convert", "open-r1/TRL config to recipe"),
    "reset": ("prorl_trl.recipe.reset_request", "add_reset_arguments", "run_reset",
              "end a running job's phase at its next step, hard-reset, start the next phase"),
}
RECIPE_COMMANDS = ("train", "validate")

OVERRIDES_HELP = (
    "Recipe overrides, anywhere after the subcommand: `--section.key VALUE` or `--section.key=VALUE` "
    "(`--training.learning_rate 1e-6`, `--phases.2.temperature 1.2`, `--peft.target_modules '[q_proj,v_proj]'`). "
    "A value is read as the key's type: a text field gets the text (`--training.save_strategy no` is 'no'), other "
    "fields read it as YAML. A key with no section means `training.` (`--learning_rate 1e-6`)."
)
SPELLING_NOTE = "Every option also accepts its --snake_case spelling."


class BothSpellingsParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose options answer to both `--kebab-case` and `--snake_case` (HF's parser does the
    same), whose help shows one spelling and every default, and which never guesses an abbreviated option."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("epilog", SPELLING_NOTE)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        spelled: list[str] = []
        for name in names:
            if isinstance(name, str) and name.startswith("--"):
                spellings = ["--" + name[2:].replace("_", "-"), "--" + name[2:].replace("-", "_"), name]
            else:
                spellings = [name]
            spelled += [spelling for spelling in spellings if spelling not in spelled]
        action = super().add_argument(*spelled, **kwargs)
        if not hasattr(self, "takes_value"):  # option spelling -> its nargs: whether a value follows (`split_options`)
            self.takes_value: dict[str, Any] = {}
        self.takes_value.update({spelling: action.nargs for spelling in action.option_strings})
        return action


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help with one spelling per option and `(default: X)` after every option whose help does not state it."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        short = [name for name in action.option_strings if not name.startswith("--")]
        shown = ", ".join(short + [next((n for n in action.option_strings if n.startswith("--")), "")]).strip(", ")
        if action.nargs == 0:
            return shown
        return f"{shown} {self._format_args(action, self._get_default_metavar_for_optional(action))}"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and action.default is not argparse.SUPPRESS
            and not action.required
            and "default" not in text.lower()
        ):
            text += f" (default: {_shown(action.default)})".replace("%", "%%")
        return text


def _shown(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, str):
        return default or "''"
    return str(default)


def split_options(tokens: list[str], parser: BothSpellingsParser) -> tuple[list[str], list[str]]:
    """(the subcommand's own options and RECIPE, the recipe overrides) of the tokens after `train`/`validate`.

    Options are recognised wherever they stand (`validate RECIPE --num-processes 3`); every other `--key [VALUE]`
    and any word after RECIPE is an override (`parse_overrides` reports malformed ones). An option whose value is
    optional (`train --resume [CHECKPOINT]`) takes the next word only after RECIPE and only if it is no option.
    """
    takes_value = parser.takes_value
    own, overrides, recipe_seen, index = [], [], False, 0
    while index < len(tokens):
        token = tokens[index]
        name = token.split("=", 1)[0]
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if name in takes_value:
            own.append(token)
            optional = takes_value[name] == "?"
            if optional and (not recipe_seen or following is None or following.startswith("-")):
                following = None
            if takes_value[name] != 0 and "=" not in token and following is not None:
                own.append(following)
                index += 1
        elif token.startswith("--") and len(token) > 2:
            overrides.append(token)
            if "=" not in token and following is not None and not (following.startswith("--") and len(following) > 2):
                overrides.append(following)
                index += 1
        elif not recipe_seen and not token.startswith("-"):
            own.insert(0, token)  # first, so argparse never reads it as the value of an optional-value option
            recipe_seen = True
        else:
            overrides.append(token)
        index += 1
    return own, overrides


def _module_file_exists(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    base = Path(__file__).resolve().parent / relative
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _unavailable(name: str, error: Exception) -> Callable[[Any], int]:
    def handler(args: Any) -> int:
        print(f"error: `prorl-trl {name}` is unavailable in this install: {error}", file=sys.stderr)
        return 1

    return handler


def _add_output_folder_arguments(parser: argparse.ArgumentParser) -> None:
    """`--resume [CHECKPOINT]` and `--overwrite`: what to do with a run already in the output folder (train, and
    validate, which reports what train would do with the same options)."""
    parser.add_argument(
        "--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
        help="continue the run in the output folder from its latest complete checkpoint (from the start if it has "
        "none yet; a finished run is left as it is, unless the recipe gives it more steps or phases: then with "
        "--allow-changes it is extended), or from CHECKPOINT (give it after RECIPE)",
    )  # fmt: skip
    parser.add_argument(
        "--overwrite", action="store_true", help="delete the run outputs already in the output folder, then start"
    )
    parser.add_argument(
        "--allow-other-files", action="store_true",
        help="start the run (or --overwrite it) in a folder that holds files it did not write; they are kept "
        "(--overwrite deletes only what a run recorded in its .prorl_manifest.json). Never allows the filesystem root "
        "or $HOME",
    )  # fmt: skip
    parser.add_argument(
        "--allow-changes", action="store_true",
        help="with --resume: continue even though the recipe changes training against the run's recorded one (the "
        "changes are listed and appended to the run's resume_history.yaml; recipe.yaml keeps the original); on a "
        "finished run, train the steps or phases the recipe adds (its final/ is kept as final-phase<i>-step<N>/)",
    )  # fmt: skip


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = BothSpellingsParser(prog="prorl-trl", description="Prolonged RL (ProRL) on top of TRL.")
    parser.add_argument("--version", action="version", version=f"prorl-trl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=BothSpellingsParser)

    train = commands.add_parser(
        "train", help="run a recipe (all phases)", description="Run a recipe. " + OVERRIDES_HELP
    )
    train.add_argument("recipe", help="recipe YAML file")
    _add_output_folder_arguments(train)
    train.set_defaults(handler=_run_train)

    validate = commands.add_parser(
        "validate",
        help="check a recipe, this machine and local data (no model loaded)",
        description="Check everything `train` would fail on before loading a model: the recipe, local model and "
        "data paths, precision against this machine's GPU, installed extras, the batch arithmetic for the number of "
        "processes, local data files row by row (hub data is checked by `train` before the model loads), and the "
        "output folder (a run already there needs --resume or --overwrite, as for `train`). " + OVERRIDES_HELP,
    )
    validate.add_argument("recipe", help="recipe YAML file")
    _add_output_folder_arguments(validate)
    validate.add_argument(
        "--num-processes", type=int, default=None,
        help="processes the run will use (batch divisibility); default: the launch config's, else 1",
    )  # fmt: skip
    validate.add_argument(
        "--launch-config", default=None, metavar="FILE",
        help="the `accelerate launch --config_file` the run will use (processes, DeepSpeed/FSDP)",
    )  # fmt: skip
    validate.add_argument(
        "--no-machine-checks", action="store_true",
        help="check the recipe alone, not this machine (local paths, GPU vs bf16, installed extras, local data): for "
        "a recipe meant for another machine",
    )  # fmt: skip
    validate.set_defaults(handler=_run_validate)

    launch = commands.add_parser(
        "launch", add_help=False, help="accelerate launch -m prorl_trl train, with a clean stop (exit 75: resumable)"
    )
    launch.set_defaults(handler=_run_launch)  # its words go to `prorl_trl.launch` unparsed (`parse_command_line`)

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
    parser.subcommands = commands.choices  # name -> subparser, for `split_options`
    return parser


def _add_ablate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("grid", help="grid YAML: `base` recipe, shared `overrides`, `variants` (and/or `grid` axes)")
    parser.add_argument("--parallel", type=int, default=1, help="variants run at the same time (processes)")
    parser.add_argument("--out", default=None, help="output folder (default: the grid's `output_dir`)")
    parser.add_argument("--force", action="store_true", help="re-run variants that already finished")
    parser.add_argument(
        "--allow-other-files", action="store_true",
        help="write the ablation into a folder that holds files it did not write; they are kept (never a folder "
        "holding a training run or files named like the ablation's outputs, nor the filesystem root or $HOME)",
    )  # fmt: skip
    parser.add_argument("--only", nargs="+", default=None, help="run only these variant names (default: all)")
    parser.add_argument("--validate-only", action="store_true", help="validate every variant, run nothing")
    parser.add_argument(
        "--no-machine-checks", action="store_true",
        help="with --validate-only: check the recipes alone, not this machine (a grid meant for another machine)",
    )  # fmt: skip
    parser.add_argument(
        "--launcher",
        default=None,
        help="command that runs one variant before `-m prorl_trl train` (default: this Python; e.g. "
        "'accelerate launch --config_file recipes/accelerate/single_gpu.yaml')",
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated GPU ids; each variant runs on a free one (CUDA_VISIBLE_DEVICES) (default: all visible)",
    )
    parser.add_argument("--metric", default=None, help="validation metric for the table (default: auto-detected)")
    parser.set_defaults(handler=_run_ablate)


def _run_validate(args: argparse.Namespace) -> int:
    from .data.fingerprint import split_fingerprints
    from .recipe.changes import resume_changes
    from .recipe.checks import other_machine_hint
    from .recipe.extend import extended_plan
    from .recipe.output_folder import plan_start, run_writes
    from .recipe.preflight import Launch, check_everything, read_launch_config
    from .recipe.run import describe_recipe

    launch = read_launch_config(args.launch_config) if args.launch_config else None
    world_size = args.num_processes or (launch.num_processes if launch else None) or 1
    machine = not args.no_machine_checks
    recipe, problems, skipped = check_everything(  # every stage that can run, in one pass
        args.recipe, args.overrides, world_size=world_size, machine=machine, launch=launch or Launch(world_size)
    )
    if problems:
        again = shlex.join(["prorl-trl", "validate", args.recipe, *args.overrides, "--no-machine-checks"])
        raise RecipeError(args.recipe, problems, notes=skipped, hints=other_machine_hint(problems, again))
    for warning in recipe.warnings:
        print(f"note: {warning}", file=sys.stderr)
    plan = plan_start(  # a used folder, other files, root or $HOME: exit 2, as train
        recipe.output_dir, args.resume, args.overwrite, allow_other_files=args.allow_other_files,
        writes=run_writes(recipe),
    )  # fmt: skip
    data_now = split_fingerprints(recipe.data) if plan.resume or plan.finished else None  # only a resume compares them
    plan, _ = extended_plan(plan, recipe, args.allow_changes, data_now)  # as train: a finished run extended
    for change in resume_changes(plan.resume, recipe.output_dir, recipe.raw, args.allow_changes, data_now):  # as train
        print(f"note: resuming changes {change.describe()}", file=sys.stderr)
    if plan.note or plan.finished or plan.overwrite:
        will = "the run is finished: `train --resume` says so and changes nothing" if plan.finished else (
            f"`train --overwrite` would delete the outputs of {plan.state.describe()}" if plan.overwrite else plan.note
        )
        print(f"note: {will}", file=sys.stderr)
    print(describe_recipe(recipe, world_size=world_size))
    checked = "recipe only (--no-machine-checks)" if not machine else "recipe, this machine and local data"
    print(f"ok: {args.recipe} is valid for {world_size} process(es); checked: {checked} "
          f"(training would write to {recipe.output_dir}/)")  # fmt: skip
    return 0


def _run_train(args: argparse.Namespace) -> int:
    from .recipe.run import run_train

    return run_train(
        args.recipe, args.overrides, resume=args.resume, overwrite=args.overwrite, allow_changes=args.allow_changes,
        allow_other_files=args.allow_other_files,
    )  # fmt: skip


def _run_launch(args: argparse.Namespace) -> int:
    from .launch import run_launch

    def recipe_of(words: list[str]) -> str | None:
        own, _ = split_options(words, build_parser(["train"]).subcommands["train"])
        return own[0] if own and not own[0].startswith("-") else None

    return run_launch(args.launch_tokens, recipe_of)


def _run_ablate(args: argparse.Namespace) -> int:
    from .recipe.ablate import run_ablate

    return run_ablate(args)


def parse_command_line(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed arguments; `train`/`validate` get their recipe overrides as `args.overrides`."""
    parser = build_parser(argv)
    position = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
    command = argv[position] if position is not None else None
    if command == "launch":  # accelerate's options, then `train ...`: read by `prorl_trl.launch`
        args = parser.parse_args(argv[: position + 1])
        args.launch_tokens = argv[position + 1 :]
        return parser, args
    if command not in RECIPE_COMMANDS:
        return parser, parser.parse_args(argv)
    own, overrides = split_options(argv[position + 1 :], parser.subcommands[command])
    args = parser.parse_args(argv[: position + 1] + own)
    args.overrides = overrides
    return parser, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, args = parse_command_line(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        with each_warning_once():
            return int(args.handler(args) or 0)
    except (RecipeError, DataError, OutputFolderError) as error:
        print(f"error: {error.render()}", file=sys.stderr)
        return 2
    except Exception as error:
        status = getattr(error, "exit_status", None)  # a run that stopped on purpose, with its reason (no traceback)
        if status is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return int(status)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
