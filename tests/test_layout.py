"""The package's import graph: no cycles, and every import points down the layer order (DESIGN.md, "Layout").

Every module under `prorl_trl/` and `rewards/` is parsed with `ast`; every import counts, at module level, inside a
function, or under `if TYPE_CHECKING:`. Layers, top to bottom (a module may import its own layer or any below):

    cli, __main__, demo, the `prorl_trl` facade
    recipe/, distill/, evaluation/
    trainer/
    reset/, rollout/, attention/, config
    data/, tiny, plots, console, model_card
    rewards/            (imports nothing from prorl_trl)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prorl_trl", "rewards")

# Unit (a subpackage, or a top-level module of prorl_trl) -> layer; higher layers may import lower ones.
LAYERS = {
    "rewards": 0,
    "prorl_trl.files": 0,  # bounded reading of the files the CLI is given or finds (stdlib only)
    "prorl_trl.data": 1,
    "prorl_trl.tiny": 1,
    "prorl_trl.plots": 1,
    "prorl_trl.console": 1,
    "prorl_trl.model_card": 1,
    "prorl_trl.config": 2,
    "prorl_trl.reset": 2,
    "prorl_trl.rollout": 2,
    "prorl_trl.attention": 2,
    "prorl_trl.trainer": 3,
    "prorl_trl.evaluation": 4,
    "prorl_trl.distill": 4,
    "prorl_trl.recipe": 4,
    "prorl_trl": 5,  # the package facade (lazy public names)
    "prorl_trl.cli": 5,
    "prorl_trl.__main__": 5,
    "prorl_trl.demo": 5,
    "prorl_trl.launch": 5,  # `prorl-trl launch`: accelerate launch with a clean stop
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def unit_of(module: str) -> str:
    """`prorl_trl.trainer.state` -> `prorl_trl.trainer`; `rewards.length` -> `rewards`; `prorl_trl` -> itself."""
    parts = module.split(".")
    return parts[0] if parts[0] == "rewards" else ".".join(parts[:2])


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Every module of our packages that `module` imports anywhere in its file (absolute names)."""
    is_package = path.name == "__init__.py"
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package_parts[: len(package_parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name` the module.
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` of a non-module attribute path: its module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    unplaced = sorted({unit_of(module) for module in graph} - set(LAYERS))
    assert not unplaced, f"place these in LAYERS (and DESIGN.md's layout): {unplaced}"


def test_no_import_cycle_between_modules(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_subpackages(graph):
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    cycle = find_cycle(units)
    assert cycle is None, "subpackage import cycle: " + " -> ".join(cycle)


def test_imports_point_down(graph):
    upward = [
        f"{module} (layer {LAYERS[unit_of(module)]}) imports {target} (layer {LAYERS[unit_of(target)]})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if LAYERS[unit_of(target)] > LAYERS[unit_of(module)]
    ]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_rewards_import_nothing_from_prorl_trl(graph):
    assert not [(m, t) for m, targets in graph.items() if m.startswith("rewards") for t in targets if t.startswith("prorl_trl")]


def test_the_checker_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The parser itself: relative, absolute, function-level and TYPE_CHECKING imports all become edges."""
    package = tmp_path / "prorl_trl"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .low import x\n")
    (package / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prorl_trl import high\n"
        "def f():\n    from .. import high as h\n    import prorl_trl.sub\n"
    )
    (package / "high.py").write_text("from .sub import low\nfrom .sub.low import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = {module_name(p): p for p in package.rglob("*.py")}
    edges = {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}
    assert edges["prorl_trl.sub.low"] == {"prorl_trl.high", "prorl_trl.sub"}
    assert edges["prorl_trl.high"] == {"prorl_trl.sub.low"}
    assert edges["prorl_trl.sub"] == {"prorl_trl.sub.low"}
    assert find_cycle(edges) is not None
