"""The built-in policies and tasks are known by the module that registers each (`BUILT_IN`), imported when a name
is first read: the index must say what the files register, and naming one imports that one alone."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import kvbench.policies
import kvbench.tasks
from kvbench.policies import POLICIES
from kvbench.tasks import TASKS


@pytest.mark.parametrize("package,registry", [(kvbench.policies, POLICIES), (kvbench.tasks, TASKS)])
def test_the_index_names_what_each_module_registers(package, registry):
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    registered = {name: registry.get(name).__module__ for name in registry.names()
                  if registry.get(name).__module__.startswith(package.__name__ + ".")}
    assert registered == package.BUILT_IN


def test_naming_a_policy_imports_its_module_only():
    code = ("import sys; from kvbench.policies import build_policy; build_policy('h2o'); "
            "print(sorted(m for m in sys.modules if m.startswith('kvbench.policies.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == ["kvbench.policies.base", "kvbench.policies.deprecated", "kvbench.policies.h2o",
                            "kvbench.policies.reference", "kvbench.policies.schedule"]


def test_an_unknown_name_lists_the_known_ones_without_importing_them():
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError, match="unknown policy 'h20'.*did you mean 'h2o'.*window"):
        POLICIES.get("h20")
