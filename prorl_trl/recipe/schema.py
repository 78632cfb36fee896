"""The recipe's own sections (`model`, `peft`, `data`, `rewards`, `validation`, `logging`) and the checker that
reads them.

`training` and `phases` have no schema here: they are checked against `ProRLConfig` / `PhaseConfig` by
introspection (see `recipe.py`), so a field added there needs no edit here. This module imports nothing heavy, so
`prorl-trl validate` stays fast.

Range rules live in each field's metadata (`min`, `max`, `min_exclusive`, `choices`), next to its `help`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..data.spec import DataSection

NO_VALUE = object()  # "the problem is not about one value" (a missing key, a whole file)


@dataclass
class RecipeProblem:
    """One thing wrong with a recipe: where (`path`, e.g. `phases.2.top_p`), the value found, and what to do."""

    path: str
    message: str
    value: Any = NO_VALUE

    def format(self, file: str) -> str:
        where = f"{file}: {self.path}" if self.path else file
        if self.value is not NO_VALUE:
            where += f" = {_short_repr(self.value)}"
        return f"{where}: {self.message}"


class RecipeError(ValueError):
    """A recipe failed validation. Carries every problem found, so the user fixes them in one pass."""

    def __init__(
        self, file: str, problems: list[RecipeProblem], notes: typing.Iterable[str] = (), hints: typing.Iterable[str] = ()
    ):
        self.file = str(file)
        self.problems = list(problems)
        self.notes = list(dict.fromkeys(notes))  # what could not be checked because of a problem above, and why
        self.hints = list(dict.fromkeys(hints))  # advice about several problems at once, said once
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.problems)
        head = f"recipe {self.file} is invalid ({count} problem{'s' if count != 1 else ''}):"
        lines = [head] + ["  " + problem.format(self.file) for problem in self.problems]
        if self.notes:
            lines += ["not checked until the problems above are fixed:"] + [f"  {note}" for note in self.notes]
        lines += [f"hint: {hint}" for hint in self.hints]
        return "\n".join(lines)


def _short_repr(value: Any, limit: int = 80) -> str:
    """A value as the message shows it: paths and other text whole (up to 300 characters), the rest shortened."""
    limit = max(limit, 300) if isinstance(value, str) else limit
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggest(name: str, candidates: typing.Iterable[str]) -> str:
    """'; did you mean `x`?' for the closest candidate, or ''."""
    match = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


# ---------------------------------------------------------------------------------------------------------------
# Type and range checks shared by the recipe sections, `training` (ProRLConfig) and `phases` (PhaseConfig).
# ---------------------------------------------------------------------------------------------------------------


def describe_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        return f"a list of {describe_type(args[0])}" if args else "a list"
    if origin is dict or annotation is dict:
        return "a mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in annotation)
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def coerce(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Whether `value` (from YAML) fits `annotation`; returns the value converted where harmless (int -> float)."""
    if annotation is Any or annotation is object:
        return True, value
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            ok, converted = coerce(value, option)
            if ok:
                return True, converted
        return False, value
    if annotation is type(None):
        return value is None, value
    if origin is typing.Literal:
        return value in typing.get_args(annotation), value
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, list):
            return False, value
        args = typing.get_args(annotation)
        if not args or args[0] is Any:
            return True, value
        converted = []
        for item in value:
            ok, item = coerce(item, args[0])
            if not ok:
                return False, value
            converted.append(item)
        return True, converted
    if origin is dict or annotation is dict:
        return isinstance(value, dict), value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return value in {m.value for m in annotation} or isinstance(value, annotation), value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if annotation is str:
        return isinstance(value, str), value
    if isinstance(annotation, type):
        return isinstance(value, annotation), value
    return True, value  # an annotation we cannot check (a class from another library): TRL will


