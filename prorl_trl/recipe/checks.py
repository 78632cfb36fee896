"""The checks behind `load_recipe`: `training` against `ProRLConfig`, `phases` against `PhaseConfig` (both by
introspection, so new fields need no edit here), rewards against the registry, data against the builder table.

Order: cheap structural checks first; only a structurally clean recipe is handed to `ProRLConfig(...)` and
`resolve_phases(...)`, whose own errors are mapped back to a key path.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
import warnings
from typing import Any

from ..data.spec import DataSection
from .recipe import Recipe, passed
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
    non_finite_paths,
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
# Counts get a ceiling: a typo such as `per_device_train_batch_size: 1000000000000000000000000000000` otherwise passes
# every check and ends in an OverflowError deep inside TRL.
LARGEST_COUNT = 2**31 - 1
for _key in ("num_generations", "max_completion_length", "per_device_train_batch_size", "per_device_eval_batch_size",
             "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation", "num_iterations",
             "max_steps", "lora_r"):  # fmt: skip
    RANGES[_key] = {**RANGES[_key], "max": LARGEST_COUNT}
TRAINING_RANGES = {k: v for k, v in RANGES.items() if k != "max_steps"} | {"max_steps": {"min": -1, "max": LARGEST_COUNT}}

# Top-level keys of TRL / open-r1 script configs (`trl grpo --config`) and where they go in a recipe.
FLAT_CONFIG_KEYS = {
    "model_name_or_path": "model.name_or_path",
    "model_revision": "model.revision",
    "torch_dtype": "model.dtype",
    "dtype": "model.dtype",
    "attn_implementation": "model.attn_implementation",
    "load_in_4bit": "model.quantization: 4bit",
    "load_in_8bit": "model.quantization: 8bit",
    "use_peft": "peft (a mapping, or null for full fine-tuning)",
    "lora_r": "peft.r",
    "lora_alpha": "peft.lora_alpha",
    "lora_dropout": "peft.lora_dropout",
    "lora_target_modules": "peft.target_modules",
    "dataset_name": "data.source (with data.builder)",
    "dataset_config": "data.config",
    "dataset_train_split": "data.split",
    "dataset_test_split": "data.validation_split",
    "system_prompt": "data.system_prompt",
    "dataset_prompt_column": "data.columns: {prompt: <column>} (with data.builder: parquet)",
    "max_prompt_length": "data.max_prompt_tokens (drops longer prompts; TRL 1.16 has no max_prompt_length)",
    "reward_funcs": "rewards: [{name: ...}, ...]",
    "reward_weights": "rewards[i].weight",
}
GRID_MARKERS = ("variants", "grid")

PHASE_MESSAGE = re.compile(r"phase (\d+)")


def check_recipe(file: str, raw: dict[str, Any], problems: list[RecipeProblem], world_size: int, dry: bool):
    """Every check of a recipe's content. `dry=False` also checks the precision switches against this machine
    (`bf16` needs a GPU), as `train` must; paths, installed extras and data are the preflight's (`preflight.py`)."""
    whole_file = not_a_recipe(raw)
    if whole_file is not None:  # a grid file or a flat TRL config: one message, not one per key
        problems.append(whole_file)
        return None
    for path in non_finite_paths(raw):
        problems.append(RecipeProblem(path, "must be a finite number (NaN and infinity are refused)", _value_at(raw, path)))
    if raw.get("description") is not None and not isinstance(raw["description"], str):
        problems.append(RecipeProblem("description", "must be text", raw["description"]))
    sections = build_sections(raw, problems)
    training = check_training(raw.get("training"), sections.get("logging"), raw.get("logging"), problems)
    phases = check_phases(raw, problems)
    reward_names = check_rewards(sections["rewards"], problems)
    check_data(sections.get("data"), sections.get("validation"), problems)
    check_distill(raw.get("distill"), sections.get("data"), problems)
    if training is not None and sections.get("logging") is not None:
        logging_values = {k: getattr(sections["logging"], k) for k in LOGGING_KEYS if k in (raw.get("logging") or {})}
        training = {**training, **logging_values}
    if training is not None:
        problems += batch_problems(training, world_size)
        if not dry:
            problems += precision_problems(training)
    if problems:
        return readable_parts(file, raw, sections, problems)
    validation = sections.get("validation")
    data = with_validation_split(sections["data"], validation)
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
    recipe.broken = frozenset(problem.path for problem in problems)
    return recipe


def with_validation_split(data: Any, validation: Any) -> Any:
    """The data section with the builder's validation split where the `validation` section needs one."""
    if validation is not None and validation.enabled and data.validation_split is None:
        from ..data import BUILDERS

        data = dataclasses.replace(data, validation_split=BUILDERS[data.builder].default_validation_split)
    return data


def readable_parts(file: str, raw: dict[str, Any], sections: dict[str, Any], problems: list[RecipeProblem]) -> Recipe:
    """A recipe with problems, kept for the preflight stages that do not depend on them (`validate` lists every
    problem in one pass): each section that passed its checks, the `model`/`data` keys and `training`/`logging` keys
    that passed theirs, and `broken`, the key paths with problems. `load_recipe` never returns one."""
    broken = frozenset(problem.path for problem in problems)

    def fine(path: str) -> bool:
        return passed(path, broken)

    def keys_that_passed(section: str) -> dict[str, Any]:
        value = raw.get(section)
        # a problem with one key (`training.per_device_train_batch_size`) keeps the section's other keys checkable
        whole = isinstance(value, dict) and section not in broken
        return {k: v for k, v in value.items() if fine(f"{section}.{k}")} if whole else {}

    def section(name: str, cls: type) -> Any:
        if sections.get(name) is not None:
            return sections[name]
        try:  # the keys that passed (a required one that did not: nothing to check with)
            return cls(**{k: v for k, v in keys_that_passed(name).items() if k in {f.name for f in dataclasses.fields(cls)}})
        except TypeError:
            return None

    training = keys_that_passed("training") | {k: v for k, v in keys_that_passed("logging").items() if k in LOGGING_KEYS}
    data = section("data", DataSection)
    if data is not None and fine("data") and fine("validation"):
        data = with_validation_split(data, sections.get("validation"))
    return Recipe(
        file=file,
        raw=raw,
        model=section("model", ModelSection),
        peft=sections.get("peft"),
        data=data,
        rewards=[spec for spec in sections.get("rewards") or [] if spec is not None],
        training=training,
        phases=None,
        validation=sections.get("validation"),
        description=raw.get("description") if isinstance(raw.get("description"), str) else None,
        distill=raw.get("distill") if fine("distill") else None,
        broken=broken,
    )


def _value_at(raw: Any, path: str) -> Any:
    for part in path.split("."):
        raw = raw[int(part)] if isinstance(raw, list) else raw[part]
    return raw


def not_a_recipe(raw: dict[str, Any]) -> RecipeProblem | None:
    """A file that is not a recipe at all: an ablation grid, or a flat TRL/open-r1 script config."""
    if "base" in raw and any(key in raw for key in GRID_MARKERS):
        return RecipeProblem(
            "", "this is an ablation grid file (it has `base` and `variants`/`grid`), not a recipe: check it with "
            "`prorl-trl ablate FILE --validate-only` (and run it with `prorl-trl ablate FILE`)"
        )
    from ..config import ProRLConfig

    training_fields = _init_fields(ProRLConfig)
    stray = [key for key in raw if key not in TOP_LEVEL_KEYS]
    known = [key for key in stray if key in FLAT_CONFIG_KEYS or key in training_fields]
    if len(known) < 2 or len(known) < len(stray) / 2:
        return None
    return RecipeProblem("", flat_config_message(raw, stray, training_fields))


