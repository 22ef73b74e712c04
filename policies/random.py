from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.policies.base import BatchLimit, Policy, register


@register
@dataclass
class Random(Policy):
    """Control: keeps a uniformly random `budget` entries (any policy should beat it)."""

    name = "random"
    colour = "#999999"
    eager_only = "its draws follow the order of the slots, which a static step keeps otherwise"
    seed: int = 0
    # one per row of a batch, each drawing what the row's own cache draws
    _generators: list[torch.Generator] = field(default_factory=list, init=False, repr=False, compare=False)

    def batch_limits(self) -> list[BatchLimit]:
        # a row draws one number per slot: padding slots would shift its draws
        return [BatchLimit("equal", "policy 'random' draws a number for every slot, its row's padding included")]

    def score(self, layer, budget: int) -> torch.Tensor:
        positions = layer.live_positions()
        while len(self._generators) < positions.shape[0]:
            self._generators.append(torch.Generator(device=positions.device).manual_seed(self.seed))
        return torch.stack([torch.rand(positions.shape[1:], generator=generator, device=positions.device)
                            for generator in self._generators[: positions.shape[0]]])
