"""The checks behind `load_recipe`: `training` against `ProRLConfig`, `phases` against `PhaseConfig` (both by
introspection, so new fields need no edit here), rewards against the registry, data against the builder table.

Order: cheap structural checks first; only a structurally clean recipe is handed to `ProRLConfig(...)` and
`resolve_phases(...)`, whose own errors are mapped back to a key path.
"""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings
from pathlib import Path
from typing import Any

from .recipe import Recipe
from .schema import (
    SECTIONS,
    TOP_LEVEL_KEYS,
    LoggingSection,
    ModelSection,
    RecipeProblem,
    RewardSpec,
    check_mapping,
    check_section,
    dataclass_hints,
    suggest,
)

LOGGING_KEYS = tuple(f.name for f in dataclasses.fields(LoggingSection))

# Keys that are `ProRLConfig` fields but are set elsewhere in the recipe.
TRAINING_RESERVED = {
    "phases": "`phases` is a top-level section of the recipe, not a `training` key",
    "reward_weights": "set weights under `rewards[i].weight`",
    "model_init_kwargs": "set model loading options in the `model:` section",
    "trust_remote_code": "use `model.trust_remote_code`",
}

# Ranges on the fields people tune most (TRL checks the rest, or the trainer does when the phase starts).
RANGES: dict[str, dict[str, Any]] = {
    "learning_rate": {"min": 0},
    "num_generations": {"min": 2},
    "max_completion_length": {"min": 1},
    "temperature": {"min_exclusive": 0},
    "top_p": {"min_exclusive": 0, "max": 1},
    "top_k": {"min": 0},
    "beta": {"min": 0},
    "epsilon": {"min_exclusive": 0},
    "epsilon_high": {"min_exclusive": 0},
    "per_device_train_batch_size": {"min": 1},
    "per_device_eval_batch_size": {"min": 1},
    "gradient_accumulation_steps": {"min": 1},
    "generation_batch_size": {"min": 1},
    "steps_per_generation": {"min": 1},
    "num_iterations": {"min": 1},
    "max_grad_norm": {"min": 0},
    "weight_decay": {"min": 0},
    "overlong_buffer": {"min": 0},
    "overlong_penalty_factor": {"min": 0},
    "dynamic_sampling_max_rounds": {"min": 0},
    "early_stop_importance_ratio": {"min_exclusive": 0},
    "plateau_patience": {"min": 0},
    "max_steps": {"min": 1},
    "lora_r": {"min": 1},
    "lora_alpha": {"min_exclusive": 0},
}
TRAINING_RANGES = {k: v for k, v in RANGES.items() if k != "max_steps"} | {"max_steps": {"min": -1}}

PHASE_MESSAGE = re.compile(r"phase (\d+)")


def check_recipe(file: str, raw: dict[str, Any], problems: list[RecipeProblem], world_size: int, dry: bool):
    sections = build_sections(raw, problems)
    training = check_training(raw.get("training"), sections.get("logging"), raw.get("logging"), problems)
    phases = check_phases(raw, problems)
    reward_names = check_rewards(sections["rewards"], problems)
    missing_paths = check_local_paths(sections.get("model"), sections.get("data"))
    if not dry:  # `train` needs them now; `validate` only notes them (a demo creates its model folder first)
        problems += missing_paths
    check_data(sections.get("data"), sections.get("validation"), problems)
    check_distill(raw.get("distill"), sections.get("data"), problems)
    if training is not None and sections.get("logging") is not None:
        logging_values = {k: getattr(sections["logging"], k) for k in LOGGING_KEYS if k in (raw.get("logging") or {})}
        training = {**training, **logging_values}
    if problems:
        return None
    validation = sections.get("validation")
    data = sections["data"]
    if validation is not None and validation.enabled and data.validation_split is None:
        from ..data import BUILDERS

        data = dataclasses.replace(data, validation_split=BUILDERS[data.builder].default_validation_split)
    recipe = Recipe(
        file=file,
        raw=raw,
        model=sections["model"],
        peft=sections["peft"],
        data=data,
        rewards=sections["rewards"],
        training=training or {},
        phases=phases,
        validation=validation,
        description=raw.get("description"),
        distill=raw.get("distill"),
    )
    check_validation(validation, recipe.rewards, problems)
    check_assembled(recipe, reward_names, problems, world_size, dry)
    recipe.warnings += [f"{p.path} = {p.value!r}: {p.message} (`train` will stop here)" for p in missing_paths]
    return recipe


