from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Schedule, Wrapper, recent_mask, register


@register
@dataclass
class AdaKV(Wrapper):
    """Ada-KV (Feng et al. 2024): a layer's heads share its budget by score, each keeping at least a floor."""

    name = "ada_kv"
    colour = "#DDCC77"
    schedule = Schedule.PREFILL
    needs_attention = True
    base: str | dict[str, Any] = "snapkv"  # whose scores (and layer budgets) are shared out: snapkv, pyramidkv
    alpha: float = 0.2  # floor: every head keeps int(alpha x (budget - window)) prefix entries besides its window
    decides = frozenset({"select"})  # its stage scores; the kept set is its own

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise KvbenchError(f"policy 'ada_kv' parameter 'alpha' must be in [0, 1], got {self.alpha}")
        self._stages = (self.build_stage(self.base),)
        if self._stages[0].schedule.when != "prefill" or not self._stages[0].needs_attention:
            raise KvbenchError(f"policy 'ada_kv': base '{self._stages[0].name}' must be a prefill-time attention "
                               "scorer (snapkv, pyramidkv)")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.chunked:  # later chunks would be scored against padding slots
            raise KvbenchError("policy 'ada_kv' compresses the prompt once: use prefill mode 'full'")

    def select(self, layer, budget: int) -> torch.Tensor:
        # FFY0/AdaKV's AdaptiveSnapKVCluster.update_kv_gqa (adaptive_snapkv/monkeypatch/snapkv_utils.py): each
        # head keeps its window; the prefix's heads x base best scores of the layer (base = budget - window)
        # are counted per head, and a head keeps its round(count x (1 - alpha) + int(base x alpha)) best
        stage = self.stage(layer.owner)
        scores = stage.score(layer, budget)
        batch, heads, n = scores.shape
        window = recent_mask(layer, stage.window)
        prefix = scores.masked_fill(window, float("-inf"))
        base = budget - stage.window
        best = prefix.reshape(batch, heads * n).topk(heads * base, dim=-1).indices // n
        counts = torch.zeros(batch, heads, dtype=torch.long, device=scores.device)
        counts.scatter_add_(-1, best, torch.ones_like(best))
        kept = torch.round(counts * (1 - self.alpha) + int(base * self.alpha)).long()  # float32, as official
        order = prefix.argsort(dim=-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))
        return window | (rank < kept[..., None])
