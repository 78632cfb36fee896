"""Recipes: a YAML file (one experiment) -> validated objects -> a `prorl-trl train` run; and grids of them (`ablate`).

Read downward: `run` (train) and `ablate` -> `preflight` (this machine, paths, extras, data) -> `load` (read,
override, check) -> `checks` -> `recipe` (the validated `Recipe`) -> `schema` (sections and value checks); `reading`
parses YAML files and command-line overrides (read by the target key's type).
"""

from .load import load_recipe, recipe_from_dict
from .reading import apply_overrides, parse_overrides, read_recipe_file
from .recipe import Recipe
from .schema import RecipeError, RecipeProblem

__all__ = [
    "Recipe",
    "RecipeError",
    "RecipeProblem",
    "apply_overrides",
    "load_recipe",
    "parse_overrides",
    "read_recipe_file",
    "recipe_from_dict",
]
