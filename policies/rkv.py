from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.engine.attention import queries_per_chunk
from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, positive, protect, recent_mask, register


@dataclass
class QueryWindow:
    """A layer's newest `window` queries `[B, heads, <= window, D]` (after RoPE, as the attention saw them) and the
    attention's scaling."""

    queries: torch.Tensor
    scaling: float


@register
@dataclass
class RKV(Policy):
    """R-KV (Cai et al. 2025, arXiv 2505.24133; the official Zefan-Cai/R-KV, rkv/compression/r1_kv.py): compresses a
    long generation every `buffer` tokens, keeping the entries that are important and not redundant.

    Importance: the attention of the newest `window` queries to the entries outside the window, their logits maxed
    over a KV head's query heads before the softmax (the official `compute_attention_scores`), averaged over the
    queries and max-pooled over `kernel` neighbouring positions (SnapKV's pooling). Redundancy: each key's cosine
    similarity to the head's other keys averaged over them and softmaxed over the entries, where the pair of a key
    with its newest key more similar than `similarity_threshold` counts 0 (with none such, the pair with the oldest
    entry does: the official `cal_similarity`, retain_direction "last"). An entry scores
    mix_lambda x importance - (1 - mix_lambda) x redundancy; the window is always kept, the rest by score.
    The prompt is compressed too, and then again once `buffer` tokens arrived beyond the budget (the cache holds
    budget + buffer at most); defaults are the official code's (run_math.py, r1_kv.py: window 8, kernel 7,
    mix_lambda 0.07, buffer (divide_length) 128, threshold 0.5).
    Where it differs: the official compresses when the sequence length is a multiple of the buffer, so its first
    compression after the prompt may come sooner; its entries are in the order its top-k left them after the
    first compression, so its pooling neighbours and "newest" similar key follow that order, where here they
    follow positions (as the paper describes and at the first compression both agree); its scores are in the
    model dtype, here in float32; on a sliding-window layer the softmax spans every held entry.
    """

    name = "rkv"
    needs_attention = True
    window: int = 8
    kernel: int = 7
    mix_lambda: float = 0.07
    buffer: int = 128
    similarity_threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("rkv", window=self.window, kernel=self.kernel, buffer=self.buffer)
        if self.kernel % 2 == 0:
            raise KvbenchError(f"policy 'rkv' parameter 'kernel' must be odd, got {self.kernel}")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise KvbenchError(f"policy 'rkv' parameter 'mix_lambda' must be in [0, 1], got {self.mix_lambda}")
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise KvbenchError(f"policy 'rkv' parameter 'similarity_threshold' must be in [0, 1], got "
                               f"{self.similarity_threshold}")
        self.schedule = self.schedule.each(self.buffer)  # type: ignore[misc]

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.window:
            raise KvbenchError(f"rkv: budget {demand.budget} must exceed the observation window={self.window}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        held = layer.layer_stats.get(self.state_key)
        newest = query if held is None else torch.cat([held.queries, query], dim=2)
        layer.layer_stats[self.state_key] = QueryWindow(newest[:, :, -self.window :], scaling)

    def score(self, layer, budget: int) -> torch.Tensor:
        padding = layer.padding()
        held = torch.ones_like(layer.live_positions(), dtype=torch.bool) if padding is None else ~padding
        window = recent_mask(layer, self.window) & held
        keys = layer.live_keys().float()
        scores = (self.mix_lambda * self._importance(layer, keys, window | ~held)
                  - (1 - self.mix_lambda) * self._redundancy(layer, keys, held))
        return protect(scores, window)

    def _importance(self, layer, keys: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, kv_heads, n]`: the window queries' attention to the entries not `hidden`, pooled over positions."""
        stats = layer.layer_stats[self.state_key]
        batch, kv_heads, n, dim = keys.shape
        queries = stats.queries.float()
        queries = queries.view(batch, kv_heads, -1, queries.shape[2], dim)  # [B, kv, group, window, D]
        logits = torch.einsum("bkgqd,bknd->bkgqn", queries, keys).amax(dim=2) * stats.scaling
        probs = logits.masked_fill(hidden[:, :, None], float("-inf")).softmax(dim=-1).nan_to_num(0.0).mean(dim=2)
        # pooled over neighbouring positions of the scored entries (in slot order after evictions; the hidden ones,
        # at zero, go last: a max over attention weights never picks them)
        order = layer.live_positions().masked_fill(hidden, torch.iinfo(torch.long).max).argsort(dim=-1)
        pooled = F.max_pool1d(probs.gather(-1, order).reshape(batch * kv_heads, 1, n), self.kernel, stride=1,
                              padding=self.kernel // 2).reshape(batch, kv_heads, n)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)

    def _redundancy(self, layer, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """`[B, kv_heads, n]`: each held key's mean cosine similarity to the held keys, softmaxed over them; a key's
        similarity to itself and to the key it is "retained" by count 0. In blocks of keys, bounded in memory."""
        batch, kv_heads, n, _ = keys.shape
        unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        positions = layer.live_positions()
        oldest = positions.masked_fill(~held, torch.iinfo(torch.long).max).argmin(dim=-1, keepdim=True)  # [B, kv, 1]
        total = keys.new_zeros(batch, kv_heads, n)
        block = queries_per_chunk(batch, kv_heads, n, n, keys.device)
        for start in range(0, n, block):
            rows = torch.arange(start, min(n, start + block), device=keys.device)
            similarity = unit[:, :, rows] @ unit.transpose(-1, -2)  # [B, kv, rows, n]
            similarity[..., torch.arange(len(rows), device=keys.device), rows] = 0.0
            similarity = similarity.masked_fill(~(held[:, :, rows, None] & held[:, :, None, :]), 0.0)
            similar = similarity > self.similarity_threshold
            newest = positions[:, :, None, :].masked_fill(~similar, -1).argmax(dim=-1, keepdim=True)
            retained = torch.where(similar.any(dim=-1, keepdim=True), newest, oldest[..., None])
            total += similarity.scatter(-1, retained, 0.0).sum(dim=2)
        mean = total / held.sum(dim=-1, keepdim=True)
        return mean.masked_fill(~held, float("-inf")).softmax(dim=-1)
