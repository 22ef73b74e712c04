from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, build_spec, register


@register
@dataclass
class Compose(Policy):
    """One policy compresses the prompt, another evicts generated tokens, within one total budget."""

    name = "compose"
    needs_attention = True
    prefill: str | dict[str, Any] = "snapkv"  # a name, or {name: ..., params...}
    decode: str | dict[str, Any] = "h2o"
    _stages: tuple[Policy, Policy] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        first, then = build_spec(self.prefill), build_spec(self.decode)
        if not first.phases:
            raise KvbenchError(f"policy '{self.name}': prefill policy '{first.name}' does not compress")
        if type(first).select is not Policy.select:
            # its uneven per-head lengths are padded; decode-time scorers do not skip padding slots
            raise KvbenchError(f"policy '{self.name}': '{first.name}' cannot be followed by a decode-time policy")
        if not then.evicts_during_decode:
            raise KvbenchError(f"policy '{self.name}': decode policy '{then.name}' does not evict while decoding")
        self._stages = (first, then)

    def observers(self) -> list[Policy]:
        # both stages see every step: the decode stage's statistics (e.g. H2O's) include the prompt
        return [leaf for stage in self._stages for leaf in stage.observers()]

    def score(self, layer, budget: int) -> torch.Tensor:
        stage = self._stages[0] if layer.owner.phase == "prefill" else self._stages[1]
        return stage.score(layer, budget)

    def check_budget(self, budget: int) -> None:
        for stage in self._stages:
            stage.check_budget(budget)

    def state_keys(self) -> list[str]:
        return [key for stage in self._stages for key in stage.state_keys()]


@register
@dataclass
class Hybrid(Compose):
    """SnapKV for the prompt, then H2O for generated tokens (the usual advice for a long document + dialogue)."""

    name = "hybrid"
