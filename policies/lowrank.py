from __future__ import annotations

from dataclasses import dataclass

from kvbench.engine.codecs import Codec, LowRank
from kvbench.engine.storage import Layout, Tier
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, Schedule, register


@register
@dataclass
class LowRankStorage(Policy):
    """Low-rank keys (Loki, Eigen Attention): per layer and KV head, keys are stored as `rank` coefficients on the
    top principal directions of the prompt's keys (an SVD of the first entries stored); later tokens are projected
    on the same basis. `values: true` projects values too. rank = head_dim is exact.

    Takes no budget; an eviction policy adds it as `storage: {lowrank: {rank: 32}}`.
    """

    name = "lowrank"
    colour = "#F0E442"
    schedule = Schedule.NONE
    family = "compression"
    rank: int = 32
    values: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank < 1:
            raise KvbenchError(f"policy 'lowrank' parameter 'rank' must be at least 1, got {self.rank}")

    def layout(self) -> Layout:
        return Layout(self.name, [Tier(LowRank(self.rank), LowRank(self.rank) if self.values else Codec())])
