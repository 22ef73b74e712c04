from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.attention import attention_probs, query_visible, query_weights, window_visible
from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, positive, protect, recent_mask, register


@register
@dataclass
class Scissorhands(Policy):
    """Scissorhands (Liu et al. 2023): evict the entries most often unimportant over the last `history` queries."""

    name = "scissorhands"
    colour = "#AA4499"
    needs_attention = True
    history: int = 32  # queries whose verdicts count
    recent: int = 16  # the newest entries are never evicted

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("scissorhands", history=self.history)
        if self.recent < 0:
            raise KvbenchError(f"policy 'scissorhands' parameter 'recent' must be >= 0, got {self.recent}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.recent:
            raise KvbenchError(f"scissorhands: budget {demand.budget} must exceed recent={self.recent}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        # an entry is "unimportant" to a query when it gets less than 1/(entries the query sees) of its
        # attention; each query's verdicts go to column (its position mod history) of a per-slot ring,
        # so the ring always holds the verdicts of the last `history` queries (the newest `count` positions are
        # consecutive: their columns are distinct)
        ring = layer.slot_stat(self.state_key, width=self.history, dtype=torch.bool)
        if query.shape[2] == 1:  # a decode step: wherever the new entry's slot is
            visible = query_visible(layer)
            weights = query_weights(layer, query, key, scaling).mean(dim=2)
            seen_by = visible.sum(dim=-1, keepdim=True)
            unimportant = (weights < 1.0 / seen_by.to(weights.dtype)) & visible
            column = (layer.next_position() - 1) % self.history  # the query's position, per row in a batch
            index = column[..., None] if torch.is_tensor(column) else torch.tensor(column, device=ring.device)
            ring.scatter_(-1, index.expand(*ring.shape[:3], 1), unimportant[..., None])
            return
        count = min(self.history, query.shape[2])
        n = key.shape[2]
        weights = key.new_zeros((key.shape[0], key.shape[1], count, n), dtype=torch.float32)
        for start, probs in attention_probs(query[:, :, -count:], key, scaling, layer.padding(),
                                            layer.kind, layer.live_positions()):
            # each KV head's query heads averaged; chunks see up to their last query's slot
            weights[:, :, start : start + probs.shape[3], : probs.shape[-1]] = probs.mean(dim=2)
        seen_by = torch.arange(n - count, n, device=key.device) + 1  # entries the i-th query sees
        visible = torch.arange(n, device=key.device)[None, :] < seen_by[:, None]
        if layer.kind.window is not None:  # a sliding layer's query sees only its window
            positions = layer.live_positions()
            visible = visible & window_visible(positions, positions[..., n - count :], layer.kind.window)
            seen_by = visible.sum(dim=-1)
        padding = layer.padding()
        if padding is not None:  # a batch's padding: no entry to see, and a padding query gives no verdict
            visible = visible & ~padding[:, :, None, :] & ~padding[:, :, n - count :, None]
            seen_by = visible.sum(dim=-1)
        unimportant = (weights < 1.0 / seen_by[..., None].to(weights.dtype)) & visible
        # the queries are the newest slots; their positions name their columns (a row's own, in a batch)
        columns = layer.live_positions()[..., n - count :] % self.history  # [B, heads, count]
        ring.scatter_(-1, columns[:, :, None, :].expand(-1, -1, n, -1), unimportant.transpose(-1, -2))

    def score(self, layer, budget: int) -> torch.Tensor:
        counts = layer.slot_stat(self.state_key, width=self.history, dtype=torch.bool).sum(dim=-1)
        # most often unimportant goes first; among equals, the oldest
        scores = -counts.double() + layer.live_positions().double() / (layer.next_position() + 1)
        return protect(scores, recent_mask(layer, self.recent))
