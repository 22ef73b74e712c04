from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.attention import received_by
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, protect, recent_mask, register
from kvbench.policies.reference import Reference, h2o_reference


@register
@dataclass
class H2O(Policy):
    """H2O (Zhang et al. 2023): heavy hitters by accumulated attention plus a recent window."""

    name = "h2o"
    colour = "#009E73"
    threshold_scale = "mean attention weight received per query since the entry arrived (no recent window)"
    needs_attention = True
    recent_ratio: float = 0.5  # share of the budget kept for the most recent tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise KvbenchError(f"policy 'h2o' parameter 'recent_ratio' must be in [0, 1], got {self.recent_ratio}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        # every query's attention counts, the prompt's included; scores leave with evicted entries
        layer.slot_stat(self.state_key).add_(received_by(layer, query, key, scaling))

    def score(self, layer, budget: int) -> torch.Tensor:
        recent = round(budget * self.recent_ratio)
        return protect(layer.slot_stat(self.state_key), recent_mask(layer, recent))

    def threshold_score(self, layer) -> torch.Tensor:
        # the running sum grows with every query: divided by the queries that saw the entry, an older entry and a
        # newer one compare on one scale. The recent window is a share of a token budget, which a threshold has not
        queries = (layer.next_position() - layer.live_positions()).clamp(min=1)
        return layer.slot_stat(self.state_key) / queries

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return h2o_reference(lm, prompt, decode, budget, recent=round(budget * self.recent_ratio)), None
