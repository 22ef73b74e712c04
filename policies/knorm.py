from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.policies.base import PromptScorer, register


@register
@dataclass
class KeyNorm(PromptScorer):
    """Key norm (Devoto et al. 2024): keep the entries whose keys have the lowest L2 norm; needs no attention."""

    name = "knorm"

    def score(self, layer, budget: int) -> torch.Tensor:
        # RoPE rotates pairs of key dimensions, so the cached (rotated) keys have the original norms
        return -layer.live_keys().float().norm(dim=-1)
