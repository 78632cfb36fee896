"""The preflight: what `train` would fail on that the recipe text alone cannot tell, checked before any model loads.

`load_recipe` checks the recipe itself (keys, types, ranges, phases, batch arithmetic; with `dry=False` also the
precision switches against this machine). The preflight adds the world outside the file, so `prorl-trl validate`
says ok only when `train` would start:

* local paths: model and tokenizer folders (a file is not a model), data files, the distillation teacher, and an
  `output_dir` that can be created (not a file, not under one, writable); hub ids are allowed and reported as not
  checked (nothing here uses the network);
* extras the recipe or launch needs (vLLM, bitsandbytes, DeepSpeed, Liger, flash-attn), with the install command;
* the launch: engines a hard reset cannot run under (FSDP1, offload, ...), compiled generation under ZeRO-3/FSDP2,
  and the trainer's own pre-init checks
  (`prorl_trl.trainer.checks.check_before_init`) for the number of processes;
* data (`validate` only; `train` runs the same checks while it builds its datasets): local files row by row, the
  built splits (with the run's tokenizer, so a file whose prompts are all over `data.max_prompt_tokens` is refused
  as `train` refuses it), and whether the rewards can read the golds (`prorl_trl.data.checks`).

`train` runs it first (`require_valid`: data excepted unless something else is wrong); `validate` runs all of it, on
as much of a recipe with problems as passed its own checks (`check_everything`: one pass, one list). The trackers'
installation and W&B's credentials are checked by `trackers.check_recipe_trackers` (see `SEAM` below); the output
folder's state by `train` itself (`output_folder`), and `validate` notes it.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checks import key_path_of, other_machine_hint
from .recipe import Recipe
from .schema import ModelSection, RecipeProblem
from .trackers import check_recipe_trackers

# Optional packages: import name -> how to install it.
EXTRAS = {
    "vllm": "pip install -e '.[vllm]' (in the prorl-trl clone)",
    "bitsandbytes": "pip install -e '.[quant]' (in the prorl-trl clone)",
    "deepspeed": "pip install deepspeed",
    "liger_kernel": "pip install liger-kernel",
    "flash_attn": "pip install flash-attn --no-build-isolation",
}
MODEL_FILES = ("config.json", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Checks of other concerns, each `(recipe) -> list[RecipeProblem]`: trackers installed (`trackers.py`). The output
# folder's state is checked by `train` itself (`output_folder.plan_start`: it depends on --resume/--overwrite).
SEAM: list[Any] = [check_recipe_trackers]


@dataclass
class Launch:
    """What an `accelerate` launch config tells the preflight (`validate --launch-config FILE`)."""

    num_processes: int = 1
    distributed_type: str = "NO"  # accelerate's DistributedType value: NO, MULTI_GPU, DEEPSPEED, FSDP, ...
    engine: Any = None  # `prorl_trl.reset.Engine`: how the launch holds weights (stage, FSDP version, offload)


def read_launch_config(path: str | Path) -> Launch:
    """`num_processes` and `distributed_type` of an accelerate config file; `RecipeError` if it cannot be read."""
    from ..files import RECIPE_MAX_BYTES, UnreadableFileError, read_yaml
    from .schema import RecipeError

    path = Path(path)
    try:
        raw = read_yaml(path, None, max_bytes=RECIPE_MAX_BYTES)
    except UnreadableFileError as error:
        raise RecipeError(str(path), [RecipeProblem("", f"cannot read the launch config: {error.problem}")]) from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), [RecipeProblem("", "a launch config is a YAML mapping (accelerate config)")])
    processes = raw.get("num_processes") or 1
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise RecipeError(str(path), [RecipeProblem("num_processes", "must be a whole number of processes", processes)])
    from ..reset.engine import engine_of_accelerate_config

    return Launch(processes, str(raw.get("distributed_type") or "NO").upper(), engine_of_accelerate_config(raw))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_local(value: str) -> bool:
    from ..data.builders import is_local_source

    return is_local_source(value)


def preflight(
    recipe: Recipe, world_size: int = 1, machine: bool = True, data: bool = True, launch: Launch | None = None
) -> list[RecipeProblem]:
    """Every problem `train` would meet before its first step, for `world_size` processes. Hub ids are noted in
    `recipe.warnings`. `machine=False` skips what depends on this machine (paths, installed packages, data).

    A recipe with problems of its own (`recipe.broken`, from `check_recipe`) is checked as far as it can be: each
    stage runs on the parts that passed, and what it cannot check is noted in `recipe.skipped`."""
    problems: list[RecipeProblem] = []
    if machine:
        problems += path_problems(recipe)
        problems += extras_problems(recipe, launch)
        if recipe.readable("training.report_to") and recipe.readable("logging.report_to"):
            for check in SEAM:
                problems += check(recipe)
        else:
            recipe.skipped.append("the trackers (`report_to` has a problem)")
    if recipe.broken:
        recipe.skipped.append("the launch (engine, processes, the trainer's pre-init checks): they need a recipe "
                              "without problems")  # fmt: skip
    else:
        problems += launch_problems(recipe, world_size, launch)
    if data and machine:  # data checks read files; a missing one is reported above, once
        problems += data_problems(recipe, {problem.path for problem in problems})
    return problems


def check_everything(
    path: str | Path,
    overrides: list[str] = (),
    world_size: int | None = None,
    machine: bool = True,
    data: bool = True,
    launch: Launch | None = None,
) -> tuple[Recipe | None, list[RecipeProblem], list[str]]:
    """`validate`'s one pass: (the recipe, every problem of the recipe, its files, its data and this machine, the
    checks that could not run and why). The recipe is complete only when there are no problems; a file that cannot
    be read at all (or malformed overrides) raises `RecipeError`, as nothing else can be checked."""
    from .load import read_recipe

    recipe, problems = read_recipe(path, overrides, world_size=world_size, dry=not machine)
    if recipe is None:  # not a recipe at all (a grid file, a flat TRL config): one message
        return None, problems, []
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    problems = problems + preflight(recipe, world_size=world_size, machine=machine, data=data, launch=launch)
    return recipe, problems, recipe.skipped


def require_valid(path: str | Path, overrides: list[str], world_size: int) -> Recipe:
    """`train`'s first step: the recipe, or `RecipeError` with the list `validate` gives, before anything loads.
    Data is checked here only when something else is wrong (the run is refused anyway, and the list is then
    complete); otherwise `train` checks it while building its datasets (hub data too, see `require_readable_golds`)."""
    from .load import read_recipe
    from .schema import RecipeError

    recipe, problems = read_recipe(path, overrides, world_size=world_size, dry=False)
    if recipe is None:
        raise RecipeError(str(path), problems)
    problems += preflight(recipe, world_size=world_size, data=False)
    if problems:
        problems += data_problems(recipe, {problem.path for problem in problems})
        again = shlex.join(["prorl-trl", "validate", str(path), *overrides, "--no-machine-checks"])
        raise RecipeError(str(path), problems, notes=recipe.skipped, hints=other_machine_hint(problems, again))
    return recipe


def require_readable_golds(recipe: Recipe, train_dataset: Any, eval_dataset: Any) -> None:
    """After `train` built its splits (hub data included), before the model loads: raise `DataError` when the rewards
    cannot read the golds (`prorl_trl.data.checks.check_golds_readable`)."""
    from ..data.checks import DataError, check_golds_readable

    problems = []
    for which, rows in (("train", train_dataset), ("validation", eval_dataset)):
        if rows is not None:
            problems += check_golds_readable(rows, reward_functions_for(recipe, which), _where(recipe, which))
    if problems:
        raise DataError(problems)


def path_problems(recipe: Recipe) -> list[RecipeProblem]:
    """Local model/tokenizer folders, data files and the teacher exist and look like what they should be."""
    problems = []
    model = recipe.model
    if model is not None:
        problems += _model_folder("model.name_or_path", model.name_or_path, recipe, MODEL_FILES, "a model")
        tokenizer_key = "model.tokenizer_name_or_path" if model.tokenizer_name_or_path else "model.name_or_path"
        tokenizer = model.tokenizer_name_or_path or model.name_or_path
        if not problems or model.tokenizer_name_or_path:
            problems += _model_folder(tokenizer_key, tokenizer, recipe, TOKENIZER_FILES, "a tokenizer")
    else:
        recipe.skipped.append("the model and tokenizer paths (the `model` section has a problem)")
    for key in ("source", "validation_source"):
        value = getattr(recipe.data, key, None)
        if value and is_local(value) and not Path(value).expanduser().exists():
            problems.append(RecipeProblem(f"data.{key}", _not_found(value), value))
        elif value and not is_local(value):
            recipe.warnings.append(f"data.{key} = {value!r} is a hub dataset id: not checked here (no network use)")
    if recipe.readable("training.output_dir"):
        problems += output_dir_problems(recipe)
    else:
        recipe.skipped.append("the output folder (`training.output_dir` has a problem)")
    if recipe.distill is not None and isinstance(recipe.distill.get("teacher"), str):
        from ..distill.run import check_teacher

        try:
            check_teacher(recipe.distill["teacher"])
        except FileNotFoundError as error:
            problems.append(RecipeProblem("distill.teacher", str(error), recipe.distill["teacher"]))
    return problems


def output_dir_problems(recipe: Recipe) -> list[RecipeProblem]:
    """The run folder can be created and written: `train` makes it only after the model loaded, where a file in the
    way (or a read-only parent) would fail with a traceback."""
    path = Path(recipe.output_dir)
    key, value = "training.output_dir", str(recipe.training.get("output_dir") or path)
    if path.exists() and not path.is_dir():
        return [RecipeProblem(key, "is a file; output_dir is the folder the run writes (checkpoints, final model): "
                                   "give a folder path, or move the file", value)]  # fmt: skip
    absolute = path.absolute()
    existing = next(folder for folder in (absolute, *absolute.parents) if folder.exists())
    if not existing.is_dir():
        return [RecipeProblem(key, f"{existing} is a file, so the run folder cannot be created under it", value)]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [RecipeProblem(key, f"{existing} is not writable by this user: pick a folder you can write", value)]
    return []


def _not_found(value: str) -> str:
    """"Not found", and for a relative path where it was looked for: recipes name paths relative to the folder a
    command runs in (the demo's `./prorl-demo/warm_start` exists only beside the demo's output)."""
    if Path(value).expanduser().is_absolute():
        return "local file or folder not found"
    return (f"local file or folder not found: relative paths are read from the current folder ({Path.cwd()}); run "
            "from the folder they are written for, or override the key with an absolute path")  # fmt: skip


def _model_folder(key: str, value: str, recipe: Recipe, files: tuple[str, ...], what: str) -> list[RecipeProblem]:
    if not is_local(value):
        note = f"{key} = {value!r} is a hub id: not checked here (no network use)"
        if note not in recipe.warnings:
            recipe.warnings.append(note)
        return []
    path = Path(value).expanduser()
    if not path.exists():
        return [RecipeProblem(key, _not_found(value), value)]
    if path.is_file():
        return [RecipeProblem(key, f"is a file; {what} is a folder written by `save_pretrained`, or a hub id", value)]
    if not any((path / name).is_file() for name in files):
        hint = "; set model.tokenizer_name_or_path" if what == "a tokenizer" else ""
        return [RecipeProblem(key, f"the folder holds no {' / '.join(files)}: it is not {what} folder{hint}", value)]
    return []


def extras_problems(recipe: Recipe, launch: Launch | None) -> list[RecipeProblem]:
    """Optional packages the recipe or the launch needs, each with its install command."""
    training, model = recipe.training, recipe.model or ModelSection(name_or_path="")
    needs = []
    if training.get("use_vllm"):
        needs.append(("training.use_vllm", "vllm"))
    if isinstance(recipe.distill, dict) and recipe.distill.get("use_vllm"):
        needs.append(("distill.use_vllm", "vllm"))
    if model.quantization:
        needs.append(("model.quantization", "bitsandbytes"))
    if training.get("use_liger_kernel"):
        needs.append(("training.use_liger_kernel", "liger_kernel"))
    if model.attn_implementation == "flash_attention_2":
        needs.append(("model.attn_implementation", "flash_attn"))
    if training.get("deepspeed") or (launch is not None and launch.distributed_type == "DEEPSPEED"):
        needs.append(("training.deepspeed" if training.get("deepspeed") else "launch config", "deepspeed"))
    return [
        RecipeProblem(key, f"needs `{module}`, which is not installed: {EXTRAS[module]}")
        for key, module in needs
        if not installed(module)
    ]


def launch_problems(recipe: Recipe, world_size: int, launch: Launch | None) -> list[RecipeProblem]:
    """The trainer's pre-init refusals (engines a reset cannot run under, beta to/from 0, ...), before any model loads."""
    from ..reset.engine import engine_of
    from ..trainer.checks import check_before_init, check_launch, check_process_group, resets_possible

    with warnings.catch_warnings():  # the recipe checks reported the warnings about the recipe's own keys
        warnings.simplefilter("ignore")
        args = recipe.training_args(dry=True)
    phases = recipe.resolved_phases or []
    problems = []
    reward_funcs = recipe.reward_functions()
    try:
        check_before_init(args, phases, recipe.model.name_or_path, recipe.peft_config(), reward_funcs, [])
    except ValueError as error:
        problems.append(RecipeProblem(key_path_of(str(error), "training"), str(error)))
    try:
        check_process_group(args)  # under torchrun/accelerate launch (train); validate runs as one process
    except ValueError as error:
        problems.append(RecipeProblem("training.use_cpu", str(error)))
    # The launch config's engine, else what `accelerate launch` exported (what `train` sees).
    engine = launch.engine if launch is not None and launch.engine is not None else engine_of(args)
    try:
        check_launch(args, engine, phases, recipe.model.name_or_path, recipe.peft_config(), [])
    except ValueError as error:  # ResetNotSupportedError included
        problems.append(RecipeProblem("launch config" if launch else "training", str(error)))
    if resets_possible(phases, []) and recipe.model.quantization:
        if args.lora_reset_mode == "merge":
            problems.append(
                RecipeProblem(
                    "training.lora_reset_mode",
                    "hard resets with lora_reset_mode 'merge' are refused on a quantised base (merging re-quantises "
                    "it at every reset; see prorl_trl.reset.support): use `lora_reset_mode: frozen` (the default, "
                    "which never writes the base weights), or load the base unquantised",
                    args.lora_reset_mode,
                )
            )
        elif engine.sharded:
            problems.append(
                RecipeProblem(
                    "model.quantization",
                    f"hard resets on a quantised base run in one process or under DDP, not under {engine.label}: "
                    "launch with recipes/accelerate/single_gpu.yaml or multi_gpu.yaml, or load the base unquantised",
                    recipe.model.quantization,
                )
            )
    return problems


