from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import BatchLimit, Demand, Merging, protect, recent_mask, register


@register
@dataclass
class Merge(Merging):
    """Merging instead of dropping: apart from the first `sinks` and the `recent` newest entries, the
    entries that stand for the fewest tokens (the oldest among equals) are averaged into a kept one,
    weighted by the tokens each stands for: the next newer kept entry (`pool`, hierarchical pooling of
    neighbours) or the kept entry whose key is most similar (`similar`, CaM-style). Every token seen
    stays represented in some entry."""

    name = "merge"
    colour = "#88CCEE"
    family = "compression"
    recent: int = 32
    sinks: int = 4  # the first tokens stay unmerged: attention sinks (StreamingLLM) lose their role when averaged
    target: Literal["pool", "similar"] = "pool"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.storage is not None:
            raise KvbenchError("policy 'merge' averages entries in the model dtype; it takes no storage")
        if self.recent < 0 or self.sinks < 0 or self.target not in ("pool", "similar"):
            raise KvbenchError(f"policy 'merge': recent >= 0, sinks >= 0 and target pool or similar, got "
                               f"{self.recent}, {self.sinks}, '{self.target}'")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.recent + self.sinks:
            raise KvbenchError(f"merge: budget {demand.budget} must exceed recent + sinks = {self.recent + self.sinks}")

    def batch_limits(self) -> list[BatchLimit]:
        # its folds write into entries by slot: a row's padding would be folded in like its tokens
        return [BatchLimit("equal", "policy 'merge' folds evicted entries into kept ones slot by slot")]

    def score(self, layer, budget: int) -> torch.Tensor:
        merged = layer.slot_stat(self.state_key)  # tokens folded into each entry besides its own
        # fewest tokens first, then the oldest: repeated merging pools neighbours evenly (1+1, 2+2, ...)
        order = merged * (layer.seen + 1) + layer.live_positions() / (layer.seen + 1)
        kept = recent_mask(layer, self.recent) | (layer.live_positions() < self.sinks)
        return protect(order.double(), kept)

    def fold(self, layer, evicted: torch.Tensor) -> None:
        keep = torch.ones(layer.positions.shape[:2] + (layer.length,), dtype=torch.bool, device=evicted.device)
        keep.scatter_(-1, evicted, False)
        targets = self._targets(layer, evicted, keep)
        weights = 1.0 + layer.slot_stat(self.state_key).double()  # tokens each entry stands for
        moving = weights.gather(-1, evicted)
        total = weights.scatter_add(-1, targets, moving)
        for buffer in (layer.keys, layer.values):
            live = buffer[:, :, : layer.length]
            summed = (live.double() * weights[..., None]).scatter_add(
                2, targets[..., None].expand(-1, -1, -1, live.shape[-1]),
                live.double().gather(2, evicted[..., None].expand(-1, -1, -1, live.shape[-1])) * moving[..., None])
            live.copy_((summed / total[..., None]).to(live.dtype))
        layer.slot_stat(self.state_key).copy_((total - 1).float())

    def _targets(self, layer, evicted: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """For each evicted slot, the kept slot it folds into `[batch, heads, e]`."""
        if self.target == "similar":
            keys = torch.nn.functional.normalize(layer.live_keys().float(), dim=-1)
            gone = keys.gather(2, evicted[..., None].expand(-1, -1, -1, keys.shape[-1]))
            similarity = (gone @ keys.transpose(-1, -2)).masked_fill(~keep[:, :, None, :], float("-inf"))
            return similarity.argmax(-1)
        # the next newer kept entry (the recent ones are kept, so there always is one)
        positions = layer.live_positions()
        ordered, slots = positions.masked_fill(~keep, torch.iinfo(torch.long).max).sort(dim=-1)
        after = torch.searchsorted(ordered, positions.gather(-1, evicted).contiguous(), right=True)
        return slots.gather(-1, after.clamp(max=int(keep.sum(-1).min()) - 1))
