"""Data problems found before any model loads, each named by file, line (or row) and column.

Bad rows otherwise surface deep inside a run: an empty prompt as an `IndexError` in generation, non-UTF-8 bytes
or a malformed line as a `datasets` traceback, a null prompt as the text "None", a null or list gold as a reward
of None for every completion (loss 0, grad 0, a "finished" run that learned nothing). Three checks, cheapest first:

* `scan_local_file`: a local JSON-lines / JSON / parquet file, streamed row by row with the standard library
  (and pyarrow for parquet): encoding, JSON syntax, rows at all, the columns the builder reads, null / empty /
  non-text problems, one type per column, non-finite numbers. No `datasets` import, so `validate` stays quick.
* `check_built_rows`: the same row rules on a built split (`question` + gold columns), so hub data is checked too.
* `check_golds_readable`: every reward of the run called once per row on an empty completion; a reward that
  returns None for every row, or a row every reward returns None for, has gold answers no reward can read.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Rows listed per kind of problem (the count of the others follows), so a bad 100k-row file stays readable.
LISTED_LOCATIONS = 5
# Rows handed to a reward at once while probing golds (prompts may be long: keep the batch small).
PROBE_BATCH = 32


@dataclass
class DataProblem:
    """One thing wrong with a data file or split: where (file, line or row, column) and what to do."""

    file: str
    message: str
    line: int | None = None  # 1-based line of a local JSON-lines file
    row: int | None = None  # 1-based row of a split (or of a JSON array / parquet file)
    column: str | None = None

    def location(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row {self.row}" if self.row is not None else ""


class DataError(ValueError):
    """Data that a run cannot train on; carries every problem found (grouped when rendered)."""

    def __init__(self, problems: list[DataProblem]):
        self.problems = list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        return "bad training data:\n" + "\n".join("  " + line for line in render_problems(self.problems))


def render_problems(problems: list[DataProblem]) -> list[str]:
    """One line per (file, column, message), naming the first few lines/rows and how many more there are."""
    groups: dict[tuple[str, str | None, str], list[str]] = {}
    for problem in problems:
        groups.setdefault((problem.file, problem.column, problem.message), []).append(problem.location())
    lines = []
    for (file, column, message), locations in groups.items():
        where = [loc for loc in locations if loc]
        text = file
        if where:
            kind = where[0].split()[0]
            numbers = ", ".join(loc.split()[1] for loc in where[:LISTED_LOCATIONS])
            more = f" (and {len(where) - LISTED_LOCATIONS} more)" if len(where) > LISTED_LOCATIONS else ""
            text += f", {kind}{'s' if len(where) > 1 else ''} {numbers}{more}"
        if column is not None:
            text += f", column {column!r}"
        lines.append(f"{text}: {message}")
    return lines


# ---------------------------------------------------------------------------------------------------- row rules


def json_kind(value: Any) -> str:
    """The JSON type of a value, as a user reads it."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(has_non_finite(item) for item in value)
    if isinstance(value, dict):
        return any(has_non_finite(item) for item in value.values())
    return False


# C0/C1 control characters and DEL: never part of a problem text (tab, newline and carriage return are).
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
CONTROL_NAMES = {"\x00": "NUL", "\x08": "backspace", "\x0b": "vertical tab", "\x0c": "form feed", "\x1b": "escape",
                 "\x7f": "DEL"}  # fmt: skip


def control_character_problem(text: str) -> str | None:
    r"""Why a text with control characters is refused, or None. Refused, not cleaned: they mean a damaged or
    mis-encoded file (UTF-16 read as UTF-8 is NULs throughout) or a LaTeX command whose backslash JSON ate
    (`"\\frac"` written `"\frac"` is a form feed + "rac"); dropping them silently would train on the damage."""
    first = CONTROL_CHARACTER.search(text)
    if first is None:
        return None
    char, others = first.group(), len(CONTROL_CHARACTER.findall(text)) - 1
    more = f" (and {others} more)" if others else ""
    hint = ""
    if char in "\x08\x0c":
        hint = r'; a LaTeX \frac or \boxed written in JSON with one backslash ("\frac") becomes one: write "\\frac"'
    return (
        f"control character U+{ord(char):04X} ({CONTROL_NAMES.get(char, 'a control character')}) at character "
        f"{first.start() + 1}{more}: it means a damaged or mis-encoded file{hint}; remove it or fix the file"
    )


