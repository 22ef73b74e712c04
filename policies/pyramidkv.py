from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KvbenchError
from kvbench.policies.base import positive, register
from kvbench.policies.snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024): SnapKV scoring with per-layer budgets falling linearly with depth."""

    name = "pyramidkv"
    beta: float = 20.0  # the top layer keeps 1/beta of the average budget beyond the window

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("pyramidkv", beta=self.beta)

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        # the official schedule: prefix budgets fall linearly from 2A - A/beta to A/beta (A the average),
        # plus the window everywhere; rounding remainders go to the lowest layers so the total is exact
        average = budget - self.window
        low = average / self.beta
        high = 2 * average - low
        step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
        prefix = [int(high - i * step) for i in range(num_layers)]
        for i in range(average * num_layers - sum(prefix)):
            prefix[i % num_layers] += 1
        return [self.window + p for p in prefix]

    def check_budget(self, budget: int) -> None:
        super().check_budget(budget)
        if (budget - self.window) / self.beta < 1:
            raise KvbenchError(f"pyramidkv: budget {budget} leaves the top layer no entry beyond the window "
                               f"(need budget >= window + beta = {self.window + self.beta:g})")
