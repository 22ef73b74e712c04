"""Built-in KV-cache policies, one file each; importing this package imports every module in it, whose `@register`
registers its policies: a new policy is its file."""

import importlib
import pkgutil

from kvbench.policies.base import POLICIES, Demand, Policy, Schedule, build_policy, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["POLICIES", "Demand", "Policy", "Schedule", "build_policy", "register"]
