from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.attention import query_weights
from kvbench.policies.base import Policy, register
from kvbench.policies.reference import Reference, tova_reference


@register
@dataclass
class TOVA(Policy):
    """TOVA (Oren et al. 2024): evict the entry the newest query attends to least, averaged over the layer's heads."""

    name = "tova"
    colour = "#882255"
    threshold_scale = "the newest query's attention weight (averaged over the layer's heads, or the KV head's)"
    needs_attention = True
    per_head: bool = False  # one choice per KV head (its query heads averaged) instead of one per layer

    def observe(self, layer, query, key, scaling, phase) -> None:
        weights = query_weights(layer, query, key, scaling).mean(dim=2)  # [B, kv, n]
        if not self.per_head:
            weights = weights.mean(dim=1, keepdim=True).expand_as(weights)
        layer.slot_stat(self.state_key).copy_(weights)

    def score(self, layer, budget: int) -> torch.Tensor:
        return layer.slot_stat(self.state_key)

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return tova_reference(lm, prompt, decode, budget, per_head=self.per_head), None
