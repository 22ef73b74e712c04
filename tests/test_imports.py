"""kvbench's modules import one another one way: no cycle, counting the imports inside functions too (an import
that hides in a function to dodge a cycle is still one), the engine imports nothing above it; and a wheel holds
every package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the source folders and the packages they install as (pyproject.toml's package-dir)
PACKAGES = {"kvbench": "kvbench", "policies": "kvbench.policies", "tasks": "kvbench.tasks"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes inside `if TYPE_CHECKING:` blocks: annotations, never run."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The kvbench modules `path` imports when it runs, wherever the import statement is, with the packages
    importing a submodule runs first."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    named = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
    targets = set()
    for name in named:
        parts = name.split(".")
        targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & set(known)
    return targets


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for module, path in known.items():
        # a module's own packages run before it: not an import of its own
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        edges[module] = imports(path, known) - own - {module}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_sits_in_an_import_cycle():
    assert cycles(graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_imports_nothing_above_it():
    """kvbench/engine/ reads a policy's answers through the objects it is handed, never by importing policies,
    tasks or what runs sessions (sweeps, the service, calibration)."""
    below = {"kvbench.errors", "kvbench.measure", "kvbench.measurements", "kvbench.settings", "kvbench.budgets",
             "kvbench.segments", "kvbench.policies.base", "kvbench.policies.schedule", "kvbench.policies.deprecated",
             "kvbench.policies", "kvbench.registry", "kvbench.models"}
    for module, targets in graph().items():
        if module.startswith("kvbench.engine"):
            above = {t for t in targets if not t.startswith("kvbench.engine") and t not in below}
            assert not above, (module, sorted(above))


def test_every_package_is_installed():
    """A wheel holds the packages pyproject.toml names: a package left off its list goes in as data files only, with
    setuptools' warning that a later setuptools leaves it out ("Package would be ignored")."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed
