from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.policies.base import PromptScorer, register, shares
from kvbench.policies.reference import Reference, knorm_kept


@register
@dataclass
class KeyNorm(PromptScorer):
    """Key norm (Devoto et al. 2024): keep the entries whose keys have the lowest L2 norm; needs no attention."""

    name = "knorm"
    colour = "#117733"
    threshold_scale = "share of the head's inverse key norm (1/||k|| over its sum)"

    def score(self, layer, budget: int) -> torch.Tensor:
        # RoPE rotates pairs of key dimensions, so the cached (rotated) keys have the original norms
        return -layer.live_keys().float().norm(dim=-1)

    def threshold_score(self, layer) -> torch.Tensor:
        # a key norm's scale is the model's and the layer's: its inverse's share of the head's sum is not
        return shares(1 / layer.live_keys().float().norm(dim=-1), layer)

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return knorm_kept(lm, prompt, budget)
