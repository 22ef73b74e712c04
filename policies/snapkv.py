from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvbench.attention import attention_probs
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, positive, protect, recent_mask, register


@register
@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al. 2024): one snapshot of the prompt scored by its last `window` queries."""

    name = "snapkv"
    phases = ("prefill",)
    needs_attention = True
    window: int = 32
    kernel: int = 7
    pooling: Literal["max", "avg"] = "max"

    def __post_init__(self) -> None:
        positive("snapkv", window=self.window, kernel=self.kernel)
        if self.kernel % 2 == 0:
            raise KvbenchError(f"policy 'snapkv' parameter 'kernel' must be odd, got {self.kernel}")

    def check_budget(self, budget: int) -> None:
        if budget <= self.window:
            raise KvbenchError(f"snapkv: budget {budget} must exceed the observation window={self.window}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        if phase != "prefill":
            return
        window_queries = query[:, :, -self.window :]
        votes = layer.slot_stat("snapkv")
        votes.zero_()
        for _, probs in attention_probs(window_queries, key, scaling):
            votes[..., : probs.shape[-1]] += probs.sum(dim=(2, 3))

    def score(self, layer, budget: int) -> torch.Tensor:
        # pool over neighbouring *positions*: slots are not stored in position order after evictions
        order = layer.live_positions().argsort(dim=-1)
        votes = layer.slot_stat("snapkv").gather(-1, order)
        batch, heads, n = votes.shape
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        pooled = pool(votes.reshape(batch * heads, 1, n), self.kernel, stride=1, padding=self.kernel // 2)
        scores = torch.empty_like(votes).scatter_(-1, order, pooled.reshape(batch, heads, n))
        return protect(scores, recent_mask(layer, self.window))