def check_value(path: str, value: Any, annotation: Any, metadata: Any, problems: list[RecipeProblem]) -> Any:
    """Type-check one value, then its `min`/`max`/`min_exclusive`/`choices` metadata; append problems."""
    ok, value = coerce(value, annotation)
    if not ok:
        expected = describe_type(annotation)
        enum_values = _enum_values(annotation)
        hint = suggest(value, enum_values) if isinstance(value, str) and enum_values else ""
        if isinstance(value, bool) and coerce("text", annotation)[0]:
            hint += "; YAML reads unquoted yes/no/on/off as true/false: quote the word (e.g. \"no\")"
        problems.append(RecipeProblem(path, f"expected {expected}{hint}", value))
        return value
    enum_values = _enum_values(annotation)
    if enum_values and isinstance(value, str) and value and value not in enum_values:  # `SchedulerType | str`
        problems.append(
            RecipeProblem(path, f"must be one of {', '.join(enum_values)}{suggest(value, enum_values)}", value)
        )
    if value is None or not metadata:
        return value
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        problems.append(
            RecipeProblem(path, f"must be one of {', '.join(map(repr, choices))}{suggest(value, choices)}", value)
        )
    numbers = value if isinstance(value, list) else [value]  # a range applies to each number of a list
    for number in numbers:
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            continue
        if "min" in metadata and number < metadata["min"]:
            problems.append(RecipeProblem(path, f"must be >= {metadata['min']}", value))
        if "min_exclusive" in metadata and number <= metadata["min_exclusive"]:
            problems.append(RecipeProblem(path, f"must be > {metadata['min_exclusive']}", value))
        if "max" in metadata and number > metadata["max"]:
            problems.append(RecipeProblem(path, f"must be <= {metadata['max']}", value))
    return value


def non_finite_paths(value: Any, path: str = "") -> list[str]:
    """Key paths of every NaN or infinite number in a YAML value (YAML reads `.nan` and `.inf` as floats, and NaN
    passes every `<`/`>` range check)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in non_finite_paths(item, f"{path}.{key}" if path else str(key))]
    if isinstance(value, list):
        return [p for index, item in enumerate(value) for p in non_finite_paths(item, f"{path}.{index}")]
    return []


def _enum_values(annotation: Any) -> list[str]:
    values = []
    for option in typing.get_args(annotation) or (annotation,):
        if isinstance(option, type) and issubclass(option, enum.Enum):
            values += [str(m.value) for m in option]
    return values


def check_mapping(
    raw: Any,
    path: str,
    hints: dict[str, Any],
    problems: list[RecipeProblem],
    *,
    required: typing.Iterable[str] = (),
    metadata: dict[str, Any] | None = None,
    reserved: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Check a YAML mapping against field type hints: unknown keys (with a close match), missing keys, types, ranges.

    `reserved` maps keys that exist in `hints` but belong elsewhere in the recipe to the message saying where.
    Returns the checked values (converted where harmless).
    """
    if not isinstance(raw, dict):
        problems.append(RecipeProblem(path, "expected a mapping of keys to values", raw))
        return {}
    checked = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if reserved and key in reserved:
            problems.append(RecipeProblem(key_path, reserved[key], value))
        elif key not in hints:
            problems.append(RecipeProblem(key_path, f"unknown key{suggest(key, hints)}", value))
        else:
            checked[key] = check_value(key_path, value, hints[key], (metadata or {}).get(key), problems)
    for key in required:
        if key not in raw:
            problems.append(RecipeProblem(f"{path}.{key}" if path else key, "is required but missing"))
    return checked


