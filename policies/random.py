from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.policies.base import Policy, register


@register
@dataclass
class Random(Policy):
    """Control: keeps a uniformly random `budget` entries (any policy should beat it)."""

    name = "random"
    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    def score(self, layer, budget: int) -> torch.Tensor:
        positions = layer.live_positions()
        if self._generator is None:
            self._generator = torch.Generator(device=positions.device).manual_seed(self.seed)
        return torch.rand(positions.shape, generator=self._generator, device=positions.device)
