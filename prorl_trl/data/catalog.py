"""The table of data builders: which exist, where their loaders live, their defaults and gold columns.

It imports nothing heavy (loaders load `datasets` only when called), so recipe validation can check names and options
in milliseconds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BuilderSpec:
    """A data builder: where its loader lives, its defaults, and the columns it hands to rewards."""

    loader: str  # "module:function", imported on first use
    default_source: str | None
    default_template: str
    gold_columns: tuple[str, ...]
    default_config: str | None = None
    default_split: str = "train"
    default_validation_split: str | None = None
    default_prompt_format: str = "chat"  # `data.prompt_format` when the recipe leaves it out
    options: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (type annotation, default)
    option_rules: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"min"/"max"/"choices": ...}
    needs_columns: bool = False
    # Columns of the *source* rows (before the loader renames them): the problem text and the gold columns.
    prompt_column: str = "question"
    source_gold_columns: tuple[str, ...] = ()
    # Local folder layout: `<folder>/<local_stem>.jsonl|.json|.parquet` (placeholders: split and the options).
    local_stem: str = "{split}"
    help: str = ""

    def source_columns(self, columns: dict[str, str] | None = None) -> tuple[str, list[str]]:
        """(problem column, gold columns) the loader reads from a source row; table builders take them from the
        recipe's `data.columns` mapping."""
        if not self.needs_columns:
            return self.prompt_column, list(self.source_gold_columns)
        mapping = dict(columns or {})
        return mapping.pop("prompt", "prompt"), list(mapping.values())

    def load_function(self) -> Callable[..., Any]:
        module, _, name = self.loader.partition(":")
        return getattr(importlib.import_module(module), name)


def _table_builder(kind: str) -> BuilderSpec:
    """`jsonl` and `parquet`: one loader; the recipe's `columns` say where prompt and gold are."""
    return BuilderSpec(
        loader="prorl_trl.data.builders:load_table",
        default_source=None,
        default_template="raw",
        gold_columns=("answer",),
        needs_columns=True,
        help=f"Any {kind} file; `columns` maps `prompt` (problem text) and gold names to source columns.",
    )


# Options every generated task has: split sizes and the seed (train and validation rows never overlap).
_GENERATED_SPLITS: dict[str, tuple[Any, Any]] = {"num_train": (int, 256), "num_validation": (int, 64), "seed": (int, 0)}
_GENERATED_RULES: dict[str, dict[str, Any]] = {"num_train": {"min": 1}, "num_validation": {"min": 1}, "seed": {"min": 0}}


BUILDERS: dict[str, BuilderSpec] = {
    "gsm8k": BuilderSpec(
        loader="prorl_trl.data.builders:load_gsm8k",
        default_source="openai/gsm8k",
        default_config="main",
        default_template="boxed_math",
        default_validation_split="test",
        gold_columns=("answer",),
        source_gold_columns=("answer",),
        help="GSM8K; `answer` = the number after `####` (commas removed).",
    ),
    "math500": BuilderSpec(
        loader="prorl_trl.data.builders:load_math500",
        default_source="HuggingFaceH4/MATH-500",
        default_template="boxed_math",
        default_split="test",
        gold_columns=("answer", "level", "subject", "unique_id"),
        prompt_column="problem",
        source_gold_columns=("answer",),
        help="MATH-500 (test split only); keeps `level` and `subject` for breakdowns.",
    ),
    "kk": BuilderSpec(
        loader="prorl_trl.data.builders:load_kk",
        default_source="K-and-K/knights-and-knaves",
        default_template="kk_logic_rl",
        default_validation_split="test",
        gold_columns=("names", "solution", "solution_text_format"),
        options={"num_people": (int, 5)},
        option_rules={"num_people": {"min": 2, "max": 8}},
        prompt_column="quiz",
        source_gold_columns=("names", "solution", "solution_text_format"),
        local_stem="{num_people}ppl_{split}",
        help="Knights and knaves (Logic-RL); `num_people` picks the puzzle size (2-8 on the hub, 3-7 locally).",
    ),
    "areal": BuilderSpec(
        loader="prorl_trl.data.builders:load_areal",
        default_source=None,
        default_template="raw",
        default_prompt_format="plain",  # the prompts carry their chat markup: a chat template would wrap it again
        gold_columns=("answer", "solutions"),
        prompt_column="prompt",
        source_gold_columns=("solutions",),
        help="AReaL-style rows `{prompt, solutions}`; `answer` = the boxed content of the first solution.",
    ),
    "jsonl": _table_builder("JSON-lines"),
    "parquet": _table_builder("parquet"),
    "synthetic_arithmetic": BuilderSpec(
        loader="prorl_trl.data.builders:load_synthetic_arithmetic",
        default_source=None,
        default_template="raw",
        default_validation_split="validation",
        gold_columns=("answer",),
        options={
            **_GENERATED_SPLITS,
            "num_steps": (int | list[int], (1, 3)),
            "max_value": (int, 20),
            "max_factor": (int, 3),
            "style": (str, "word"),
        },
        option_rules={
            **_GENERATED_RULES,
            "num_steps": {"min": 1},
            "max_value": {"min": 1},
            "max_factor": {"min": 2},
            "style": {"choices": ["word", "expression"]},
        },
        help="Generated arithmetic word problems (prorl_trl.data.synthetic); the prompt already asks for \\boxed{}.",
    ),
    "synthetic_kk": BuilderSpec(
        loader="prorl_trl.data.builders:load_synthetic_kk",
        default_source=None,
        default_template="raw",
        default_validation_split="validation",
        gold_columns=("names", "solution", "solution_text_format"),
        options={
            **_GENERATED_SPLITS,
            "num_people": (int | list[int], (2, 4)),
        },
        option_rules={**_GENERATED_RULES, "num_people": {"min": 2, "max": 8}},
        help="Generated knights-and-knaves puzzles with a unique solution (prorl_trl.data.synthetic).",
    ),
}


def available_builders() -> list[str]:
    return sorted(BUILDERS)