def prompt_problem(value: Any) -> str | None:
    """What is wrong with one problem text (a string, or a chat message list), or None."""
    if value is None:
        return "null problem text (it would reach the model as the text 'None'); fill it or remove the row"
    if isinstance(value, str):
        if not value.strip():
            return "empty problem text (the model would get nothing to solve); fill it or remove the row"
        return control_character_problem(value)
    if isinstance(value, list):
        if not value:
            return "empty message list; give at least one {role, content} message"
        for message in value:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):  # fmt: skip
                return "a message list must hold {role: text, content: text} mappings"
        if not any(message["content"].strip() for message in value):
            return "every message of the conversation is empty; fill it or remove the row"
        return next(filter(None, (control_character_problem(message["content"]) for message in value)), None)
    return f"the problem text is {json_kind(value)}, not text or a chat message list"


class RowChecker:
    """The row rules, applied row by row: problem text, the gold columns' presence, one type per column, finite
    numbers. Missing columns are collected, so a column absent from every row becomes one message."""

    def __init__(self, file: str, prompt_column: str, gold_columns: Iterable[str], by: str = "line"):
        self.file, self.prompt_column, self.by = file, prompt_column, by
        self.columns = [prompt_column, *[c for c in gold_columns if c != prompt_column]]
        self.problems: list[DataProblem] = []
        self.rows = 0
        self.missing: dict[str, list[int]] = {column: [] for column in self.columns}
        self.first_kind: dict[str, tuple[str, int]] = {}
        self.seen_columns: set[str] = set()

    def problem(self, number: int, message: str, column: str | None = None) -> None:
        where = {"line": number} if self.by == "line" else {"row": number}
        self.problems.append(DataProblem(self.file, message, column=column, **where))

    def check(self, number: int, row: Any) -> None:
        self.rows += 1
        if not isinstance(row, dict):
            self.problem(number, f"expected a JSON object {{column: value}}, got {json_kind(row)}")
            return
        self.seen_columns.update(row)
        for column in self.columns:
            if column not in row:
                self.missing[column].append(number)
                continue
            value = row[column]
            message = prompt_problem(value) if column == self.prompt_column else None
            if message:
                self.problem(number, message, column)
            elif has_non_finite(value):
                self.problem(number, "non-finite number (NaN or Infinity); use a finite value", column)
            elif value is not None:
                kind = json_kind(value)
                first = self.first_kind.setdefault(column, (kind, number))
                if first[0] != kind:
                    self.problem(number, f"{kind} here but {first[0]} at {self.by} {first[1]}: a column holds one type", column)

    def finish(self, hint: str = "") -> list[DataProblem]:
        if self.rows == 0:
            return self.problems or [DataProblem(self.file, "has no rows (the file is empty or holds only blank lines)")]
        problems = []
        for column, numbers in self.missing.items():
            if len(numbers) == self.rows:
                present = ", ".join(sorted(self.seen_columns)) or "none"
                problems.append(DataProblem(self.file, f"no such column in any row (columns: {present}){hint}", column=column))
            else:
                problems += [
                    DataProblem(self.file, "the row has no such column", column=column, **{self.by: n}) for n in numbers
                ]
        return problems + self.problems


# -------------------------------------------------------------------------------------------------- local files


def _json_rows(path: Path, checker: RowChecker) -> None:
    """Stream a JSON-lines file (or one JSON array) into the checker, reporting bytes and syntax by line."""
    with open(path, "rb") as handle:
        bom = handle.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8  # a UTF-8 BOM (Windows editors) is read, as `datasets` does
        handle.seek(len(codecs.BOM_UTF8) if bom else 0)
        head = handle.read(4096).lstrip()
        handle.seek(len(codecs.BOM_UTF8) if bom else 0)
        if head.startswith(b"["):
            _json_array(path, handle.read(), checker)
            return
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                checker.problem(number, f"not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1}); "
                                        "re-save the file as UTF-8")  # fmt: skip
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                checker.problem(number, f"not valid JSON ({error.msg} at column {error.colno}); one JSON object per line")
                continue
            checker.check(number, row)


def _json_array(path: Path, data: bytes, checker: RowChecker) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        checker.by = "line"
        checker.problem(line, f"not UTF-8 text (byte 0x{data[error.start]:02x}); re-save the file as UTF-8")
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        checker.by = "line"
        checker.problem(error.lineno, f"not valid JSON ({error.msg} at column {error.colno})")
        return
    if not isinstance(rows, list):
        checker.problems.append(DataProblem(str(path), "a .json file must hold a list of rows (or be JSON lines)"))
        return
    checker.by = "row"
    for number, row in enumerate(rows, start=1):
        checker.check(number, row)


