from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.attention import attention_received
from kvbench.errors import KvbenchError
from kvbench.policies.base import BatchLimit, Demand, Policy, protect, register


@register
@dataclass
class SimLayerKV(Policy):
    """SimLayerKV (Zhang et al. 2024, arXiv 2410.13846; kvpress's SimLayerKVPress): a "lazy" layer keeps only its
    first and its most recent tokens, every other layer keeps all of them.

    The budget is a lazy layer's size: its `n_initial` first tokens and its newest `budget - n_initial` (kvpress's
    kept set with `n_recent` = budget - n_initial + n_last, so kvpress's default n_recent=1024 is a budget of 1027
    here). A layer is lazy when the attention of the last `n_last` prompt queries, averaged over them and over the
    layer's query heads, puts more than `lazy_threshold` on the first `n_initial` tokens and the `n_recent` tokens
    before those queries, and the prompt is longer than n_initial + n_recent + n_last (kvpress's criterion; its
    default threshold 1.0 makes no layer lazy, the paper's recommended ones are 0.9 for Llama-3, 0.65 Llama-2, 0.8
    Mistral, 0.85 Qwen). The share of lazy layers is an outcome, so the cache ratio a record shows is too. While
    decoding, a lazy layer keeps its first and newest tokens (the paper's SimLayerKV-decode keeps its window);
    the other layers grow. kvpress decides over a whole batch at once; here each sequence decides alone.
    """

    name = "simlayerkv"
    needs_attention = True
    lazy_threshold: float = 1.0
    n_last: int = 1  # the last prompt queries whose attention decides (kvpress: 1, as the paper's decode variant)
    n_initial: int = 4  # the sink tokens a lazy layer keeps

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lazy_threshold <= 1.0:
            raise KvbenchError(f"policy 'simlayerkv' parameter 'lazy_threshold' must be in [0, 1], got "
                               f"{self.lazy_threshold}")
        if self.n_last < 1:
            raise KvbenchError(f"policy 'simlayerkv' parameter 'n_last' must be at least 1, got {self.n_last}")
        if self.n_initial < 0:
            raise KvbenchError(f"policy 'simlayerkv' parameter 'n_initial' must be >= 0, got {self.n_initial}")

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.n_initial:
            raise KvbenchError(f"simlayerkv: budget {demand.budget} leaves a lazy layer no recent token beyond "
                               f"n_initial={self.n_initial}")
        if demand.chunked:  # a layer is judged once, by the last queries of the whole prompt
            raise KvbenchError("policy 'simlayerkv' judges each layer by the whole prompt: use prefill mode 'full'")

    def batch_limits(self) -> list[BatchLimit]:
        return [BatchLimit("alone", "policy 'simlayerkv' judges the layers of each sequence alone: a batch's rows "
                                    "would keep different layers whole")]

    def observe(self, layer, query, key, scaling, phase) -> None:
        if phase != "prefill":
            return
        last = query[:, :, -self.n_last :]
        received = attention_received(last, key, scaling, layer.padding(), layer.kind, layer.live_positions())
        layer.slot_stat(self.state_key).copy_(received / last.shape[2])  # the mean over the queries too

    def after_prompt(self, session, prompt: torch.Tensor) -> None:
        cache = session.cache
        if cache.budget is None:
            return
        for layer, budget in zip(cache.layers, cache.layer_budgets, strict=True):
            layer.layer_stats[self.state_key] = self._lazy(layer, budget)

    def _lazy(self, layer, budget: int) -> bool:
        """Whether the last prompt queries put more than `lazy_threshold` of their attention on what a lazy layer
        keeps: the sinks and the `n_recent` tokens before them."""
        recent = budget - self.n_initial + self.n_last  # kvpress's n_recent
        seen = layer.next_position()  # one sequence at a time (`batch_limits`)
        if self.lazy_threshold == 1.0 or seen <= self.n_initial + recent + self.n_last:
            return False  # kvpress: a threshold of 1 or a prompt no longer than what a lazy layer keeps
        positions = layer.live_positions()
        before_last = seen - self.n_last
        watched = (positions < self.n_initial) | ((positions >= before_last - recent) & (positions < before_last))
        share = (layer.slot_stat(self.state_key) * watched).sum(dim=-1).mean()  # over every query head
        return bool(share > self.lazy_threshold)

    def bounded(self, layer) -> bool:
        return layer.layer_stats.get(self.state_key, True)  # undecided until the prompt is in

    def score(self, layer, budget: int) -> torch.Tensor:
        positions = layer.live_positions()  # a lazy layer: the sinks, then the newest
        return protect(positions.float(), positions < self.n_initial)
