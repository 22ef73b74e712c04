from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import BatchLimit, Rescorer, register


@register
@dataclass
class ChunkKV(Rescorer):
    """ChunkKV (Liu et al. 2025): whole chunks of `chunk` consecutive tokens, ranked by a base policy's scores.

    The live entries, in position order, are cut into chunks; a chunk's score is its entries' mean base score
    summed over the layer's KV heads, so every head keeps the same chunks (as kvpress's ChunkKVPress). The
    base's protected entries (SnapKV's window) stay and do not count in their chunk's mean. The best chunks
    are kept whole, equal chunks the later first, and the budget is filled: the last chunk taken keeps its first
    entries, so ChunkKV holds exactly the bytes of any other policy at the same budget.

    `whole_chunks: true` is kvpress's ChunkKVPress instead: only whole chunks, max(1, int(chunks x budget /
    entries)) of them (the remainder a chunk of its own), which may hold up to a chunk fewer or more entries than
    the budget; the base's protected entries count in their chunk's mean as the layer's best score + 1 (as
    kvpress's SnapKV pads its window), so they are kept only as their chunks are. Prefill-time bases only.
    """

    name = "chunkkv"
    chunk: int = 10
    whole_chunks: bool = False
    decides = frozenset({"score", "select"})

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise KvbenchError(f"policy 'chunkkv' parameter 'chunk' must be at least 1, got {self.chunk}")
        super().__post_init__()
        if self.whole_chunks and self.schedule.decodes:
            raise KvbenchError(f"policy 'chunkkv': whole_chunks compresses the prompt once; base "
                               f"'{self._stages[0].name}' evicts while decoding")

    def batch_limits(self) -> list[BatchLimit]:
        if not self.schedule.decodes:  # a batch hands it each row's prompt as the row holds it alone
            return super().batch_limits()
        return [*super().batch_limits(), BatchLimit("equal", "policy 'chunkkv' cuts chunks from the slots in position "
                                                             "order, a row's padding included, while decoding")]

    def score(self, layer, budget: int) -> torch.Tensor:
        scores, order = self._base_scores(layer, budget)
        kept = scores == float("inf")
        chunk_of, ranked_chunks = self._ranked_chunks(scores.masked_fill(kept, 0), (~kept).float())
        index = torch.arange(scores.shape[-1], device=scores.device)
        ranked = ranked_chunks.gather(-1, chunk_of) + (self.chunk - 1 - index % self.chunk) / self.chunk
        return torch.empty_like(ranked).scatter_(-1, order, ranked.masked_fill(kept, float("inf")))

    def select(self, layer, budget: int) -> torch.Tensor | None:
        if not self.whole_chunks:
            return None
        scores, order = self._base_scores(layer, budget)
        protected = scores == float("inf")
        best = scores.masked_fill(protected, float("-inf")).amax(dim=(1, 2), keepdim=True)
        chunk_of, ranked_chunks = self._ranked_chunks(torch.where(protected, best + 1, scores),
                                                      torch.ones_like(scores))
        count = ranked_chunks.shape[-1]
        taken = max(1, int(count * budget / scores.shape[-1]))
        keep = ranked_chunks.gather(-1, chunk_of) >= count - taken
        return torch.empty_like(keep).scatter_(-1, order, keep)

    def _base_scores(self, layer, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's float scores `[B, heads, n]` in position order, and that order."""
        order = layer.live_positions().argsort(dim=-1)
        return self.stage(layer.owner).score(layer, budget).float().gather(-1, order), order

    def _ranked_chunks(self, scores: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's chunk, and each chunk's rank `[B, heads, chunks]` (0 the worst, the same for every head)
        by its mean score over `weights` summed over the heads; equal chunks: the later ranks higher."""
        index = torch.arange(scores.shape[-1], device=scores.device)
        chunk_of = (index // self.chunk).expand_as(scores)
        count = -(-scores.shape[-1] // self.chunk)
        total = scores.new_zeros(scores.shape[:2] + (count,)).scatter_add_(-1, chunk_of, scores)
        size = torch.zeros_like(total).scatter_add_(-1, chunk_of, weights)
        chunks = (total / size.clamp_min(1)).sum(dim=1, keepdim=True).expand_as(total)
        return chunk_of, chunks.argsort(dim=-1, stable=True).argsort(dim=-1)
