from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import Rescorer, register


@register
@dataclass
class CriticalKV(Rescorer):
    """CriticalKV (Feng et al. 2025): a base policy's scores corrected by what an entry adds to the output.

    Two stages: the base's `int(first_stage_ratio x budget)` best entries per head are kept outright; the rest of
    the budget goes to the best of (base score + `epsilon`) x ||W_o v||_1, the L1 norm of the entry's value through
    each query head's slice of the output projection, averaged over the KV head's query heads. `epsilon` is added
    on the base's own scale (SnapKV's mean attention weight), so it weighs as the paper and the official code
    weigh it. Entries the base protects (a window) stay protected. Its schedule is its base's.

    What it follows: the authors' code (FFY0/AdaKV-in-NVIDIA-kvpress, branch criticalkv,
    `CriticalKVPress.score`) and kvpress 0.5.5's CriticalKVPress, which agree but for details of tiny budgets:
    the official SnapKV pads its window with the prefix's best score, so window entries compete in the second
    stage when the first is smaller than the window (kvpress pads with best + 1; kvbench protects them, the
    window being SnapKV's own); kvpress floors a first stage of zero entries at one, kvbench keeps the official
    zero. The first stage's size comes from the budget in entries, where both compute `int((1 - ratio) x prompt
    x first_stage_ratio)` from a ratio (the same count for a whole-number budget).
    """

    name = "criticalkv"
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.first_stage_ratio <= 1.0 or self.epsilon < 0:
            raise KvbenchError("policy 'criticalkv' needs first_stage_ratio in [0, 1] and epsilon >= 0")
        super().__post_init__()

    def score(self, layer, budget: int) -> torch.Tensor:
        scores = self.stage(layer.owner).score(layer, budget).float()
        first = scores.topk(min(int(budget * self.first_stage_ratio), scores.shape[-1]), dim=-1).indices
        corrected = (scores + self.epsilon) * projected_value_norm(layer)
        return corrected.scatter(-1, first, float("inf"))


def projected_value_norm(layer) -> torch.Tensor:
    """||W_o^h v||_1 of each live entry for each query head h of its KV head, averaged over those heads:
    `[B, kv_heads, n]`. One query head's projection at a time, so no `[n, hidden]` product per head is kept."""
    values = layer.live_values().float()
    batch, kv_heads, n, dim = values.shape
    weight = layer.owner.model.output_projection(layer.layer_idx).float()  # [hidden, heads * dim]
    heads = weight.shape[1] // dim
    group = heads // kv_heads
    total = values.new_zeros(batch, kv_heads, n)
    for head in range(heads):
        total[:, head // group] += (values[:, head // group] @ weight[:, head * dim : (head + 1) * dim].T).abs().sum(-1)
    return total / group
