from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvbench.errors import KvbenchError
from kvbench.policies.base import RetrievalHeads, register

PATTERN_FILE = "full_attention_heads.tsv"  # the official file name, in a pattern folder beside its config.json


@register
@dataclass
class DuoAttention(RetrievalHeads):
    """DuoAttention (Xiao et al. 2024, arXiv 2410.10819): retrieval heads keep the whole cache, streaming heads the
    first `sinks` entries and the most recent (`budget` in all).

    Which heads retrieve comes from a `pattern` learned offline: the official `full_attention_heads.tsv` (one line
    per layer, one tab-separated gate value per KV head; mit-han-lab/duo-attention's `attn_patterns/`), or the
    folder holding it. Values are clipped to [0, 1] as the official loader does; the `head_ratio` share of KV heads
    with the highest gates over the whole model are retrieval heads (kvpress's `DuoAttentionPress` with
    `head_compression_ratio = 1 - head_ratio`; the official code's `sparsity` is also 1 - head_ratio).
    """

    name = "duoattention"
    pattern: str | None = None
    head_ratio: float = 0.5
    sinks: int = 128  # the official patterns' sink_size (with recent_size 256: `budget: 384`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.head_ratio <= 1.0:
            raise KvbenchError(f"policy 'duoattention' parameter 'head_ratio' must be in [0, 1], got {self.head_ratio}")
        self._gates = load_pattern(self.pattern)
        # the lowest gates stream, as kvpress picks them: round(heads x (1 - head_ratio)) of them
        streaming = round(self._gates.numel() * (1 - self.head_ratio))
        order = self._gates.flatten().argsort(stable=True)
        retrieval = torch.ones(self._gates.numel(), dtype=torch.bool)
        retrieval[order[:streaming]] = False
        self._retrieval = retrieval.view(self._gates.shape)

    def prepare(self, lm) -> None:
        model_shape = (lm.num_layers, lm.kv_heads)
        if tuple(self._gates.shape) != model_shape:
            raise KvbenchError(f"policy 'duoattention': pattern '{self.pattern}' has {self._gates.shape[0]} layers x "
                               f"{self._gates.shape[1]} KV heads, the model {model_shape[0]} x {model_shape[1]}")

    def retrieval_heads(self) -> torch.Tensor:
        return self._retrieval


def load_pattern(pattern: str | None) -> torch.Tensor:
    """The gates `[layers, kv_heads]` of a pattern file (or of the folder holding `full_attention_heads.tsv`),
    clipped to [0, 1]; a missing or malformed file is a KvbenchError naming it."""
    if pattern is None:
        raise KvbenchError("policy 'duoattention' needs 'pattern': a full_attention_heads.tsv of DuoAttention's gates "
                           "(or its folder)")
    path = Path(pattern).expanduser()
    if path.is_dir():
        path = path / PATTERN_FILE
    if not path.is_file():
        raise KvbenchError(f"policy 'duoattention': pattern '{path}' does not exist")
    try:
        gates = np.loadtxt(path, dtype=float, delimiter="\t", ndmin=2)
    except ValueError as error:
        raise KvbenchError(f"policy 'duoattention': pattern '{path}' is not a table of tab-separated numbers "
                           f"({str(error).splitlines()[0]})") from None
    if gates.size == 0 or not np.isfinite(gates).all():
        raise KvbenchError(f"policy 'duoattention': pattern '{path}' must hold one finite gate per layer and KV head")
    return torch.from_numpy(np.clip(gates, 0, 1))
