from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Wrapper, register


@register
@dataclass
class AdaKV(Wrapper):
    """Ada-KV (Feng et al. 2024): a layer's heads share its budget by score, each keeping at least a floor."""

    name = "ada_kv"
    phases = ("prefill",)
    needs_attention = True
    base: str | dict[str, Any] = "snapkv"  # whose scores (and layer budgets) are shared out: snapkv, pyramidkv
    alpha: float = 0.2  # floor: every head keeps at least alpha x budget entries (its window counts)
    decides = frozenset({"select"})  # its stage scores; the kept set is its own

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise KvbenchError(f"policy 'ada_kv' parameter 'alpha' must be in [0, 1], got {self.alpha}")
        self._stages = (self.build_stage(self.base),)
        if self._stages[0].phases != ("prefill",) or not self._stages[0].needs_attention:
            raise KvbenchError(f"policy 'ada_kv': base '{self._stages[0].name}' must be a prefill-time attention "
                               "scorer (snapkv, pyramidkv)")

    def check_settings(self, chunked: bool) -> None:
        super().check_settings(chunked)
        if chunked:  # later chunks would be scored against padding slots
            raise KvbenchError("policy 'ada_kv' compresses the prompt once: use prefill mode 'full'")

    def select(self, layer, budget: int) -> torch.Tensor:
        # the top `floor` of each head are guaranteed; the rest of heads x budget goes to the best scores of
        # any head: flattened top-k over the layer
        scores = self.stage(layer.owner).score(layer, budget)
        batch, heads, n = scores.shape
        floor = min(round(self.alpha * budget), budget)
        guaranteed = torch.zeros_like(scores, dtype=torch.bool)
        if floor:
            guaranteed.scatter_(-1, scores.topk(floor, dim=-1).indices, True)
        ranked = scores.masked_fill(guaranteed, float("inf")).reshape(batch, heads * n)
        keep = torch.zeros_like(ranked, dtype=torch.bool)
        keep.scatter_(-1, ranked.topk(heads * budget, dim=-1).indices, True)
        return keep.view(batch, heads, n)
