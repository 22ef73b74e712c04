from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.policies.base import PromptScorer, register, shares


@register
@dataclass
class KeyDiff(PromptScorer):
    """KeyDiff (Park et al. 2025): keep the keys least similar to their head's mean key; needs no attention.

    A key's score is minus its cosine similarity to the mean of the head's unit-length live keys (as kvpress's
    KeyDiffPress computes it, on the cached RoPE-rotated keys). The paper evicts block by block as the prompt
    arrives: that is `prefill: chunked`. Slots a head does not hold (a padded batch) are left out of the mean.
    """

    name = "keydiff"
    threshold_scale = "share of the head's key dissimilarity (1 - cosine to the mean key, over its sum)"

    def score(self, layer, budget: int) -> torch.Tensor:
        keys = layer.live_keys().float()
        unit = F.normalize(keys, dim=-1)
        if layer.padding() is not None:
            unit = unit.masked_fill(layer.padding()[..., None], 0.0)
        anchor = unit.mean(dim=2, keepdim=True)  # its scale does not change a cosine
        return -F.cosine_similarity(keys, anchor, dim=-1)

    def threshold_score(self, layer) -> torch.Tensor:
        # a cosine is in [-1, 1] on every prompt, but how many keys near the mean depends on the prompt: a share of
        # the head's total dissimilarity reads as an attention weight does
        return shares(1 + self.score(layer, layer.length), layer)
