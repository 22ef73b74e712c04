from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, protect, register
from kvbench.policies.reference import Reference, streaming_llm_reference


@register
@dataclass
class StreamingLLM(Policy):
    """StreamingLLM (Xiao et al. 2023): the first `sinks` tokens plus the most recent ones."""

    name = "streaming_llm"
    colour = "#56B4E9"
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise KvbenchError(f"policy 'streaming_llm' parameter 'sinks' must be >= 0, got {self.sinks}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.sinks:
            raise KvbenchError(f"streaming_llm: budget {demand.budget} leaves no room beyond sinks={self.sinks}")

    @property
    def ring(self) -> int:
        return self.sinks

    def score(self, layer, budget: int) -> torch.Tensor:
        positions = layer.live_positions()
        return protect(positions.float(), positions < self.sinks)

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return streaming_llm_reference(lm, prompt, decode, budget, self.sinks)
