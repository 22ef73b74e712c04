"""kvbench's modules import one another one way: down the stages (`STAGES`), and in no cycle, counting the imports
inside functions too (an import that hides in a function to dodge a cycle or a stage is still one); kvbench/ holds
its stages' folders; and a wheel holds every package."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


# kvbench's stages in the order they may import one another: a module imports its own stage's and earlier ones'.
# A module is in the stage its package names (the longest package that matches), except the policy contract, which
# is below the engine that drives it while the policies themselves run on the engine.
STAGES = {
    "core": ["kvbench", "kvbench.errors", "kvbench.registry"],
    "contract": ["kvbench.policies", "kvbench.policies.base", "kvbench.policies.schedule",
                 "kvbench.policies.deprecated", "kvbench.policies.budgets", "kvbench.policies.reference",
                 "kvbench.policies.full"],
    "engine": ["kvbench.engine"],
    "plugins": ["kvbench.policies.*", "kvbench.tasks", "kvbench.calibration"],
    "serving": ["kvbench.serving"],
    "config": ["kvbench.config"],
    "runs": ["kvbench.runs"],
    "checks": ["kvbench.checks"],
    "analysis": ["kvbench.analysis"],
    "cli": ["kvbench.cli"],
}


def stage_of(module: str) -> int:
    """The place of `module`'s stage in `STAGES`: a module named itself first, then its longest package."""
    order = list(STAGES)
    for place, name in enumerate(order):
        if module in STAGES[name]:
            return place
    packages = [(len(pattern), place) for place, name in enumerate(order) for pattern in STAGES[name]
                if pattern != "kvbench" and module.startswith(pattern.removesuffix("*").rstrip(".") + ".")]
    if not packages:
        raise AssertionError(f"{module} is in no stage: add its package to STAGES")
    return max(packages)[1]


def later_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Each (module, target) where the target's stage comes after the module's."""
    return sorted((module, target) for module, targets in edges.items() for target in targets
                  if stage_of(target) > stage_of(module))


def test_no_module_imports_a_later_stage():
    assert later_imports(graph()) == []


def test_the_stage_check_finds_an_import_of_a_later_stage():
    edges = {"kvbench.engine.cache": {"kvbench.policies.base", "kvbench.runs.sweep"},
             "kvbench.policies.h2o": {"kvbench.engine.attention"}, "kvbench.policies.base": {"kvbench.policies.h2o"}}
    assert later_imports(edges) == [("kvbench.engine.cache", "kvbench.runs.sweep"),
                                    ("kvbench.policies.base", "kvbench.policies.h2o")]


def test_the_top_of_kvbench_is_its_stages():
    """kvbench/ holds the core's modules and a folder per stage, nothing else: a new module goes in its stage."""
    entries = {path.name for path in (ROOT / "kvbench").iterdir() if path.name != "__pycache__"}
    folders = {pattern.split(".")[1] for patterns in STAGES.values() for pattern in patterns
               if pattern.count(".") == 1 and (ROOT / "kvbench" / pattern.split(".")[1]).is_dir()}
    core = {f"{module.split('.')[1]}.py" for module in STAGES["core"] if "." in module}
    assert entries == folders | core | {"__init__.py"}
    assert len(entries) <= 12


CONTRACT = {"base", "schedule", "deprecated", "budgets"}
RUN_FULL = ("from typer.testing import CliRunner; from kvbench.cli import app; assert CliRunner().invoke(app, ['run', "
            "'-m', 'random:tiny-llama', '-p', 'full', '-t', 'niah', '--samples', '1', '-c', '300', "
            "'--max-new-tokens', '2']).exit_code == 0")


@pytest.mark.parametrize("command, policies", [("import kvbench.cli", set()), (RUN_FULL, {"full"})])
def test_the_cli_imports_no_policy_but_the_one_named(command, policies):
    """`import kvbench.cli` (what `kvbench --help` runs) loads the policy contract and no policy; `kvbench run -p
    full` adds `full` alone."""
    code = f"import sys; {command}; print(sorted(m for m in sys.modules if m.startswith('kvbench.policies.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert {module.rsplit(".", 1)[1] for module in eval(loaded.splitlines()[-1])} - CONTRACT == policies


def test_every_package_is_installed():
    """A wheel holds the packages pyproject.toml names: a package left off its list goes in as data files only, with
    setuptools' warning that a later setuptools leaves it out ("Package would be ignored")."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed


def test_a_former_module_path_is_the_moved_module_with_a_warning():
    """Every path in `kvbench.MOVED` imports, in a fresh interpreter, as the very module it moved to, and says where
    that is; a former module that gathered names (`kvbench.session`) holds the same objects. No path in the table is
    a file again, and every new one is."""
    import kvbench

    known = modules()
    assert not set(kvbench.MOVED) & set(known) and not set(kvbench.GATHERED) & set(known)
    assert set(kvbench.MOVED.values()) <= set(known)
    code = """
import importlib, json, sys, warnings
import kvbench
out = {}
for old, new in {**kvbench.MOVED, **{name: None for name in kvbench.GATHERED}}.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    said = [str(w.message) for w in caught if w.category is DeprecationWarning]
    if new is None:
        same = all(getattr(module, name) is getattr(importlib.import_module(home), name)
                   for name, home in kvbench.GATHERED[old].items())
    else:
        same = module is importlib.import_module(new) and module.__spec__.name == new
    out[old] = [same, said]
print(json.dumps(out))
"""
    found = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    for old, (same, said) in found.items():
        assert same, old
        assert len(said) == 1 and said[0].startswith(f"{old} moved: import from kvbench."), (old, said)