def flat_config_message(raw: dict[str, Any], stray: list[str], training_fields: set[str]) -> str:
    """How the keys of a flat TRL/open-r1 config nest in a recipe, written out for this file's keys."""
    elsewhere = [f"      {key} -> {FLAT_CONFIG_KEYS[key]}" for key in stray if key in FLAT_CONFIG_KEYS]
    training = [key for key in stray if key in training_fields and key not in FLAT_CONFIG_KEYS]
    unknown = [key for key in stray if key not in FLAT_CONFIG_KEYS and key not in training_fields]
    shown = "".join(f"\n        {key}: {raw[key]!r}" for key in training[:8]) + ("\n        ..." if len(training) > 8 else "")
    lines = [
        "this looks like a flat TRL / open-r1 config; a recipe nests its keys in sections (see recipes/*.yaml):",
        "      model: {name_or_path: ...}   data: {builder: ..., source: ...}   rewards: [{name: ...}]",
        "      training:" + (shown or " {...}"),
    ]
    if elsewhere:
        lines += ["    and moves these keys:"] + elsewhere
    if unknown:
        lines.append(f"    no recipe key matches: {', '.join(unknown)}")
    lines.append("    `prorl-trl convert FILE -o RECIPE` writes the recipe and names each key it cannot translate")
    return "\n".join(lines)


def build_sections(raw: dict[str, Any], problems: list[RecipeProblem]) -> dict[str, Any]:
    """Top-level keys and the recipe's own sections (everything except `training`/`phases`/`rewards` semantics)."""
    from ..config import ProRLConfig

    training_fields = _init_fields(ProRLConfig)
    for key, value in raw.items():
        if key in TOP_LEVEL_KEYS:
            continue
        if key in training_fields:
            hint = f"; `{key}` is a training setting: put it under `training:`"
        elif key in FLAT_CONFIG_KEYS:
            hint = f"; in a recipe it is {FLAT_CONFIG_KEYS[key]}"
        else:
            hint = suggest(key, TOP_LEVEL_KEYS)
        problems.append(RecipeProblem(str(key), f"unknown section{hint}", value))
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
    if isinstance(raw, dict) and isinstance(raw.get("resume_from_checkpoint"), bool):
        # typed `str` for HfArgumentParser; a YAML true/false means "the latest checkpoint" / "none" (ProRLConfig)
        raw = {**raw, "resume_from_checkpoint": "true" if raw["resume_from_checkpoint"] else None}
    before = len(problems)
    training = check_mapping(raw, "training", hints, problems, metadata=TRAINING_RANGES, reserved=TRAINING_RESERVED)
    folder = raw.get("output_dir", "-") if isinstance(raw, dict) else "-"
    if folder is None or (isinstance(folder, str) and not folder.strip()):  # another type: the type check said so
        problems.append(
            RecipeProblem(
                "training.output_dir",
                "must name a folder; remove the key to use runs/<recipe file name>",
                raw["output_dir"],
            )
        )
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
    check_mapping(data.options, "data.options", hints, problems, metadata=spec.option_rules)
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


def check_assembled(recipe: Any, reward_names: list[str], problems: list[RecipeProblem], world_size: int, dry: bool):
    """Build `ProRLConfig` and resolve the phases exactly as training will, mapping errors back to key paths."""
    from ..config import resolve_phases

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = recipe.training_args(dry=dry, world_size=world_size)
        except Exception as error:  # TRL/transformers validation: report it against the section
            problems.append(RecipeProblem(key_path_of(str(error), "training"), str(error)))
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
        problems.append(RecipeProblem(key_path_of(str(error), "phases" if recipe.phases else "training"), str(error)))
    problems.extend(plateau_problems(recipe, args))
    problems.extend(dead_training_keys(recipe))
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


