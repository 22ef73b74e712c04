from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.paging import Pages
from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Sparse, positive, register


@register
@dataclass
class Quest(Sparse):
    """Quest (Tang et al. 2024): query-aware sparse reading of a cache that keeps every entry.

    Keys are grouped in pages of `page_size` tokens by position; each page is summarised by its keys' per-channel
    min and max. At a decode step each query head scores a page by the upper bound of its attention logits,
    sum_c max(q_c * min_c, q_c * max_c), and attends to the top pages only: `budget // page_size` pages, the page
    being written always among them, as the official kernels count it (quest/utils/controller.py: `page_budget`
    includes the last page, top-k runs over the others). A query head chooses its own pages, as the official
    evaluation code does for grouped-query models (it repeats the KV heads). The prompt is read densely, and so
    are the first `dense_layers` layers and a sequence that fits the budget (the official code skips 2 layers).
    """

    name = "quest"
    colour = "#CC3311"  # Paul Tol's vibrant red: the sparse family, beyond the two palettes
    page_size: int = 16
    dense_layers: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self.name, page_size=self.page_size)
        if self.dense_layers < 0:
            raise KvbenchError(f"policy 'quest' parameter 'dense_layers' must be at least 0, got {self.dense_layers}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget < self.page_size:
            raise KvbenchError(f"quest: budget {demand.budget} tokens is less than one page "
                               f"(page_size={self.page_size})")

    def read_mask(self, layer, query: torch.Tensor, budget: int) -> torch.Tensor | None:
        pages = Pages.of(layer, self.page_size)
        page_budget = budget // self.page_size
        if layer.layer_idx < self.dense_layers or pages.count <= page_budget:
            return None
        keys = layer.live_keys().float()
        low, high = pages.min_max(keys)  # [batch, kv_heads, pages, dim]
        batch, kv_heads = keys.shape[:2]
        q = query[:, :, 0].float().view(batch, kv_heads, -1, 1, keys.shape[-1])  # [batch, kv_heads, group, 1, dim]
        bound = torch.maximum(q * low[:, :, None], q * high[:, :, None]).sum(dim=-1)  # [batch, kv_heads, group, pages]
        bound = bound.masked_fill(pages.last(), float("inf"))
        bound = bound.masked_fill(pages.missing(), float("-inf"))
        top = bound.topk(page_budget, dim=-1).indices
        chosen = torch.zeros_like(bound, dtype=torch.bool).scatter_(-1, top, True)
        return pages.slots(chosen).flatten(1, 2)  # [batch, heads, length]
