"""The problem set of an evaluation: dataset rows with a stable `problem_id`, filtered and limited.

Rows come from the project's dataset builders (`prorl_trl.data`), so eval prompts are the training prompts. Every
row keeps its gold columns (they are passed to the reward) and its breakdown columns (`level`, `subject`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DATASETS = ("gsm8k", "math500", "kk", "jsonl")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _fallback_rows(name: str, data_files: list[str] | None, shared_data: Path) -> list[dict[str, Any]]:
    """Minimal local reading used only when `prorl_trl.data` has no builder for `name`."""
    if name == "jsonl" or data_files:
        if not data_files:
            raise ValueError("--dataset jsonl needs --data-files FILE.jsonl (rows with a `prompt` column).")
        rows = [row for path in data_files for row in _read_jsonl(path)]
    elif name == "math500":
        rows = _read_jsonl(shared_data / "math500" / "test.jsonl")
    elif name == "gsm8k":
        rows = _read_jsonl(shared_data / "gsm8k" / "test.jsonl")
    else:
        rows = [row for size in range(3, 8) for row in _read_jsonl(shared_data / "kk" / f"{size}ppl_test.jsonl")]
    for row in rows:
        if "prompt" in row:
            continue
        if "problem" in row:
            row["prompt"] = [{"role": "user", "content": f"{row['problem']}\n{BOXED_INSTRUCTION}"}]
        elif "question" in row:
            row["solution"], row["answer"] = row["answer"], row["answer"].split("####")[-1].strip().replace(",", "")
            row["prompt"] = [{"role": "user", "content": f"{row['question']}\n{BOXED_INSTRUCTION}"}]
        elif "quiz" in row:
            row["prompt"] = [{"role": "user", "content": row["quiz"]}]
        else:
            raise ValueError(f"Rows of {name!r} need a `prompt` column; got columns {sorted(row)}.")
    return rows


def load_rows(name: str, data_files: list[str] | None = None, shared_data: str | Path | None = None) -> list[dict]:
    """All rows of dataset `name` as dicts with a `prompt` column and gold columns."""
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
    for path in data_files or []:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data-files: {path} does not exist.")
    builder = _builder(name)
    if builder is not None:
        kwargs = {"data_files": data_files} if data_files else {}
        dataset = builder(**kwargs)
        rows = [dict(row) for row in dataset]
    else:
        root = Path(shared_data) if shared_data else Path(__file__).resolve().parents[3] / "shared" / "data"
        rows = _fallback_rows(name, data_files, root)
    if rows and "prompt" not in rows[0]:
        raise ValueError(f"Dataset {name!r} has no `prompt` column (columns: {sorted(rows[0])}).")
    return rows


def _builder(name: str):
    try:
        from prorl_trl import data
    except ImportError:
        return None
    getter = getattr(data, "get_builder", None)
    if callable(getter):
        try:
            return getter(name)
        except (KeyError, ValueError):
            return None
    return None


def with_problem_ids(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every row a stable `problem_id`: its `unique_id`/`id` column if unique, else its position."""
    for key in ("unique_id", "id", "problem_id"):
        values = [row.get(key) for row in rows]
        if all(v is not None for v in values) and len(set(map(str, values))) == len(rows):
            return [{**row, "problem_id": str(v)} for row, v in zip(rows, values)]
    return [{**row, "problem_id": str(index)} for index, row in enumerate(rows)]


_INTEGER = re.compile(r"^[+-]?\d+$")


def gold_text(row: dict[str, Any]) -> str:
    """The gold final answer as text (`answer` column; a GSM8K worked solution is cut after `####`)."""
    value = row.get("answer", row.get("solution", ""))
    text = str(value).split("####")[-1].strip()
    return text.replace("$", "").replace(",", "").replace("\\!", "").strip()


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