def data_problems(recipe: Recipe, reported: set[str] = frozenset()) -> list[RecipeProblem]:
    """Local data, row by row, then built as `train` builds it (the run's tokenizer filters prompts by length, so a
    file that leaves no rows is refused here too) and probed with the recipe's rewards (hub and generated data are
    checked by `train` while it builds them, before the model loads). `reported`: key paths already reported (a
    missing file is not reported twice). A recipe with problems: rows are read only with a `data` section that passed
    its checks, and built and probed only with rewards (and a `validation` section) that passed theirs."""
    from ..data.builders import local_split_file, scan_split_file, split_source

    if not (recipe.readable("data") and recipe.readable("validation")):
        recipe.skipped.append("the data files' rows (the `data` or `validation` section has a problem)")
        return []
    problems: list[RecipeProblem] = []
    tokenizer: Any = None
    needs_tokenizer = recipe.data.max_prompt_tokens is not None
    can_build = recipe.readable("rewards")
    tokenizer_keys = {"model", "model.name_or_path", "model.tokenizer_name_or_path"}
    tokenizer_broken = not recipe.readable("model") or bool(tokenizer_keys & set(reported))
    for which, key in (("train", "data.source"), ("validation", "data.validation_source")):
        if which == "validation" and not recipe.data.validation_source:
            key = "data.source"  # the validation split is read from the training source
        if split_source(recipe.data, which)[1] is None or key in reported:
            continue
        found = scan_split_file(recipe.data, which)
        try:
            local = local_split_file(recipe.data, which)
        except FileNotFoundError:
            local = None
        if not found and local is not None and not can_build:
            recipe.skipped.append(f"the {which} data built and read by the rewards (`rewards` has a problem)")
        elif not found and local is not None:
            if needs_tokenizer and tokenizer_broken:
                recipe.skipped.append("prompt lengths (data.max_prompt_tokens): the model's tokenizer has a problem")
            elif needs_tokenizer:
                tokenizer = _length_tokenizer(recipe, problems)
            needs_tokenizer = False
            found = built_data_problems(recipe, which, tokenizer)
        problems += _as_recipe_problems(key, found)
    return problems


