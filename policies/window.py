from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.policies.base import Policy, register


@register
@dataclass
class Window(Policy):
    """Sliding window: keeps the most recent `budget` entries."""

    name = "window"
    colour = "#E69F00"

    @property
    def ring(self) -> int:
        return 0

    def score(self, layer, budget: int) -> torch.Tensor:
        return layer.live_positions().float()
