from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.engine.codecs import Codec, TokenQuant
from kvbench.engine.storage import Layout, Tier
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, Schedule, register


@register
@dataclass
class MixedPrecision(Policy):
    """Precision by age: the newest `recent` tokens in the model dtype, older ones quantized per token (keys and
    values, one scale and zero-point per `group_size` channels) at `bits`; with `middle` > 0, only the `middle`
    tokens after the recent ones keep `bits` and older ones drop to `old_bits` (a third tier).

    Takes no budget; an eviction policy adds it as `storage: {mixed_precision: {bits: 8}}`.
    """

    name = "mixed_precision"
    colour = "#CC79A7"
    schedule = Schedule.NONE
    family = "compression"
    recent: int = 128
    bits: Literal[2, 4, 8] = 8
    middle: int = 0
    old_bits: Literal[2, 4, 8] = 4
    group_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 0 or self.middle < 0 or self.group_size < 1:
            raise KvbenchError(f"policy 'mixed_precision': recent >= 0, middle >= 0 and group_size >= 1, got "
                               f"{self.recent}, {self.middle}, {self.group_size}")

    def layout(self) -> Layout:
        def quantized(bits: int, tokens: int | None = None) -> Tier:
            return Tier(TokenQuant(bits, self.group_size), TokenQuant(bits, self.group_size), tokens)

        tiers = [Tier(Codec(), Codec(), self.recent)]
        if self.middle:
            return Layout(self.name, [*tiers, quantized(self.bits, self.middle), quantized(self.old_bits)])
        return Layout(self.name, [*tiers, quantized(self.bits)])