def dead_training_keys(recipe: Any) -> list[RecipeProblem]:
    """`training` keys that the phases override everywhere, so that a value set there (an override such as
    `--training.top_p 0.95` most of all) would be accepted and do nothing. Phase 0 takes its settings from
    `training` and every later phase from the one before; with several phases each sets its own length."""
    from ..config import GRPO_PHASE_FIELDS, PRORL_PHASE_FIELDS

    training, phases = recipe.training or {}, recipe.phases or []
    problems = []
    if len(phases) > 1:
        for key in ("max_steps", "num_train_epochs"):
            if key in training:
                message = (
                    "has no effect in a run of several phases: each phase's max_steps sets its length; set "
                    "`phases.<i>.max_steps` (the last phase: `--phases.-1.max_steps N`)"
                )
                problems.append(RecipeProblem(f"training.{key}", message, training[key]))
    first = phases[0] if phases else {}
    for key in GRPO_PHASE_FIELDS + PRORL_PHASE_FIELDS:
        if key in training and key in first and training[key] != first[key]:
            message = (
                f"has no effect: phase 0 sets {key} = {first[key]!r}, and each later phase starts from the one before; "
                f"set `phases.0.{key}` (or the phase's own) instead"
            )
            problems.append(RecipeProblem(f"training.{key}", message, training[key]))
    return problems


def plateau_problems(recipe: Any, args: Any) -> list[RecipeProblem]:
    """A plateau rule on a validation metric that is never logged never fires: every phase would run to its
    `max_steps` without a word. In a recipe the `eval_*` metrics come from `validation:` alone."""
    phases = getattr(recipe, "resolved_phases", None) or []
    metric = args.plateau_metric
    if not any(phase.plateau_patience > 0 for phase in phases) or not metric.startswith("eval_"):
        return []
    validation = recipe.validation
    if validation is None or not validation.enabled:
        message = (
            "is a validation metric, but validation is off, so the plateau rule (plateau_patience > 0) would never "
            "fire; turn validation on (`validation.enabled: true`), or set plateau_patience: 0"
        )
        return [RecipeProblem("training.plateau_metric", message, metric)]
    logged = ["eval_reward", "eval_mean_length", *(f"eval_pass@{k}" for k in sorted({1, *validation.ks}))]
    if metric not in logged:
        message = (
            f"is never logged, so the plateau rule would never fire; validation logs {', '.join(logged)} (add the k "
            "to `validation.ks`, or watch one of those)"
        )
        return [RecipeProblem("training.plateau_metric", message, metric)]
    return []


def batch_problems(training: dict[str, Any], world_size: int) -> list[RecipeProblem]:
    """TRL's generation-batch arithmetic for `world_size` processes, reported against the key the recipe set.

    TRL (GRPOConfig.__post_init__) derives `generation_batch_size` = per_device_train_batch_size x processes x
    steps_per_generation (default: gradient_accumulation_steps) and needs it divisible by num_generations, or, when
    `generation_batch_size` is set, divisible by per_device_train_batch_size x processes. Its message always names
    `generation_batch_size`, and `validate` runs in one process, so the check is repeated here for the launch.
    """
    from ..config import ProRLConfig

    defaults = {f.name: f.default for f in dataclasses.fields(ProRLConfig)}
    value = {key: training.get(key, defaults[key]) for key in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
        "num_generations")}  # fmt: skip
    given = [v for k, v in value.items() if v is not None or k not in ("generation_batch_size", "steps_per_generation")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in given) or world_size < 1:
        return []  # a type or range problem, reported by the field checks
    per_device, processes = value["per_device_train_batch_size"], world_size
    if value["generation_batch_size"] is not None and value["steps_per_generation"] is None:
        batch = per_device * processes
        if value["generation_batch_size"] % batch:
            return [RecipeProblem(
                "training.generation_batch_size",
                f"must be divisible by per_device_train_batch_size x processes = {per_device} x {processes} = {batch} "
                f"(one generation batch is split into whole micro-batches)",
                value["generation_batch_size"],
            )]  # fmt: skip
        generation = value["generation_batch_size"]
    elif value["generation_batch_size"] is None:
        steps_key = "steps_per_generation" if value["steps_per_generation"] is not None else "gradient_accumulation_steps"
        generation = per_device * processes * value[steps_key]
        if generation % value["num_generations"]:
            culprit = next((k for k in ("per_device_train_batch_size", "num_generations", steps_key) if k in training),
                           "per_device_train_batch_size")  # fmt: skip
            return [RecipeProblem(
                f"training.{culprit}",
                f"per_device_train_batch_size x processes x {steps_key} = {per_device} x {processes} x "
                f"{value[steps_key]} = {generation} completions per generation batch, which must be a multiple of "
                f"num_generations = {value['num_generations']} (whole groups of one prompt's completions)",
                training.get(culprit, value.get(culprit)),
            )]  # fmt: skip
    else:
        return []  # both set: TRL's own message names both keys
    if generation % value["num_generations"]:
        return [RecipeProblem(
            "training.generation_batch_size",
            f"must be a multiple of num_generations = {value['num_generations']} (whole groups)",
            generation,
        )]  # fmt: skip
    return []