def dataclass_hints(cls: type) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(type hints, per-field metadata, required field names) of a dataclass."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    metadata = {f.name: dict(f.metadata) for f in fields}
    required = [
        f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    return {f.name: hints[f.name] for f in fields}, metadata, required


def check_section(raw: Any, cls: type, path: str, problems: list[RecipeProblem]) -> Any:
    """Check a mapping against a section dataclass and build it (None when there were problems)."""
    hints, metadata, required = dataclass_hints(cls)
    before = len(problems)
    checked = check_mapping(raw, path, hints, problems, required=required, metadata=metadata)
    return cls(**checked) if len(problems) == before else None


# ---------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ModelSection:
    """`model:` what to load and how."""

    name_or_path: str = field(metadata={"help": "Hub model id or local directory (a `save_pretrained` folder)."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Weights dtype.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel (`sdpa`, `eager`, `flash_attention_2`, ...); None: default."}
    )
    quantization: str | None = field(
        default=None,
        metadata={"help": "Load the base in 4 or 8 bit (bitsandbytes, QLoRA); None: no.", "choices": ["4bit", "8bit"]},
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantisation type.", "choices": ["nf4", "fp4"]}
    )
    bnb_4bit_use_double_quant: bool = field(
        default=True, metadata={"help": "Nested quantisation of the 4-bit scales."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the model repo's own Python code. Off unless you trust the repo."}
    )
    revision: str | None = field(default=None, metadata={"help": "Model revision (branch, tag or commit)."})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to load; None: the model's."}
    )


@dataclass
class PeftSection:
    """`peft:` the LoRA adapter of the first phase (phases may change rank and targets). `peft: null`: full tuning."""

    enabled: bool = field(default=True, metadata={"help": "Train a LoRA adapter; false: full fine-tuning."})
    r: int = field(default=16, metadata={"help": "LoRA rank.", "min": 1})
    lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r).", "min_exclusive": 0})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input.", "min": 0, "max": 1})
    target_modules: list[str] | str = field(
        default="all-linear", metadata={"help": "Module names to adapt (list) or 'all-linear'."}
    )
    bias: str = field(default="none", metadata={"help": "Bias training.", "choices": ["none", "all", "lora_only"]})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised scale alpha / sqrt(r)."})


@dataclass
class RewardSpec:
    """One entry of `rewards:`."""

    name: str = field(metadata={"help": "Registry name (`rewards.available()`)."})
    weight: float = field(default=1.0, metadata={"help": "Weight in the summed reward (TRL `reward_weights`)."})
    params: dict[str, Any] = field(default_factory=dict, metadata={"help": "Keyword arguments of the reward."})


@dataclass
class ValidationSection:
    """`validation:` pass@k of the live policy on the first `data.validation_size` validation problems, logged as
    `eval_pass@1`, `eval_reward`, ... (`prorl_trl.evaluation.validation.ValidationCallback`)."""

    enabled: bool = field(default=True, metadata={"help": "Run validation during training."})
    eval_steps: int = field(default=50, metadata={"help": "Validate every N optimizer steps (global).", "min": 1})
    num_samples: int = field(default=1, metadata={"help": "Samples per validation problem (n of pass@k).", "min": 1})
    temperature: float = field(default=1.0, metadata={"help": "Validation sampling temperature.", "min_exclusive": 0})
    top_p: float = field(default=1.0, metadata={"help": "Validation nucleus mass.", "min_exclusive": 0, "max": 1})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Validation completion cap; None: the current phase's.", "min": 1}
    )
    ks: list[int] = field(default_factory=lambda: [1], metadata={"help": "k values logged as `eval_pass@<k>`."})
    reward: str | None = field(
        default=None, metadata={"help": "Reward (registry name) that grades validation; None: the recipe's first."}
    )
    batch_size: int = field(default=16, metadata={"help": "Prompts per generate call.", "min": 1})
    at_start: bool = field(
        default=True, metadata={"help": "Also validate before the first step (the 'before' point)."}
    )


@dataclass
class LoggingSection:
    """`logging:` where metrics go. These are `ProRLConfig` fields; the section just groups them."""

    report_to: list[str] | str = field(
        default="none",
        metadata={
            "help": "`none`, or trackers: `tensorboard`, `trackio`, `wandb`, `mlflow` (the `trackers` extra installs "
            "them), or any other `report_to` of transformers."
        },
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every N steps.", "min_exclusive": 0})
    run_name: str | None = field(default=None, metadata={"help": "Run name shown by trackers."})
    log_completions: bool = field(default=False, metadata={"help": "Log sampled completions (TRL)."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed per log."})
    disable_tqdm: bool = field(default=False, metadata={"help": "Hide the progress bar."})


SECTIONS = {
    "model": ModelSection,
    "peft": PeftSection,
    "data": DataSection,
    "validation": ValidationSection,
    "logging": LoggingSection,
}
TOP_LEVEL_KEYS = (
    "description", "model", "peft", "data", "rewards", "training", "phases", "validation", "logging", "distill",
)  # fmt: skip
