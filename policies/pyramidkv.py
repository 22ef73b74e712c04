from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, LayerSpread, positive, register
from kvbench.policies.snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV, LayerSpread):
    """PyramidKV (Cai et al. 2024): SnapKV scoring with per-layer budgets falling linearly with depth."""

    name = "pyramidkv"
    colour = "#332288"
    threshold_scale = None  # its point is how a token budget spreads over the layers, which a threshold has not
    beta: float = 20.0  # the top layer keeps 1/beta of the average budget beyond the window

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("pyramidkv", beta=self.beta)

    def layer_budgets(self, budget: int, num_layers: int, prompt_tokens: int | None = None) -> list[int]:
        # KVCache-Factory's PyramidKVCluster.update_kv (pyramidkv/pyramidkv_utils.py), in entries beyond the
        # window, which every layer keeps whole: from `most` at the first layer down by a whole `step` per
        # layer, `least` = base // beta and `most` = 2 base - least (base = budget - window); a prompt of at
        # most `most` + window tokens caps `most` at prompt - window and raises `least` to 2 base - most.
        # The floored step leaves the deepest layers above `least`, so the total may exceed layers x budget.
        # A prompt under 2 base tokens keeps budget at every layer; None: a prompt too long for any cap.
        base = budget - self.window
        if num_layers == 1 or (prompt_tokens is not None and prompt_tokens < 2 * base):
            return [budget] * num_layers  # one layer: no pyramid (the official step divides by zero)
        least = int(base // self.beta)
        most = 2 * base - least
        if prompt_tokens is not None and most >= prompt_tokens - self.window:
            most = prompt_tokens - self.window
            least = 2 * base - most
        step = (most - least) // (num_layers - 1)
        return [self.window + most - i * step for i in range(num_layers)]

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and (demand.budget - self.window) / self.beta < 1:
            raise KvbenchError(f"pyramidkv: budget {demand.budget} leaves the top layer no entry beyond the window "
                               f"(need budget >= window + beta = {self.window + self.beta:g})")
