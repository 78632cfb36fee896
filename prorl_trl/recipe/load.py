"""YAML recipe -> validated objects (`ProRLConfig`, `LoraConfig`, reward functions, data spec), plus overrides.

One recipe is one experiment. Sections: `model`, `peft`, `data`, `rewards`, `training` (any `ProRLConfig` field),
`phases` (list of `PhaseConfig`), `validation`, `logging`. `load_recipe` checks everything before a model or
dataset is touched and raises one `RecipeError` listing every problem (file, key path, value, what to do).

Command-line overrides: `--<key.path> VALUE` or `--<key.path>=VALUE`, values parsed as YAML scalars
(`--training.learning_rate 1e-6`, `--phases.2.temperature 1.2`, `--peft.target_modules '[q_proj, v_proj]'`,
`--peft null`). A path whose first part is not a section means `training.` (`--learning_rate 1e-6`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .recipe_schema import (
    TOP_LEVEL_KEYS,
    DataSection,
    ModelSection,
    PeftSection,
    RecipeError,
    RecipeProblem,
    RewardSpec,
    ValidationSection,
)

# ---------------------------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------------------------


class RecipeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads `1e-6` as a float (YAML 1.1 wants `1.0e-6`) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the later value would silently win)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml_scalar(text: str) -> Any:
    """A command-line value, read the way the same text would be read in the recipe."""
    try:
        return yaml.load(text, Loader=RecipeLoader)
    except yaml.YAMLError:
        return text


def read_recipe_file(path: str | Path, kind: str = "recipe") -> dict[str, Any]:
    """The raw YAML mapping of a recipe (or grid) file; a missing file or a syntax error becomes a `RecipeError`
    with the line."""
    path = Path(path)
    if not path.is_file():
        what = f"is a directory, not a {kind} file" if path.is_dir() else "file not found"
        raise RecipeError(str(path), [RecipeProblem("", what)])
    try:
        raw = yaml.load(path.read_text(), Loader=RecipeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise RecipeError(str(path), [RecipeProblem("", f"YAML syntax error at {where}: {error.problem}")]) from None
    except yaml.YAMLError as error:
        raise RecipeError(str(path), [RecipeProblem("", f"YAML error: {error}")]) from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), [RecipeProblem("", f"a {kind} must be a YAML mapping of sections", raw)])
    return raw


# ---------------------------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------------------------


def parse_overrides(tokens: list[str]) -> list[tuple[str, Any]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", 1), ("c", "x")]`. Raises `RecipeError` on a malformed list."""
    overrides, problems, index = [], [], 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or len(token) == 2:
            problems.append(RecipeProblem("", f"expected an override `--key.path VALUE`, got {token!r}"))
            index += 1
            continue
        key, has_value, value = token[2:].partition("=")
        if not has_value:
            if index + 1 >= len(tokens) or (tokens[index + 1].startswith("--") and len(tokens[index + 1]) > 2):
                problems.append(RecipeProblem(key, "override has no value (use `--key.path VALUE`)"))
                index += 1
                continue
            value, index = tokens[index + 1], index + 1
        overrides.append((key, parse_yaml_scalar(value)))
        index += 1
    if problems:
        raise RecipeError("command line", problems)
    return overrides


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[str, Any]]) -> list[RecipeProblem]:
    """Set each dotted path in `raw` (in place). Integer parts index lists (`phases.2`)."""
    problems = []
    for key, value in overrides:
        parts = key.split(".")
        if parts[0] not in TOP_LEVEL_KEYS:
            parts = ["training"] + parts
        node: Any = raw
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            here = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                    span = f"0-{len(node) - 1}" if node else "none"
                    problems.append(RecipeProblem(here, f"override index out of range ({len(node)} entries: {span})"))
                    break
                part = int(part)
            elif not isinstance(node, dict):
                problems.append(RecipeProblem(here, "override goes through a value that is not a mapping or list"))
                break
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The validated recipe
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Recipe:
    """A validated recipe. Building the heavy objects (`training_args`, `reward_functions`) is cheap and repeatable."""

    file: str
    raw: dict[str, Any]
    model: ModelSection
    peft: PeftSection | None
    data: DataSection
    rewards: list[RewardSpec]
    training: dict[str, Any]
    phases: list[dict[str, Any]] | None
    validation: ValidationSection | None
    description: str | None = None
    distill: dict[str, Any] | None = None  # run before the phases (prorl_trl.distill)
    warnings: list[str] = dataclasses.field(default_factory=list)
    resolved_phases: list[Any] | None = None  # filled by validation (`config.resolve_phases`)

    @property
    def output_dir(self) -> str:
        return str(self.training.get("output_dir") or Path("runs") / Path(self.file).stem)

    def config_kwargs(self, dry: bool = False) -> dict[str, Any]:
        from .recipe_checks import DRY_RUN_SKIPPED

        kwargs = dict(self.training)
        if dry:  # hardware switches were type-checked; TrainingArguments would test them against this machine
            kwargs.update({key: False for key in DRY_RUN_SKIPPED if key in kwargs or key in ("bf16", "fp16")})
        elif "bf16" not in kwargs and not kwargs.get("fp16"):
            import torch

            # TRL turns bf16 on by default, which TrainingArguments refuses on a machine without a GPU.
            on_cpu = kwargs.get("use_cpu") or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
            kwargs["bf16"] = bool(torch.cuda.is_available() and not on_cpu)
        kwargs["output_dir"] = self.output_dir
        kwargs["trust_remote_code"] = self.model.trust_remote_code
        kwargs["reward_weights"] = [spec.weight for spec in self.rewards]
        init = {"dtype": self.model.dtype, "attn_implementation": self.model.attn_implementation}
        init["revision"] = self.model.revision
        kwargs["model_init_kwargs"] = {k: v for k, v in init.items() if v is not None}
        if self.phases is not None:
            kwargs["phases"] = [dict(p) for p in self.phases]
        return kwargs

    def training_args(self, dry: bool = False):
        """The `ProRLConfig`. `dry=True` leaves out hardware-dependent switches (bf16 on a CPU-only box)."""
        from .config import ProRLConfig

        return ProRLConfig(**self.config_kwargs(dry=dry))

    def peft_config(self):
        if self.peft is None or not self.peft.enabled:
            return None
        from peft import LoraConfig

        fields = {f.name: getattr(self.peft, f.name) for f in dataclasses.fields(self.peft) if f.name != "enabled"}
        return LoraConfig(task_type="CAUSAL_LM", **fields)

    def quantization_config(self):
        if self.model.quantization is None:
            return None
        from transformers import BitsAndBytesConfig

        if self.model.quantization == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True)
        dtype = self.model.dtype if self.model.dtype not in ("auto", None) else "bfloat16"
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.model.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=self.model.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=dtype,
        )

    def reward_functions(self) -> list[Any]:
        import rewards

        return [rewards.get_reward(spec.name, **spec.params) for spec in self.rewards]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False, allow_unicode=True)


