"""A recipe's `distill:` section: checked with the recipe (no I/O), then run before the recipe's ProRL phases."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from ..data.spec import DataSection
from .config import DistillConfig
from .run import check_names, close_match, distill


# Keys a recipe's `distill:` section may not set: the recipe supplies them (its `model:` section and output folder).
_SECTION_OWNED = ("student", "model_init_kwargs", "tokenizer_name_or_path", "trust_remote_code", "output_dir")


def student_settings(model: Any) -> dict[str, Any]:
    """The `DistillConfig` fields of the student that a recipe's `model:` section (a `ModelSection`) sets: its path,
    loading options (as `Recipe.config_kwargs` gives them to the phases), tokenizer and `trust_remote_code`. A plain
    path (or None) gives the path alone."""
    if model is None or isinstance(model, (str, Path)):
        return {"student": str(model) if model is not None else None}
    init = {"dtype": model.dtype, "attn_implementation": model.attn_implementation, "revision": model.revision}
    return {
        "student": model.name_or_path,
        "model_init_kwargs": {key: value for key, value in init.items() if value is not None},
        "tokenizer_name_or_path": model.tokenizer_name_or_path,
        "trust_remote_code": model.trust_remote_code,
    }


def distill_config_from_section(
    section: dict[str, Any],
    model: Any = None,
    out_dir: str | Path | None = None,
    data: Any = None,
    where: str = "distill",
) -> DistillConfig:
    """A recipe's `distill:` section as a `DistillConfig`; raises `ValueError` naming the bad key (no I/O).

    The student is the recipe's model (`model`: its `model:` section, whose loading options, tokenizer and
    `trust_remote_code` the distillation uses too, or just a path) and the output goes to `out_dir` (placeholders
    when None, for early validation). `dataset` may be a builder name or a mapping
    `{builder|name: ..., <data-section keys>}`; without one, the recipe's own `data:` section (`data`, a
    `DataSection` or mapping) is used, so the student is distilled on the problems the RL phases train on.
    """
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected a mapping of distillation settings, got {type(section).__name__}.")
    allowed = [spec.name for spec in fields(DistillConfig) if spec.name not in _SECTION_OWNED]
    for key in section:
        if key not in allowed:
            owned = " (the recipe's `model:` section and output folder are used)" if key in _SECTION_OWNED else ""
            raise ValueError(
                f"{where}.{key}: unknown key{owned}{close_match(key, allowed)}; allowed: {', '.join(allowed)}."
            )
    values = dict(section)
    dataset = values.get("dataset", data)
    if dataset is not None and not isinstance(dataset, (str, dict)):  # a DataSection
        dataset = {spec.name: getattr(dataset, spec.name) for spec in fields(dataset)}
    if isinstance(dataset, dict):
        dataset = dict(dataset)
        name = dataset.pop("builder", None) or dataset.pop("name", None)
        if name is None:
            raise ValueError(f"{where}.dataset: a mapping needs a `builder` key (a data builder name, e.g. kk).")
        defaults = _data_defaults()
        kwargs = {key: value for key, value in dataset.items() if defaults.get(key, MISSING) != value}
        values["dataset"], values["dataset_kwargs"] = name, {**kwargs, **values.get("dataset_kwargs", {})}
    for key in ("teacher", "dataset", "reward"):
        if key not in values:
            raise ValueError(
                f"{where}.{key}: required (e.g. teacher: path/to/rl_checkpoint, dataset: kk, reward: kk_logic)."
            )
    try:
        student = student_settings(model)
        student["student"] = student["student"] or "<recipe model>"
        config = DistillConfig(**values, **student, output_dir=str(out_dir or "<out>"))
        check_names(config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    return config


def _data_defaults() -> dict[str, Any]:
    return {spec.name: spec.default for spec in fields(DataSection) if spec.default is not MISSING} | {
        spec.name: spec.default_factory() for spec in fields(DataSection) if spec.default_factory is not MISSING
    }


def check_distill_section(section: Any, data: Any = None, where: str = "distill") -> list[tuple[str, str]]:
    """Problems of a recipe's `distill:` section as `(key path, message)` pairs; empty when valid. No I/O."""
    try:
        distill_config_from_section(section, data=data, where=where)
    except ValueError as error:
        path, _, message = str(error).partition(": ")
        return [(path, message)]
    return []


def run_distill_section(section: dict[str, Any], model: Any, out_dir: str | Path, data: Any = None) -> str:
    """Run a recipe's `distill:` section on the recipe's model (its `model:` section, or a path); returns the
    distilled student's path.

    The recipe's ProRL phases then start from the returned path (a plain HF model folder). A finished distillation
    in `out_dir` with the same settings is not redone, so a resumed recipe goes straight to its phases.
    """
    return distill(distill_config_from_section(section, model, out_dir, data=data))["student_path"]