def build_sections(raw: dict[str, Any], problems: list[RecipeProblem]) -> dict[str, Any]:
    """Top-level keys and the recipe's own sections (everything except `training`/`phases`/`rewards` semantics)."""
    for key, value in raw.items():
        if key not in TOP_LEVEL_KEYS:
            problems.append(RecipeProblem(str(key), f"unknown section{suggest(key, TOP_LEVEL_KEYS)}", value))
    for required in ("model", "data", "rewards"):
        if raw.get(required) is None:
            problems.append(RecipeProblem(required, "section is required but missing"))
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        value = raw.get(name)
        if value is None:
            sections[name] = None
        elif isinstance(value, str) and name == "model":
            sections[name] = ModelSection(name_or_path=value)  # `model: Qwen/Qwen2-0.5B` shorthand
        else:
            sections[name] = check_section(value, cls, name, problems)
    specs = []
    raw_rewards = raw.get("rewards")
    if raw_rewards is not None and not isinstance(raw_rewards, list):
        problems.append(RecipeProblem("rewards", "expected a list of `{name, weight, params}` entries", raw_rewards))
    elif raw_rewards is not None:
        if not raw_rewards:
            problems.append(RecipeProblem("rewards", "needs at least one reward", raw_rewards))
        for index, entry in enumerate(raw_rewards):
            entry = {"name": entry} if isinstance(entry, str) else entry
            specs.append(check_section(entry, RewardSpec, f"rewards.{index}", problems))
    sections["rewards"] = specs
    return sections


def check_training(raw: Any, logging_section: Any, raw_logging: Any, problems: list[RecipeProblem]):
    from ..config import ProRLConfig

    if raw is None:
        raw = {}
    hints = {k: v for k, v in typing.get_type_hints(ProRLConfig).items() if k in _init_fields(ProRLConfig)}
    before = len(problems)
    training = check_mapping(raw, "training", hints, problems, metadata=TRAINING_RANGES, reserved=TRAINING_RESERVED)
    for key in set(training) & set(raw_logging or {}):
        problems.append(RecipeProblem(f"training.{key}", f"also set as `logging.{key}`; keep one", training[key]))
    buffer, cap = training.get("overlong_buffer"), training.get("max_completion_length", 256)
    if isinstance(buffer, int) and isinstance(cap, int) and buffer and buffer >= cap:
        problems.append(
            RecipeProblem("training.overlong_buffer", f"must be shorter than max_completion_length ({cap})", buffer)
        )
    return training if len(problems) == before else None


def _init_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def check_phases(raw: dict[str, Any], problems: list[RecipeProblem]) -> list[dict[str, Any]] | None:
    from ..config import PhaseConfig

    if "phases" not in raw or raw["phases"] is None:
        return None
    phases = raw["phases"]
    if not isinstance(phases, list):
        problems.append(RecipeProblem("phases", "expected a list of phases (each a mapping with `max_steps`)", phases))
        return None
    if not phases:
        problems.append(RecipeProblem("phases", "is empty: give at least one phase, or remove the key", phases))
        return None
    hints, _, required = dataclass_hints(PhaseConfig)
    checked = []
    for index, phase in enumerate(phases):
        checked.append(check_mapping(phase, f"phases.{index}", hints, problems, required=required, metadata=RANGES))
    return checked


def check_rewards(specs: list[Any], problems: list[RecipeProblem]) -> list[str]:
    """Names must be registered and params accepted; returns the reward functions' `__name__`s."""
    if not specs or any(spec is None for spec in specs):
        return []
    try:
        import rewards
    except ImportError as error:
        problems.append(
            RecipeProblem("rewards", f"the reward registry (`rewards` package) cannot be imported: {error}")
        )
        return []
    available = rewards.available()
    names = []
    for index, spec in enumerate(specs):
        if spec.name not in available:
            problems.append(unknown_name(f"rewards.{index}.name", "reward", spec.name, available))
            continue
        try:
            function = rewards.get_reward(spec.name, **spec.params)
        except Exception as error:  # a bad parameter: say which reward and why
            problems.append(
                RecipeProblem(f"rewards.{index}.params", f"rejected by `{spec.name}`: {error}", spec.params)
            )
            continue
        names.append(getattr(function, "__name__", spec.name))
    return names


def unknown_name(key_path: str, kind: str, name: str, available: typing.Iterable[str]) -> RecipeProblem:
    """A name that is not in a registry: the closest match and the full list, so the fix is one look away."""
    listing = ", ".join(sorted(available))
    return RecipeProblem(key_path, f"unknown {kind}{suggest(name, available)} (available: {listing})", name)


def _looks_local(source: str) -> bool:
    from ..data.builders import is_local_source

    return is_local_source(source)


