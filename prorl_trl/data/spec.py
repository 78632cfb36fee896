"""What data to build: the recipe's `data:` section as a dataclass, read by the builders, evaluation and distillation.

It lives with the builders (not with the recipe schema) because every user of data reads it, and the builders sit
below the recipe layer; `prorl_trl.recipe.schema` validates a recipe's `data:` mapping against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Prompts longer than this are dropped unless the recipe says otherwise (`data.max_prompt_tokens`).
DEFAULT_MAX_PROMPT_TOKENS = 2048


@dataclass
class DataSection:
    """`data:` which builder turns which source into `prompt` + gold columns."""

    builder: str = field(metadata={"help": "Data builder (`gsm8k`, `math500`, `kk`, `areal`, `jsonl`, ...)."})
    source: str | None = field(
        default=None, metadata={"help": "Hub dataset id or local file/folder; None: the builder's hub id."}
    )
    config: str | None = field(default=None, metadata={"help": "Hub dataset config name; None: the builder's."})
    split: str | None = field(
        default=None, metadata={"help": "Training split; None: the builder's (train; math500: test)."}
    )
    data_files: str | list[str] | None = field(
        default=None,
        metadata={"help": "Files inside a hub dataset repo that holds several (`load_dataset(data_files=)`)."},
    )
    template: str | None = field(
        default=None, metadata={"help": "Prompt template name (prorl_trl.data.templates); None: the builder's."}
    )
    prompt_format: str | None = field(
        default=None,
        metadata={
            "help": "`chat`: message list rendered by the tokenizer's chat template (instruct models); "
            "`plain`: one string (base models); None: the builder's (`plain` for `areal`, whose prompts are "
            "already templated; `chat` otherwise).",
            "choices": ["chat", "plain"],
        },
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Replaces the template's system prompt."})
    columns: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "Column mapping `{prompt: <col>, answer: <col>, ...}` (jsonl/parquet); the gold columns the "
            "rewards read (`answer`, a reward's `answer_key`) are kept without one."
        },
    )
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Builder-specific options (e.g. kk `num_people`)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training rows.", "min": 1})
    max_prompt_tokens: int | None = field(
        default=DEFAULT_MAX_PROMPT_TOKENS,
        metadata={
            "help": "Drop prompts longer than this many tokens (after templating; the count is logged). Default "
            "2048: above any GSM8K/MATH/K&K prompt, below where a stray document in the data would eat the context. "
            "null: keep every prompt.",
            "min": 1,
        },
    )
    validation_source: str | None = field(
        default=None, metadata={"help": "Source of the validation split; None: `source`."}
    )
    validation_split: str | None = field(default=None, metadata={"help": "Validation split; None: no validation."})
    validation_size: int | None = field(
        default=None, metadata={"help": "Use the first N validation problems; None: all.", "min": 1}
    )
