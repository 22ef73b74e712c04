"""Policy members of the previous release, kept working for one more: a plugin class that defines one is
translated to the members that replaced it, with a `DeprecationWarning`. Gone in the next release."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from kvbench.policies.schedule import Schedule

if TYPE_CHECKING:
    from kvbench.engine.layer import LayerKV
    from kvbench.policies.base import Policy
    from kvbench.policies.schedule import Demand

# members a plugin written for the previous release may still define, and what replaced them
DEPRECATED = {"phases": "declare `schedule` (kvbench.policies.base.Schedule)",
              "check_budget": "override `check(demand)`", "check_settings": "override `check(demand)`",
              "active": "override `bounded(layer)` (the cache is `layer.owner`)",
              "eviction_periods": "set `self.schedule = self.schedule.each(tokens)` in `__post_init__`"}


def translate_deprecated(cls: type[Policy]) -> None:
    """Make a plugin class that defines members of the previous release work for one more, with a warning: what
    they declare is translated to the members that replaced them."""
    own = vars(cls)
    for name in DEPRECATED.keys() & own.keys():
        warnings.warn(f"policy class {cls.__name__}: `{name}` is deprecated and goes in the next release; "
                      f"{DEPRECATED[name]} instead", DeprecationWarning, stacklevel=3)
    if "phases" in own:
        phases = tuple(own["phases"])
        delattr(cls, "phases")
        cls.schedule = Schedule.DECODE if "decode" in phases else Schedule.PREFILL if phases else Schedule.NONE
    if "check_budget" in own or "check_settings" in own:
        cls._legacy_checks = True

        def check(self: Policy, demand: Demand) -> None:
            super(cls, self).check(demand)  # type: ignore[misc]
            if demand.budget is not None:
                self.check_budget(demand.budget)
            self.check_settings(demand.chunked)
        cls.check = check  # type: ignore[method-assign]
    if "active" in own:
        def bounded(self: Policy, layer: LayerKV) -> bool:
            return own["active"](self, layer.owner) and super(cls, self).bounded(layer)  # type: ignore[misc]
        cls.bounded = bounded  # type: ignore[method-assign]
    if "eviction_periods" in own:
        post_init = cls.__post_init__

        def periodic(self: Policy) -> None:
            post_init(self)
            periods = own["eviction_periods"](self)
            if periods:
                self.schedule = self.schedule.each(max(periods))  # type: ignore[misc]
        cls.__post_init__ = periodic  # type: ignore[method-assign]
