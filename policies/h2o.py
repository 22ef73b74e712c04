from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.attention import attention_received
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, protect, recent_mask, register


@register
@dataclass
class H2O(Policy):
    """H2O (Zhang et al. 2023): heavy hitters by accumulated attention plus a recent window."""

    name = "h2o"
    needs_attention = True
    recent_ratio: float = 0.5  # share of the budget kept for the most recent tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise KvbenchError(f"policy 'h2o' parameter 'recent_ratio' must be in [0, 1], got {self.recent_ratio}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        # every query's attention counts, the prompt's included; scores leave with evicted entries
        layer.slot_stat(self.state_key).add_(attention_received(query, key, scaling, layer.padding(), layer.kind,
                                                                 layer.live_positions()))

    def score(self, layer, budget: int) -> torch.Tensor:
        recent = round(budget * self.recent_ratio)
        return protect(layer.slot_stat(self.state_key), recent_mask(layer, recent))