def load_recipe(
    path: str | Path,
    overrides: list[tuple[str, Any]] | list[str] = (),
    world_size: int | None = None,
    dry: bool = True,
) -> Recipe:
    """Read, override and fully validate a recipe. Raises `RecipeError` listing every problem.

    `overrides` are `(dotted.path, value)` pairs or raw command-line tokens. `world_size` (default: `$WORLD_SIZE` or
    1) is what batch divisibility is checked against. `dry=True` checks hardware switches (bf16, tf32, ...) by type
    only, so a GPU recipe validates on a laptop.
    """
    raw = read_recipe_file(path)
    if overrides and isinstance(next(iter(overrides)), str):
        overrides = parse_overrides(list(overrides))
    return recipe_from_dict(raw, str(path), list(overrides), world_size=world_size, dry=dry)


def recipe_from_dict(
    raw: dict[str, Any],
    file: str,
    overrides: list[tuple[str, Any]] = (),
    world_size: int | None = None,
    dry: bool = True,
) -> Recipe:
    """`load_recipe` for a mapping already in memory (`file` names it in messages). `raw` is modified in place."""
    problems = apply_overrides(raw, list(overrides))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from .recipe_checks import check_recipe

    recipe = check_recipe(file, raw, problems, world_size=world_size, dry=dry)
    if problems:
        raise RecipeError(file, problems)
    return recipe


__all__ = [
    "Recipe",
    "RecipeError",
    "RecipeProblem",
    "load_recipe",
    "recipe_from_dict",
    "parse_overrides",
    "apply_overrides",
]
