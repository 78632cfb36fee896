"""Reading the files the CLI is given (recipes, configs to convert) or finds in a run folder (`prorl_state.json`,
`.prorl_manifest.json`, `prorl_trackers.json`, ...), defensively.

Whatever a file holds (binary bytes, UTF-16, a folder in its place, JSON nested 200,000 levels deep, a list where a
mapping belongs), reading it either returns what the caller expects or raises `UnreadableFileError`: the file, what
is wrong with it and what to do. The CLI prints it and exits 2 (bad input), never with a traceback. Reading is
bounded: a size cap per kind of file (PyYAML reads about a megabyte a second) and a nesting-depth cap (PyYAML and
`json` both recurse, and so does every check that walks the result).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

MiB = 2**20
RECIPE_MAX_BYTES = 1 * MiB  # a recipe, a grid, a config to convert: a few KB in practice
RUN_YAML_MAX_BYTES = 16 * MiB  # recipe.yaml and resume_history.yaml of a run
RUN_JSON_MAX_BYTES = 1024 * MiB  # prorl_state.json holds the run's log history: json reads ~100 MB/s
MAX_DEPTH = 100  # recipes nest 4 levels, run files 5: deeper is not a file this package wrote or reads
_BRACKETS = re.compile(r"[\[\]{}]")


class UnreadableFileError(ValueError):
    """A file the CLI reads is damaged or is not the kind of file it should be. The CLI prints the message and exits
    2 (bad input: nothing was loaded or changed)."""

    exit_status = 2

    def __init__(self, path: str | os.PathLike, problem: str, fix: str = ""):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"{path}: {problem}." + (f" {fix}" if fix else ""))


def read_text(path: str | os.PathLike, max_bytes: int, fix: str = "") -> str:
    """The text of `path` (UTF-8, or UTF-16 with its byte-order mark); `UnreadableFileError` for a missing file, a
    folder, an unreadable one, one over `max_bytes` or one that is not text."""
    path = Path(path)
    try:
        status = path.stat()
        size = status.st_size
        if path.is_dir():
            raise UnreadableFileError(path, "is a folder, not a file", fix)
        if not stat.S_ISREG(status.st_mode):  # a pipe or a device (/dev/zero) would be read without end
            raise UnreadableFileError(path, "is not a regular file (a pipe or a device)", fix)
        if size > max_bytes:
            raise UnreadableFileError(path, f"is {size / MiB:.1f} MiB, more than the {max_bytes / MiB:g} MiB such a "
                                      "file can be (refused unread)", fix)  # fmt: skip
        data = path.read_bytes()
    except FileNotFoundError:
        raise UnreadableFileError(path, "file not found", fix) from None
    except OSError as error:
        raise UnreadableFileError(path, f"cannot be read ({error.strerror or type(error).__name__})", fix) from None
    try:
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            return data.decode("utf-16")
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UnreadableFileError(
            path, f"is not text (byte {data[error.start]:#04x} at offset {error.start} is not UTF-8): a binary or "
            "damaged file", fix,
        ) from None  # fmt: skip


def flow_depth(text: str) -> int:
    """The deepest nesting of `[`/`{` in `text`, counted in one pass (quotes ignored: an overestimate only for text
    holding more than `MAX_DEPTH` unclosed brackets)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(text):
        depth = depth + 1 if bracket in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether mappings/lists in `value` nest deeper than `limit` (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def check_parsed(path: str | os.PathLike, value: Any, kind: type | tuple[type, ...] | None, fix: str = "") -> Any:
    """`value` if it is a `kind` nested at most `MAX_DEPTH` levels, else `UnreadableFileError`."""
    if kind is not None and not isinstance(value, kind):
        want = " or a ".join(_type_name(k) for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise UnreadableFileError(path, f"holds {_a(value)}, not a {want}", fix)
    if too_deep(value):
        raise UnreadableFileError(path, f"nests deeper than {MAX_DEPTH} levels", fix)
    return value


def read_json(path: str | os.PathLike, kind: type | tuple[type, ...] | None = dict, fix: str = "",
              max_bytes: int = RUN_JSON_MAX_BYTES) -> Any:  # fmt: skip
    """The JSON value of `path`, a `kind`; `UnreadableFileError` for anything else (see the module docstring)."""
    text = read_text(path, max_bytes, fix)
    try:
        value = json.loads(text)
    except ValueError as error:
        raise UnreadableFileError(path, f"is not valid JSON ({str(error)[:200]})", fix) from None
    except RecursionError:
        raise UnreadableFileError(path, "nests too deeply to be read", fix) from None
    return check_parsed(path, value, kind, fix)


def read_yaml(path: str | os.PathLike, kind: type | tuple[type, ...] | None = dict, fix: str = "",
              max_bytes: int = RUN_YAML_MAX_BYTES, loader: Any = None) -> Any:  # fmt: skip
    """The YAML value of `path` (an empty file: None, unless `kind` is given: an empty `kind`), read with `loader`
    (default `yaml.SafeLoader`); `UnreadableFileError` for anything else, a syntax error with its line."""
    import yaml

    text = read_text(path, max_bytes, fix)
    if flow_depth(text) > MAX_DEPTH:  # PyYAML takes ~1 ms per level of `[[[...` before it gives up
        raise UnreadableFileError(path, f"nests deeper than {MAX_DEPTH} levels", fix)
    try:
        value = yaml.load(text, Loader=loader or yaml.SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UnreadableFileError(path, f"YAML syntax error{where}: {error.problem}", fix) from None
    except yaml.YAMLError as error:
        raise UnreadableFileError(path, f"YAML error: {str(error)[:200]}", fix) from None
    except RecursionError:
        raise UnreadableFileError(path, "nests too deeply to be read", fix) from None
    if value is None and kind is not None:
        value = (kind[0] if isinstance(kind, tuple) else kind)()
    return check_parsed(path, value, kind, fix)


def _type_name(kind: type) -> str:
    return {dict: "mapping", list: "list", str: "string"}.get(kind, kind.__name__)


def _a(value: Any) -> str:
    name = "null" if value is None else _type_name(type(value))
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
