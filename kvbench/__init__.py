"""kvbench: benchmark KV-cache eviction and compression policies on real models.

The package is in folders by stage, each importing only the stages before it (tests/test_imports.py holds them to
that): the policy contract (`policies/`: base, budgets, reference), the engine (`engine/`), what the engine runs
(`policies/`, `tasks/`, `calibration/`), the service (`serving/`), the sweep config (`config/`), running cells
(`runs/`), `checks/`, what a run folder becomes (`analysis/`) and the CLI (`cli/`). Each folder's `__init__.py` says
what it owns.

A module's former path (`kvbench.session`, `kvbench.cache`, `kvbench.summary`, ...) still imports, with a
DeprecationWarning naming its new one, until the next release: `MOVED` below is the table."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvbench")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

# a former module path -> the module it is now
MOVED = {f"kvbench.{old}": f"kvbench.{new}" for old, new in {
    "accounting": "engine.accounting", "attention": "engine.attention", "cache": "engine.cache",
    "codecs": "engine.codecs", "eviction": "engine.eviction", "layer": "engine.layer", "storage": "engine.storage",
    "rows": "engine.row_accounts", "engine.rows": "engine.row_accounts", "models": "engine.models",
    "measure": "engine.instruments", "measurements": "engine.measurements", "settings": "engine.settings",
    "segments": "engine.segments", "generation": "engine.generation", "sharing": "engine.sharing",
    "fidelity": "engine.fidelity", "pages": "engine.paging", "estimate": "engine.estimate",
    "budgets": "policies.budgets", "reference": "policies.reference", "capacity": "tasks.capacity_search",
    "lmeval": "tasks.lmeval_model", "calibrate": "calibration.calibrate", "kvzap": "calibration.kvzap",
    "artifacts": "calibration.artifacts", "config_files": "config.files", "cells": "config.cells",
    "sweep": "runs.sweep", "batching": "runs.batching", "outcomes": "runs.outcomes", "work": "runs.work",
    "runner": "runs.runner", "ray_executor": "runs.ray_executor", "load": "runs.load_cell",
    "results": "runs.run_folder", "check": "checks.suite", "check_generations": "checks.generations",
    "kept": "checks.kept", "tolerance": "checks.tolerance", "summary": "analysis.summary",
    "columns": "analysis.columns", "tables": "analysis.tables", "recommend": "analysis.recommend",
    "gate": "analysis.gate", "plot": "analysis.plot", "gallery": "analysis.gallery", "report": "analysis.report",
    "latex": "analysis.latex", "page": "analysis.html_page", "load_report": "analysis.serving_report",
}.items()}
# a former module that gathered names from several: each name -> the module it is in now
GATHERED = {
    "kvbench.session": {
        **dict.fromkeys(["Scored", "Session", "compiled_step", "forward", "static_step", "step_together", "stopped"],
                        "kvbench.engine.session"),
        **dict.fromkeys(["Generation", "Prompt", "answer", "generate", "generate_batch", "generate_rows",
                         "left_padded"], "kvbench.engine.generation"),
        **dict.fromkeys(["cache_measurements", "timings"], "kvbench.engine.measurements"),
        **dict.fromkeys(["RunSettings", "check_budget", "compression_plan", "policy_budget", "resolve_budget",
                         "threshold_of"], "kvbench.engine.settings"),
        **dict.fromkeys(["SharedPrefill", "compression_key", "shared_prefill", "wanted_compressions"],
                        "kvbench.engine.sharing"),
    },
    "kvbench.joint": {"JointCache": "kvbench.engine.joint", "step_together": "kvbench.engine.session"},
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers a former module path: the module it moved to (the same object, so patching one patches the other),
    or for a gathering module a new one holding its names."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name in MOVED or name in GATHERED:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in GATHERED:
            return types.ModuleType(spec.name)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__  # the import machinery is about to give it this path's spec
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        assert module.__spec__ is not None, "the import machinery gives the module this path's spec"
        name = module.__spec__.name
        if name in GATHERED:
            homes = GATHERED[name]
            for attribute, home in homes.items():
                setattr(module, attribute, getattr(importlib.import_module(home), attribute))
            setattr(module, "__all__", sorted(homes))  # noqa: B010  (a module type declares no __all__)
            where = ", ".join(sorted(set(homes.values())))
        else:
            where = MOVED[name]
            module.__spec__ = self._specs.pop(name)
        warnings.warn(f"{name} moved: import from {where} (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=2)


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())
