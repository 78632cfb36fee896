"""The problem set of an evaluation: dataset rows with a stable `problem_id`, filtered and limited.

Rows come from the project's dataset builders (`prorl_trl.data`), so eval prompts are the training prompts. Every
row keeps its gold columns (they are passed to the reward) and its breakdown columns (`level`, `subject`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DATASETS = ("gsm8k", "math500", "kk", "jsonl", "synthetic_arithmetic", "synthetic_kk")  # the last two: generated


def load_rows(
    name: str,
    source: str | None = None,
    split: str = "test",
    columns: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    template: str | None = None,
    prompt_format: str = "chat",
    reward_funcs: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """All rows of `split` from the dataset builder `name`, as dicts with a `prompt` column and gold columns.

    `source` is a hub id or a local file/folder (`--data-files`); None: the builder's hub id. With `reward_funcs`, a
    table keeps the gold columns they read, and a reward that would lack one is refused now, before any sampling.
    """
    from prorl_trl.data import BUILDERS, build_dataset
    from prorl_trl.data.spec import DataSection

    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
    if source is not None and not Path(source).expanduser().exists() and Path(source).suffix:
        raise FileNotFoundError(f"--data-files: {source} does not exist.")
    if BUILDERS[name].needs_columns and not source:
        raise ValueError(f"--dataset {name} needs --data-files FILE (and --columns prompt=<column>,answer=<column>).")
    section = DataSection(
        builder=name, source=source, split=split, columns=dict(columns or {}), options=dict(options or {}),
        template=template, prompt_format=prompt_format,
    )
    return [dict(row) for row in build_dataset(section, which="train", reward_funcs=reward_funcs)]


def with_problem_ids(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every row a stable `problem_id`: its `unique_id`/`id` column if unique, else its position."""
    for key in ("unique_id", "id", "problem_id"):
        values = [row.get(key) for row in rows]
        if all(v is not None for v in values) and len(set(map(str, values))) == len(rows):
            return [{**row, "problem_id": str(v)} for row, v in zip(rows, values)]
    return [{**row, "problem_id": str(index)} for index, row in enumerate(rows)]


_INTEGER = re.compile(r"^[+-]?\d+$")
# A comma between digits followed by exactly three digits: "32,348", "11,\! 111" (not the list "-2,1").
_THOUSANDS = re.compile(r"(?<=\d),\s*(?=\d{3}(?!\d))")


def gold_text(row: dict[str, Any]) -> str:
    """The gold final answer as text (`answer` column; a GSM8K worked solution is cut after `####`), with dollar
    signs (`\\$`, `$`), LaTeX thin spaces (`\\!`) and thousands separators removed."""
    value = row.get("answer", row.get("solution", ""))
    text = str(value).split("####")[-1].strip()
    text = text.replace("\\$", "").replace("$", "").replace("\\!", "")
    return _THOUSANDS.sub("", text).strip()


def is_integer_answer(row: dict[str, Any]) -> bool:
    return bool(_INTEGER.match(gold_text(row)))


def select(rows: list[dict[str, Any]], subset: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Apply `--subset non-integer` (gold answer not an integer) and then `--limit` (first N)."""
    if subset == "non-integer":
        rows = [row for row in rows if not is_integer_answer(row)]
    if limit is not None:
        rows = rows[:limit]
    return rows


def check_breakdown(rows: list[dict[str, Any]], fields: list[str]) -> None:
    if not rows:
        return
    missing = [f for f in fields if f not in rows[0]]
    if missing:
        available = sorted(k for k in rows[0] if k not in ("prompt", "problem_id"))
        raise ValueError(f"--breakdown {','.join(missing)}: no such column; columns of this dataset: {', '.join(available)}.")
