"""One decode step of several sessions in one forward: continuous batching's step.

Requests of a service join and leave the running batch at any step, each with its own prompt length, position,
budget and policy state. So each keeps its own single-row `KVCache` (its entries, evictions and accounts are those of
its run alone), and a joint step hands the model a `JointCache` over them: the projections, MLPs and logits run on
every row at once, and each row's attention reads its own cache (as paged attention reads each sequence's own
blocks), through the kvbench attention function with that row's cache as its observer. A row's tokens are then its
run alone's up to the batched matmuls' rounding.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache


class JointCache(Cache):
    """The cache a joint step hands the model: one row per member cache (each a single row)."""

    def __init__(self, members: list[KVCache]) -> None:
        self.members = members
        super().__init__(layers=[_JointLayer(self, index) for index in range(len(members[0].layers))])

    def row_entries(self, layer_idx: int) -> list[tuple[KVCache, torch.Tensor, torch.Tensor]]:
        """Each member, with the keys and values its layer `layer_idx` holds after this step's update."""
        layer = self.layers[layer_idx]
        assert isinstance(layer, _JointLayer)
        return [(cache, keys, values) for cache, (keys, values) in zip(self.members, layer.entries, strict=True)]


class _JointLayer(CacheLayerMixin):
    """Hands each row's new key and value to its own cache's layer, as the model would alone."""

    is_sliding = False  # each member's attention builds its own sliding mask from true positions
    is_compileable = False

    def __init__(self, owner: JointCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self._owner()
        assert owner is not None, "a joint layer lives while its cache does"
        self.entries = [cache.update(key_states[row : row + 1], value_states[row : row + 1], self.layer_idx, *args,
                                     **kwargs) for row, cache in enumerate(owner.members)]
        return key_states, value_states  # the kvbench attention reads each row's own entries instead

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.2x passes `cache_position`
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        owner = self._owner()
        assert owner is not None, "a joint layer lives while its cache does"
        return max(cache.layers[self.layer_idx].length for cache in owner.members)

    def get_max_length(self) -> int:
        return -1
