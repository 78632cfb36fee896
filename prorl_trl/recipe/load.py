"""`load_recipe`: read a recipe file, apply overrides, check everything, and return a `Recipe` or raise one
`RecipeError` listing every problem (file, key path, value, what to do) before any model or dataset is touched.
`read_recipe` returns the problems instead, with what passed its checks, for `validate`'s one pass (`preflight`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .checks import check_recipe, override_annotation
from .reading import apply_overrides, read_override_tokens, read_recipe_file
from .recipe import Recipe
from .schema import RecipeError, RecipeProblem


def load_recipe(
    path: str | Path,
    overrides: list[tuple[str, Any]] | list[str] = (),
    world_size: int | None = None,
    dry: bool = True,
) -> Recipe:
    """Read, override and fully validate a recipe. Raises `RecipeError` listing every problem.

    `overrides` are `(dotted.path, value)` pairs or raw command-line tokens (read by each key's type). `world_size` (default: `$WORLD_SIZE` or
    1) is what batch divisibility is checked against. `dry=True` checks hardware switches (bf16, tf32, ...) by type
    only, so a GPU recipe validates on a laptop.
    """
    recipe, problems = read_recipe(path, overrides, world_size=world_size, dry=dry)
    if problems:
        raise RecipeError(str(path), problems)
    return recipe


def read_recipe(
    path: str | Path, overrides: list[tuple[str, Any]] | list[str] = (), world_size: int | None = None, dry: bool = True
) -> tuple[Recipe | None, list[RecipeProblem]]:
    """`load_recipe` without raising for the recipe's content: (the recipe, its problems). With problems, the recipe
    holds only what passed its checks (`Recipe.broken` names the rest), for `validate` to go on checking the files,
    data and machine; None when the file is not a recipe at all. An unreadable file or malformed override tokens
    still raise `RecipeError`: nothing else can be checked."""
    raw = read_recipe_file(path)
    if overrides and isinstance(next(iter(overrides)), str):
        overrides = read_override_tokens(list(overrides))
    return recipe_and_problems(raw, str(path), list(overrides), world_size=world_size, dry=dry)


def recipe_and_problems(
    raw: dict[str, Any],
    file: str,
    overrides: list[tuple[str, Any]] = (),
    world_size: int | None = None,
    dry: bool = True,
) -> tuple[Recipe | None, list[RecipeProblem]]:
    """`read_recipe` for a mapping already in memory (`file` names it in messages). `raw` is modified in place."""
    problems = apply_overrides(raw, list(overrides), annotation_of=override_annotation)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    recipe = check_recipe(file, raw, problems, world_size=world_size, dry=dry)
    return recipe, problems


def recipe_from_dict(
    raw: dict[str, Any],
    file: str,
    overrides: list[tuple[str, Any]] = (),
    world_size: int | None = None,
    dry: bool = True,
) -> Recipe:
    """`load_recipe` for a mapping already in memory (`file` names it in messages). `raw` is modified in place."""
    recipe, problems = recipe_and_problems(raw, file, overrides, world_size=world_size, dry=dry)
    if problems:
        raise RecipeError(file, problems)
    return recipe
