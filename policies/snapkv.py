from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvbench.engine.attention import attention_probs
from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, Schedule, positive, register
from kvbench.policies.reference import Reference, snapkv_kept


@register
@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al. 2024): one snapshot of the prompt scored by its last `window` queries.

    An entry's score is its mean attention weight over the window's queries and the KV head's query heads (the
    paper's and kvpress's scale, which wrappers adding a constant rely on: CriticalKV's epsilon), pooled over
    neighbouring positions. With `pooling: avg` this is kvpress's SnapKVPress exactly (averaging commutes with
    its per-query-head pooling); `max` pools the group's mean, where kvpress has no max pooling.
    """

    name = "snapkv"
    colour = "#0072B2"
    threshold_scale = "mean attention weight of the window's queries, pooled (kvpress DMSPress over SnapKVPress)"
    schedule = Schedule.PREFILL
    needs_attention = True
    window: int = 32
    kernel: int = 7
    pooling: Literal["max", "avg"] = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("snapkv", window=self.window, kernel=self.kernel)
        if self.kernel % 2 == 0:
            raise KvbenchError(f"policy 'snapkv' parameter 'kernel' must be odd, got {self.kernel}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.window:
            raise KvbenchError(f"snapkv: budget {demand.budget} must exceed the observation window={self.window}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        if phase != "prefill":
            return
        window_queries = query[:, :, -self.window :]
        votes = layer.slot_stat(self.state_key)
        votes.zero_()
        for _, probs in attention_probs(window_queries, key, scaling, layer.padding(), layer.kind,
                                       layer.live_positions()):
            votes[..., : probs.shape[-1]] += probs.sum(dim=(2, 3))
        votes /= window_queries.shape[1] // key.shape[1] * window_queries.shape[2]  # a mean over the group and queries

    def score(self, layer, budget: int) -> torch.Tensor:
        # pool over neighbouring *positions* of the prefix (slots are not in position order after
        # evictions); the observation window itself is always kept
        order = layer.live_positions().argsort(dim=-1)
        votes = layer.slot_stat(self.state_key).gather(-1, order)
        batch, heads, n = votes.shape
        window = min(self.window, n)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        prefix = votes[..., : n - window].reshape(batch * heads, 1, n - window)
        pooled = pool(prefix, self.kernel, stride=1, padding=self.kernel // 2).reshape(batch, heads, n - window)
        ranked = torch.cat([pooled, votes.new_full((batch, heads, window), float("inf"))], dim=-1)
        return torch.empty_like(votes).scatter_(-1, order, ranked)

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return snapkv_kept(lm, prompt, budget, self.window, self.kernel, self.pooling)
