from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.calibration.calibrate import calibrated_folder, load_qfilters, read_artifact
from kvbench.errors import KvbenchError
from kvbench.policies.base import PromptScorer, register
from kvbench.policies.reference import Reference, qfilter_kept


@register
@dataclass
class QFilter(PromptScorer):
    """Q-Filters (Godey et al. 2025): keep the entries whose keys project most along the direction the layer's
    queries point to, one calibrated filter per layer and KV head (`kvbench calibrate --method qfilter`). A key's
    score is -<filter, key> as kvpress's QFilterPress scores it (the filter is saved negated); needs no attention.
    `filters`: a folder in kvpress's QFilters format; default the model's own calibration in `$KVBENCH_CACHE/qfilter/`.
    """

    name = "qfilter"
    filters: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._filters: torch.Tensor | None = None  # [layers, kv_heads, head_dim]

    def prepare(self, lm) -> None:
        self._filters = self.load(lm)

    def load(self, lm) -> torch.Tensor:
        """The filters for `lm`, checked against its shape; a missing artifact names the command that makes it."""
        folder = calibrated_folder(lm, "qfilter", "qfilter", self.filters, "Q-Filters")
        filters = read_artifact(lm, folder, "q_filters", lambda found: load_qfilters(found).to(lm.device))
        expected = (lm.num_layers, lm.kv_heads, lm.head_dim)
        if tuple(filters.shape) != expected:
            raise KvbenchError(f"policy 'qfilter': the Q-Filters in {folder} are {tuple(filters.shape)} (layers, KV "
                               f"heads, head_dim); {lm.spec} needs {expected}")
        return filters

    def score(self, layer, budget: int) -> torch.Tensor:
        if self._filters is None:
            raise KvbenchError("policy 'qfilter' reads its filters when a session is made (prepare)")
        direction = self._filters[layer.layer_idx]  # [kv_heads, D]
        return -torch.einsum("bhnd,hd->bhn", layer.live_keys().float(), direction)

    def reference(self, lm, prompt, decode, budget) -> Reference:
        return qfilter_kept(lm, prompt, budget, self.load(lm).cpu())