def _length_tokenizer(recipe: Recipe, problems: list[RecipeProblem]) -> Any:
    """The tokenizer `train` filters prompts with, or None (then lengths are not checked, with a note). A local one
    that fails to load is a problem, as it is for `train`; a hub one is read from the cache only (no network here)."""
    key = "model.tokenizer_name_or_path" if recipe.model.tokenizer_name_or_path else "model.name_or_path"
    name = recipe.model.tokenizer_name_or_path or recipe.model.name_or_path
    try:
        return recipe.load_tokenizer(local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any loading failure becomes a message, never a traceback
        if is_local(name):
            message = f"the tokenizer cannot be loaded: {type(error).__name__}: {error}"
            problems.append(RecipeProblem(key, message, name))
        else:
            recipe.warnings.append(f"prompt lengths (data.max_prompt_tokens) not checked: the tokenizer {name!r} "
                                   f"is not in this machine's hub cache ({type(error).__name__})")  # fmt: skip
        return None


def built_data_problems(recipe: Recipe, which: str, tokenizer: Any = None) -> list[Any]:
    """Build one split (no tokenizer: no length filter) and check the rewards can read its golds; `DataProblem`s."""
    from ..data import build_dataset
    from ..data.checks import DataError, check_golds_readable

    try:
        rows = build_dataset(recipe.data, which, tokenizer, reward_functions_for(recipe, which))
    except DataError as error:
        return error.problems
    if rows is None:
        return []
    return check_golds_readable(rows, reward_functions_for(recipe, which), _where(recipe, which))


def reward_functions_for(recipe: Recipe, which: str) -> list[Any]:
    """The rewards that read a split: all of the recipe's for training, the validation reward for validation."""
    if which == "train" or recipe.validation is None:
        return recipe.reward_functions()
    import rewards

    spec = next(s for s in recipe.rewards if s.name == (recipe.validation.reward or recipe.rewards[0].name))
    return [rewards.get_reward(spec.name, **spec.params)]


def _where(recipe: Recipe, which: str) -> str:
    from ..data.builders import local_split_file, split_source

    local = local_split_file(recipe.data, which)
    source, split, _ = split_source(recipe.data, which)
    return str(local) if local is not None else f"{source or recipe.data.builder} [{split}]"


def _as_recipe_problems(key: str, problems: list[Any]) -> list[RecipeProblem]:
    """`DataProblem`s as recipe problems under the data key that names the file (grouped: a few lines per kind)."""
    from ..data.checks import render_problems

    return [RecipeProblem(key, line) for line in render_problems(problems)]
