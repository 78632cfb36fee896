"""Reading recipe files and command-line overrides: YAML (safe, strict) in, plain mappings out.

Command-line overrides: `--<key.path> VALUE` or `--<key.path>=VALUE` (`--training.learning_rate 1e-6`,
`--phases.2.temperature 1.2`, `--peft.target_modules '[q_proj, v_proj]'`, `--peft null`). A value is read by the
type of the key it sets (`read_override_value`): where the key takes text, the text as typed (`--training.save_strategy
no` is "no", not YAML's `false`); elsewhere as YAML, like the same text in the recipe. A path whose first part is not
a section means `training.` (`--learning_rate 1e-6`); one that looks like a misspelt section is refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .schema import TOP_LEVEL_KEYS, LoggingSection, RecipeError, RecipeProblem, coerce


class CommandLineText(str):
    """An override value as typed on the command line, read once the target key's type is known."""

class RecipeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads `1e-6` as a float (YAML 1.1 wants `1.0e-6`) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, tuple[Any, Any]] = {}  # Python's dict key -> (the YAML key, its node)
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = seen.get(key)
            except TypeError:  # a list or mapping as key: SafeLoader reports it below
                continue
            if earlier is not None and type(earlier[0]) is type(key):
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the later value would silently win)", key_node.start_mark
                )
            if earlier is not None:  # `1:` and `true:`, `1:` and `1.0:`: two YAML keys, one key to Python (1 == True)
                raise yaml.constructor.ConstructorError(
                    None, None, f"keys {earlier[1].value!r} (line {earlier[1].start_mark.line + 1}) and "
                    f"{key_node.value!r} are different YAML keys ({type(earlier[0]).__name__} and "
                    f"{type(key).__name__}) but one key to Python (the later value would silently win): quote them "
                    "to make them text", key_node.start_mark,
                )  # fmt: skip
            seen[key] = (key, key_node)
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
    """The raw YAML mapping of a recipe (or grid) file; a missing, binary, oversized or too deeply nested file, or a
    syntax error, becomes a `RecipeError` naming the problem (and the line)."""
    from ..files import RECIPE_MAX_BYTES, UnreadableFileError, read_yaml

    path = Path(path)
    try:
        raw = read_yaml(path, None, max_bytes=RECIPE_MAX_BYTES, loader=RecipeLoader)
    except UnreadableFileError as error:
        what = f"is a directory, not a {kind} file" if error.problem.startswith("is a folder") else error.problem
        raise RecipeError(str(path), [RecipeProblem("", what)]) from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), [RecipeProblem("", f"a {kind} must be a YAML mapping of sections", raw)])
    return raw


def read_override_value(text: str, annotation: Any) -> Any:
    """A command-line value for a key of type `annotation` (None: unknown): YAML's reading when it fits the type,
    else the text itself when the key takes text (`no`, `yes`, `on`, `1234` for a string key), else YAML's reading
    (the type check then reports it)."""
    value = parse_yaml_scalar(text)
    if annotation is None or coerce(value, annotation)[0]:
        return value
    return text if coerce(text, annotation)[0] else value


def parse_overrides(tokens: list[str]) -> list[tuple[str, Any]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", 1), ("c", "x")]`: values read as YAML, whatever the key's type
    (`load_recipe` reads them by type, from `read_override_tokens`). Raises `RecipeError` on a malformed list."""
    return [(key, parse_yaml_scalar(text)) for key, text in read_override_tokens(tokens)]


def read_override_tokens(tokens: list[str]) -> list[tuple[str, CommandLineText]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", "1"), ("c", "x")]` with the values unread (`CommandLineText`).
    Raises `RecipeError` on a malformed list."""
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
        overrides.append((key, CommandLineText(value)))
        index += 1
    if problems:
        raise RecipeError("command line", problems)
    return overrides


def _where_the_recipe_sets_it(raw: dict[str, Any], parts: list[str]) -> list[str]:
    """A logging key may sit under `training` or `logging` (one of the two); an override of it goes where the recipe
    already sets it, so `--training.disable_tqdm true` on a recipe with `logging.disable_tqdm` changes that value
    instead of setting it twice (which the recipe check refuses)."""
    if len(parts) != 2 or parts[0] not in ("training", "logging"):
        return parts
    other = "logging" if parts[0] == "training" else "training"
    logging_keys = {spec.name for spec in dataclasses.fields(LoggingSection)}
    if parts[1] in logging_keys and isinstance(raw.get(other), dict) and parts[1] in raw[other]:
        return [other, parts[1]]
    return parts


def apply_overrides(
    raw: dict[str, Any],
    overrides: list[tuple[str, Any]],
    annotation_of: Callable[[dict[str, Any], list[str]], Any] | None = None,
) -> list[RecipeProblem]:
    """Set each dotted path in `raw` (in place). Integer parts index lists (`phases.2`); the index one past the last
    phase adds a phase (`--phases.2.max_steps 50` on a two-phase recipe: how a finished run is extended), which must
    then set its length. `CommandLineText` values are read by `annotation_of(raw, path parts)`, the type of the key
    they set (None: read as YAML)."""
    problems = []
    added: list[tuple[int, dict[str, Any]]] = []  # phases added by an override: (index, the new entry)
    for key, value in overrides:
        parts = key.split(".")
        if parts[0] not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(parts[0], TOP_LEVEL_KEYS, n=1, cutoff=0.75)
            if len(parts) > 1 and close:
                problems.append(RecipeProblem(parts[0], f"unknown section in override `--{key}`; did you mean `{close[0]}`?"))
                continue
            parts = ["training"] + parts
        parts = _where_the_recipe_sets_it(raw, parts)
        if isinstance(value, CommandLineText):
            value = read_override_value(value, annotation_of(raw, parts) if annotation_of else None)
        node: Any = raw
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            here = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                if parts[0] == "phases" and depth == 1 and not last and part == str(len(node)) and node:
                    node.append({})  # a phase added after the recipe's last one
                    added.append((len(node) - 1, node[-1]))
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
    for index, phase in added:  # `--phases.2.temperature 1.1` meant for the second phase must not add a third
        if not any(name in phase for name in ("max_steps", "num_train_epochs")):
            problems.append(RecipeProblem(
                f"phases.{index}", f"the overrides add phase {index} after the recipe's last one; a phase added on the "
                f"command line must set its length (`--phases.{index}.max_steps N`). Phases are counted from 0.",
            ))  # fmt: skip
    return problems
