from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import BatchLimit, Wrapper, register


@register
@dataclass
class Adaptive(Wrapper):
    """Full cache while it fits a memory limit, then a fallback policy at the budget; the record says when."""

    name = "adaptive"
    needs_attention = True
    limit_bytes: int | None = None  # KV bytes (all layers) that trigger the switch
    limit_fraction: float = 0.5  # without limit_bytes: this share of the device's (or RAM's) free memory
    fallback: str | dict[str, Any] = "streaming_llm"
    _limit: int | None = field(default=None, init=False, repr=False, compare=False)
    _switched_at: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.limit_bytes is not None and self.limit_bytes <= 0:
            raise KvbenchError(f"policy 'adaptive' parameter 'limit_bytes' must be positive, got {self.limit_bytes}")
        if not 0 < self.limit_fraction <= 1:
            raise KvbenchError(
                f"policy 'adaptive' parameter 'limit_fraction' must be in (0, 1], got {self.limit_fraction}")
        self._stages = (self.build_stage(self.fallback),)
        if not self._stages[0].schedule.decodes:
            raise KvbenchError(f"policy 'adaptive': fallback '{self._stages[0].name}' does not evict while decoding")
        self.schedule = self._stages[0].schedule  # type: ignore[misc]

    def bounded(self, layer) -> bool:
        cache = layer.owner
        if self._switched_at is None:
            if self._limit is None:
                self._limit = self.limit_bytes if self.limit_bytes is not None else int(
                    self.limit_fraction * _free_bytes())
            if cache.live_bytes() < self._limit:
                return False
            self._switched_at = cache.layers[0].seen
        return super().bounded(layer)

    def batch_limits(self) -> list[BatchLimit]:
        return [*super().batch_limits(),
                BatchLimit("alone", "policy 'adaptive' switches when its whole cache reaches the limit")]

    def report(self) -> dict[str, Any]:
        return {**super().report(), "switched_at_token": self._switched_at, "limit_bytes": self._limit}


def _free_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available
