from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.engine.cache import Phase
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, Schedule, Wrapper, register


@register
@dataclass
class Compose(Wrapper):
    """One policy compresses the prompt, another evicts generated tokens, within one total budget."""

    name = "compose"
    colour = "#661100"
    needs_attention = True
    prefill: str | dict[str, Any] = "snapkv"  # a name, or {name: ..., params...}
    decode: str | dict[str, Any] = "h2o"

    def __post_init__(self) -> None:
        super().__post_init__()
        first, then = self.build_stage(self.prefill), self.build_stage(self.decode)
        if not first.schedule.evicts:
            raise KvbenchError(f"policy '{self.name}': prefill policy '{first.name}' does not compress")
        if type(first).select is not Policy.select:
            # its uneven per-head lengths are padded; decode-time scorers do not skip padding slots
            raise KvbenchError(f"policy '{self.name}': '{first.name}' cannot be followed by a decode-time policy")
        if not then.schedule.decodes:
            raise KvbenchError(f"policy '{self.name}': decode policy '{then.name}' does not evict while decoding")
        # both stages observe every step (the decode stage's statistics, e.g. H2O's, include the prompt); the
        # layer budgets are the prefill stage's (PyramidKV's pyramid holds through decoding)
        self._stages = (first, then)
        periods = [stage.schedule.every for stage in self._stages if stage.schedule.every is not None]
        self.schedule = Schedule.DECODE.each(max(periods)) if periods else Schedule.DECODE  # type: ignore[misc]

    def stage(self, cache) -> Policy:
        return self._stages[0] if cache.phase is Phase.PREFILL else self._stages[1]


@register
@dataclass
class Hybrid(Compose):
    """SnapKV for the prompt, then H2O for generated tokens (the usual advice for a long document + dialogue)."""

    name = "hybrid"
    colour = "#44AA99"