MACHINE_KEYS = ("training.bf16", "training.fp16", "training.tf32")


def other_machine_hint(problems: list[RecipeProblem], command: str) -> list[str]:
    """Once, under the list: how to check a recipe meant for another machine (`command`: the right one for the
    command that found the precision problems), when any of them is about this machine's GPU."""
    if any(problem.path.endswith(MACHINE_KEYS) for problem in problems):
        return [f"to check a recipe meant for another machine (precision switches not tested here): {command}"]
    return []


def precision_problems(training: dict[str, Any]) -> list[RecipeProblem]:
    """`bf16`/`fp16`/`tf32` against this machine, as `train` will meet them (TrainingArguments refuses them late).
    How to check the recipe for another machine is said once, under the list (`other_machine_hint`)."""
    import torch

    on_cpu = bool(training.get("use_cpu")) or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    gpu = torch.cuda.is_available() and not on_cpu
    problems = []
    if training.get("bf16") and not gpu and not on_cpu:
        problems.append(RecipeProblem(
            "training.bf16", "needs a CUDA GPU and torch sees none here (torch.cuda.is_available() is False); set "
            "`training.bf16: false`, or `training.use_cpu: true` for bf16 on the CPU", True))  # fmt: skip
    elif training.get("bf16") and gpu and not torch.cuda.is_bf16_supported():
        problems.append(RecipeProblem(
            "training.bf16", "this GPU has no bf16 support (it needs Ampere or newer); use `fp16: true`", True
        ))  # fmt: skip
    if training.get("fp16") and not gpu:
        problems.append(RecipeProblem(
            "training.fp16", "fp16 mixed precision needs a CUDA GPU and torch sees none here; set "
            "`training.fp16: false`", True))  # fmt: skip
    if training.get("tf32") and not (gpu and torch.cuda.get_device_capability()[0] >= 8):
        problems.append(RecipeProblem(
            "training.tf32", "needs an Ampere or newer CUDA GPU; remove it or set `training.tf32: false`", True
        ))  # fmt: skip
    return problems


def override_annotation(raw: dict[str, Any], parts: list[str]) -> Any:
    """The type of the recipe key at `parts` (`["training", "save_strategy"]`, `["phases", "2", "top_p"]`,
    `["data", "options", "num_people"]`), or None where it has none to read by (a whole section, reward params)."""
    from ..config import PhaseConfig, ProRLConfig

    if len(parts) == 2 and parts[0] == "training":
        return typing.get_type_hints(ProRLConfig).get(parts[1])
    if len(parts) == 3 and parts[0] == "phases":
        return typing.get_type_hints(PhaseConfig).get(parts[2])
    if len(parts) == 3 and parts[:2] == ["data", "options"]:
        from ..data import BUILDERS

        spec = BUILDERS.get(str((raw.get("data") or {}).get("builder")))
        return spec.options.get(parts[2], (None,))[0] if spec else None
    if len(parts) == 3 and parts[0] == "rewards" and parts[2] in ("name", "weight"):
        return typing.get_type_hints(RewardSpec)[parts[2]]
    cls = SECTIONS.get(parts[0])
    if len(parts) == 2 and cls is not None:
        return typing.get_type_hints(cls).get(parts[1])
    return None


def key_path_of(message: str, default: str) -> str:
    """The key path an error message of `ProRLConfig`/`resolve_phases`/the trainer's checks is about."""
    match = PHASE_MESSAGE.search(message)
    if match and "ProRLConfig phase" in message:
        return f"phases.{match.group(1)}"
    return "phases" if "`phases`" in message else default
