from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, Schedule, register


@register
@dataclass
class LagKV(Policy):
    """LagKV (Liang et al. 2025): each partition of `lag_size` tokens keeps its best share, judged against the
    next partition; needs no attention.

    After the `sink_size` sinks, the live entries in position order are cut into partitions of `lag_size`; the
    last whole one (the last reference) and the remainder after it stay. A token elsewhere scores the std over
    channels of its key, min-max normalised by the next partition's per-channel range and softmaxed over its
    partition, averaged with the same for its value (kvpress's LagKVPress). Each partition keeps an equal share
    of its best (kvpress ranks within partitions), a leftover place going to the latest; `cross_scoring` lets
    the softmaxed scores compete across partitions. Beyond kvpress: sinks and the most recent tokens stay when
    nothing can be scored or the budget cannot hold the sinks and the tail (up to 2 x lag_size - 1 tokens); a
    channel with no range divides by 1e-6, not 0; a chunked prefill re-partitions what is left (not the paper's
    once-per-partition recursion); a padded batch's padding counts as its row's first tokens.
    """

    name = "lagkv"
    schedule = Schedule.PREFILL
    sink_size: int = 4
    lag_size: int = 128
    cross_scoring: bool = False  # compare the partitions' scores across partitions, not rank within each

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.storage is not None:  # its scores read the values, which a compressed layer does not expose
            raise KvbenchError("policy 'lagkv' scores the stored values; it takes no storage")
        if self.sink_size < 0:
            raise KvbenchError(f"policy 'lagkv' parameter 'sink_size' must be >= 0, got {self.sink_size}")
        if self.lag_size < 2:
            raise KvbenchError(f"policy 'lagkv' parameter 'lag_size' must be at least 2, got {self.lag_size}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.sink_size:
            raise KvbenchError(f"lagkv: budget {demand.budget} leaves no room beyond sink_size={self.sink_size}")

    def score(self, layer, budget: int) -> torch.Tensor:
        order = layer.live_positions().argsort(dim=-1)
        keys = layer.live_keys().float()
        values = layer.values[:, :, : layer.length].float()
        batch, heads, n, dim = keys.shape
        keys, values = (x.gather(2, order[..., None].expand(-1, -1, -1, dim)) for x in (keys, values))
        # in position order: the unscored tail above any partition score (< lag_size <= n), the newest highest
        ranked = torch.arange(n, 2 * n, dtype=torch.float32, device=keys.device).repeat(batch, heads, 1)
        ranked[..., : self.sink_size] = float("inf")
        parts, lag = max((n - self.sink_size) // self.lag_size - 1, 0), self.lag_size
        if parts:
            end = self.sink_size + parts * lag
            scored = [x[:, :, self.sink_size : end + lag].reshape(batch, heads, parts + 1, lag, dim)
                      for x in (keys, values)]
            score = (_lag_score(scored[0]) + _lag_score(scored[1])) / 2  # [batch, heads, parts, lag]
            if not self.cross_scoring:  # rank in the partition; equal ranks: the later partition first
                score = score.argsort(dim=-1).argsort(dim=-1) + torch.arange(parts, device=keys.device)[:, None] / parts
            ranked[..., self.sink_size : end] = score.reshape(batch, heads, parts * lag)
        return torch.empty_like(ranked).scatter_(-1, order, ranked)


def _lag_score(states: torch.Tensor) -> torch.Tensor:
    """`[..., parts + 1, lag, dim]` -> `[..., parts, lag]`: each partition's tokens against the next's range."""
    reference = states[:, :, 1:]
    low, high = reference.amin(dim=-2, keepdim=True), reference.amax(dim=-2, keepdim=True)
    normalised = (states[:, :, :-1] - low) / (high - low).clamp_min(1e-6)
    return normalised.std(dim=-1).softmax(dim=-1)