def check_data(data: Any, validation: Any, problems: list[RecipeProblem]) -> None:
    from ..data import BUILDERS
    from ..data.templates import TEMPLATES

    if data is None:
        return
    spec = BUILDERS.get(data.builder)
    if spec is None:
        problems.append(unknown_name("data.builder", "builder", data.builder, BUILDERS))
        return
    if data.template is not None and data.template not in TEMPLATES:
        problems.append(unknown_name("data.template", "template", data.template, TEMPLATES))
    if data.columns and not spec.needs_columns:
        problems.append(
            RecipeProblem(
                "data.columns",
                f"builder `{data.builder}` has fixed columns; `columns` is for jsonl/parquet",
                data.columns,
            )
        )
    hints = {name: kind for name, (kind, _) in spec.options.items()}
    check_mapping(data.options, "data.options", hints, problems)
    if spec.default_source is None and data.source is None and not data.builder.startswith("synthetic_"):
        problems.append(
            RecipeProblem("data.source", f"builder `{data.builder}` needs a source (hub id or local file)")
        )
    if (
        validation is not None
        and validation.enabled
        and data.validation_split is None
        and spec.default_validation_split is None
    ):
        problems.append(RecipeProblem("data.validation_split", "the `validation` section needs a validation split"))


def check_distill(section: Any, data: Any, problems: list[RecipeProblem]) -> None:
    """The optional `distill:` section (rejection-sampling distillation before the phases), checked by its module."""
    if section is None:
        return
    try:
        from ..distill import check_distill_section
    except ImportError as error:
        problems.append(RecipeProblem("distill", f"needs prorl_trl.distill, which cannot be imported: {error}"))
        return
    for path, message in check_distill_section(section, data=data):
        problems.append(RecipeProblem(path, message))


def check_validation(validation: Any, specs: list[Any], problems: list[RecipeProblem]) -> None:
    if validation is None:
        return
    too_big = [k for k in validation.ks if not 1 <= k <= validation.num_samples]
    if too_big:
        problems.append(
            RecipeProblem(
                "validation.ks", f"each k must be in [1, num_samples={validation.num_samples}]", validation.ks
            )
        )
    names = [spec.name for spec in specs]
    if validation.reward is not None and validation.reward not in names:
        problems.append(
            RecipeProblem(
                "validation.reward",
                f"names no reward of this recipe{suggest(validation.reward, names)} (rewards: {', '.join(names)})",
                validation.reward,
            )
        )


def check_local_paths(model: Any, data: Any) -> list[RecipeProblem]:
    """Local model folders and data files that do not exist (hub ids are not checked: no network here)."""
    missing = []
    keys = [("model", model, "name_or_path"), ("model", model, "tokenizer_name_or_path")]
    keys += [("data", data, "source"), ("data", data, "validation_source")]
    for section, values, key in keys:
        value = getattr(values, key, None) if values is not None else None
        if value and _looks_local(value) and not Path(value).expanduser().exists():
            missing.append(RecipeProblem(f"{section}.{key}", "local file or folder not found", value))
    return missing


def check_assembled(recipe: Any, reward_names: list[str], problems: list[RecipeProblem], world_size: int, dry: bool):
    """Build `ProRLConfig` and resolve the phases exactly as training will, mapping errors back to key paths."""
    from ..config import resolve_phases

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = recipe.training_args(dry=dry)
        except Exception as error:  # TRL/transformers validation: report it against the section
            problems.append(RecipeProblem(_path_of(str(error), "training"), str(error)))
            return
        try:
            peft_config = recipe.peft_config()
        except Exception as error:
            problems.append(RecipeProblem("peft", str(error)))
            return
    # Only warnings about keys the recipe sets (TRL's own defaults trigger some, e.g. gradient_checkpointing).
    recipe.warnings = sorted(
        {str(w.message) for w in caught if any(f"`{key}`" in str(w.message) for key in recipe.training)}
    )
    try:
        recipe.resolved_phases = resolve_phases(args, peft_config, world_size)
    except ValueError as error:
        problems.append(RecipeProblem(_path_of(str(error), "phases" if recipe.phases else "training"), str(error)))
    for index, phase in enumerate(recipe.phases or []):
        weights = phase.get("reward_weights")
        if weights is not None and len(weights) != len(recipe.rewards):
            problems.append(
                RecipeProblem(
                    f"phases.{index}.reward_weights", f"needs {len(recipe.rewards)} weights (one per reward)", weights
                )
            )
    name = recipe.training.get("dynamic_sampling_reward")
    if name is not None and reward_names and name not in reward_names:
        problems.append(
            RecipeProblem(
                "training.dynamic_sampling_reward",
                f"names no reward of this recipe{suggest(name, reward_names)} (rewards: {', '.join(reward_names)})",
                name,
            )
        )


def _path_of(message: str, default: str) -> str:
    match = PHASE_MESSAGE.search(message)
    if match and "ProRLConfig phase" in message:
        return f"phases.{match.group(1)}"
    return "phases" if "`phases`" in message else default