def _parquet_rows(path: Path, checker: RowChecker) -> None:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # not a parquet file, truncated, ...: say so instead of a pyarrow traceback
        checker.problems.append(DataProblem(str(path), f"cannot be read as parquet: {error}"))
        return
    checker.by = "row"
    names = parquet.schema_arrow.names
    wanted = [column for column in checker.columns if column in names]
    checker.seen_columns.update(names)
    if not wanted:  # none of the columns the builder reads: every row lacks them all
        for number in range(1, parquet.metadata.num_rows + 1):
            checker.check(number, {})
        return
    number = 0
    for batch in parquet.iter_batches(batch_size=256, columns=wanted):
        for row in batch.to_pylist():
            number += 1
            checker.check(number, row)


def scan_local_file(
    path: str | Path, prompt_column: str, gold_columns: Iterable[str], hint: str = ""
) -> list[DataProblem]:
    """Problems of one local data file (JSON lines, a JSON array, or parquet), row by row, without `datasets`.

    `prompt_column` holds the problem text; `gold_columns` must exist in every row (their values are judged by the
    rewards later, see `check_golds_readable`). `hint` is appended to a missing-column message.
    """
    path = Path(path).expanduser()
    checker = RowChecker(str(path), prompt_column, gold_columns)
    if path.suffix == ".parquet":
        _parquet_rows(path, checker)
    else:
        _json_rows(path, checker)
    return checker.finish(hint)


# ------------------------------------------------------------------------------------------------- built splits


def _batches(dataset: Any, columns: list[str], size: int = PROBE_BATCH) -> Iterator[tuple[int, dict[str, list]]]:
    """`(first row index, {column: values})` over a `datasets.Dataset`, a few rows at a time (prompts may be long)."""
    view = dataset.select_columns(columns)
    for start in range(0, len(view), size):
        yield start, view[start : start + size]


def check_built_rows(dataset: Any, where: str, gold_columns: Iterable[str]) -> list[DataProblem]:
    """The row rules on a built split (`question` + `gold_columns`); rows are numbered from 1."""
    gold = [c for c in gold_columns if c in dataset.column_names]
    checker = RowChecker(where, "question", gold, by="row")
    for start, batch in _batches(dataset, ["question", *gold], size=256):
        for offset in range(len(batch["question"])):
            checker.check(start + offset + 1, {column: values[offset] for column, values in batch.items()})
    return checker.finish()


def _empty_completion(prompt: Any) -> Any:
    return [{"role": "assistant", "content": ""}] if isinstance(prompt, list) else ""


def check_golds_readable(dataset: Any, reward_funcs: list[Any], where: str) -> list[DataProblem]:
    """Call every reward once per row, as TRL does (the row's columns as keyword arguments), on an empty completion.

    A reward returns None where it cannot grade (TRL's convention): a null gold, a list where it expects text, a
    missing column. Problems: a reward that returns None for *every* row (it would add nothing to any step), and rows
    for which *every* reward returns None (their groups would train on a reward of 0). A reward that raises on the
    probe is skipped, except for a missing column, which is reported.
    """
    from rewards import MissingColumnError

    if len(dataset) == 0 or not reward_funcs:
        return []
    columns = [c for c in dataset.column_names if c not in ("prompt", "completion", "completion_ids")]
    unread_by: dict[str, list[int]] = {}
    problems: list[DataProblem] = []
    probed = []
    for reward in reward_funcs:
        name = getattr(reward, "__name__", type(reward).__name__)
        unread: list[int] = []
        try:
            for start, batch in _batches(dataset, ["prompt", *columns]):
                prompts = batch.pop("prompt")
                scores = reward(
                    prompts=prompts,
                    completions=[_empty_completion(p) for p in prompts],
                    completion_ids=[[] for _ in prompts],
                    **batch,
                )
                unread += [start + i for i, score in enumerate(scores) if score is None]
        except MissingColumnError as error:
            problems.append(DataProblem(where, f"reward `{name}`: {error}"))
            continue
        except Exception:  # a user reward that cannot take an empty completion: no verdict from it
            continue
        probed.append(name)
        unread_by[name] = unread
    if not probed:
        return problems
    row_one = {c: dataset[0][c] for c in columns}
    for name, unread in unread_by.items():
        if len(unread) == len(dataset):
            problems.append(
                DataProblem(
                    where,
                    f"reward `{name}` can read no gold answer: it returns None for every row (row 1 has "
                    f"{_short(row_one)}); every step would get reward 0 from it. Check the gold column's values "
                    "(null? a list where text is expected?) and `data.columns`",
                )
            )
    everyone = set.intersection(*(set(unread) for unread in unread_by.values()))
    if everyone and len(everyone) < len(dataset):
        for index in sorted(everyone):
            problems.append(
                DataProblem(where, "no reward can read this row's gold answer (null or wrong type); fix or remove the row",
                            row=index + 1)  # fmt: skip
            )
    return problems


def _short(row: dict[str, Any], limit: int = 120) -> str:
    text = ", ".join(f"{key} = {value!r}" for key, value in row.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."
