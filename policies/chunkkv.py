from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Rescorer, register


@register
@dataclass
class ChunkKV(Rescorer):
    """ChunkKV (Liu et al. 2025): whole chunks of `chunk` consecutive tokens, ranked by a base policy's scores.

    The live entries, in position order, are cut into chunks; a chunk's score is its entries' mean base score
    summed over the layer's KV heads, so every head keeps the same chunks (as kvpress's ChunkKVPress). The
    base's protected entries (SnapKV's window) stay and do not count in their chunk's mean. The best chunks
    are kept whole, equal chunks the later first; unlike kvpress, which keeps only whole chunks, the budget
    is filled: the last chunk taken keeps its first entries. Its phases are its base's.
    """

    name = "chunkkv"
    chunk: int = 10

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise KvbenchError(f"policy 'chunkkv' parameter 'chunk' must be at least 1, got {self.chunk}")
        super().__post_init__()

    def score(self, layer, budget: int) -> torch.Tensor:
        order = layer.live_positions().argsort(dim=-1)
        scores = self.stage(layer.owner).score(layer, budget).float().gather(-1, order)
        kept = scores == float("inf")
        index = torch.arange(scores.shape[-1], device=scores.device)
        chunk_of = (index // self.chunk).expand_as(scores)
        count = -(-scores.shape[-1] // self.chunk)
        total = scores.new_zeros(scores.shape[:2] + (count,)).scatter_add_(-1, chunk_of, scores.masked_fill(kept, 0))
        size = torch.zeros_like(total).scatter_add_(-1, chunk_of, (~kept).float())
        chunks = (total / size.clamp_min(1)).sum(dim=1, keepdim=True).expand_as(total)
        rank = chunks.argsort(dim=-1, stable=True).argsort(dim=-1)  # equal chunks: the later ranks higher
        ranked = rank.gather(-1, chunk_of) + (self.chunk - 1 - index % self.chunk) / self.chunk
        return torch.empty_like(ranked).scatter_(-1, order, ranked.masked_fill(kept, float("inf")))
