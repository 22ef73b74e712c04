from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.engine.codecs import ChannelQuant, Codec, TokenQuant
from kvbench.engine.storage import Layout, Tier
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, Schedule, register


@register
@dataclass
class Quant(Policy):
    """KIVI (Liu et al. 2024): every token kept, keys quantized per channel over groups of `group_size` tokens and
    values per token in groups of `group_size` channels, at `bits` (packed); the newest `residual` tokens stay in
    full precision and are quantized a group at a time as they age. `bits: 16` stores entries as they are.

    Takes no budget; an eviction policy adds it as `storage: {quant: {bits: 4}}`.
    """

    name = "quant"
    colour = "#D55E00"
    schedule = Schedule.NONE
    family = "compression"
    bits: Literal[2, 4, 8, 16] = 4
    group_size: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 1 or self.residual < 0:
            raise KvbenchError(f"policy 'quant': group_size >= 1 and residual >= 0, got {self.group_size}, "
                               f"{self.residual}")

    def layout(self) -> Layout:
        if self.bits == 16:
            return Layout(self.name, [Tier(Codec(), Codec())])
        quantized = Tier(ChannelQuant(self.bits, self.group_size), TokenQuant(self.bits, self.group_size))
        return Layout(self.name, [Tier(Codec(), Codec(), self.residual), quantized], group=self.group_size)
