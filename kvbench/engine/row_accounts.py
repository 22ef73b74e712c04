"""What each row of a batched cache holds as if it ran alone: its entries, its buffer, its peak.

A batch's buffers are one rectangle: every row as wide as the widest, left padding included, so their bytes
say nothing of one row. A record says what its own sequence costs (a batched sweep records what an unbatched one
does), so a cache of several rows keeps, beside its buffers, each row's accounts as an unbatched cache of that
row keeps them: the real entries of each KV head, and the buffer such a cache would have allocated for them,
sized by the same `KVCache.capacity_for` at the same events (tokens appended, an eviction, a sliding window's
slide, adopting a shared prefill and owning its entries). The rows' eviction decisions are made from these
counts too (`KVCache.compress`), so the device is never asked for them: host integers only.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvbench.engine.stats import CacheStats

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache
    from kvbench.engine.layer import LayerKV


class RowAccounts:
    """Per row of a batched `KVCache`: each layer's held entries per KV head, its buffer's slots (an unbatched
    cache's), whether that buffer is still a shared prefill's, the most slots it ever held; the row's KV peak and
    evictions. `padding` are the row's left-padding tokens; `growth` and `headroom` what its own cache would
    have been built with (a row's answer length and question may differ from the others')."""

    def __init__(self, layers: int, heads: int, padding: list[int], growth: list[int], headroom: list[int]) -> None:
        rows = len(padding)
        self.padding = np.array(padding, dtype=np.int64)
        self.growth = np.array(growth, dtype=np.int64)
        self.headroom = np.array(headroom, dtype=np.int64)
        self.held = np.zeros((layers, rows, heads), dtype=np.int64)
        self.capacity = np.zeros((layers, rows), dtype=np.int64)
        self.borrowed = np.zeros((layers, rows), dtype=bool)
        self.max_held = np.zeros((layers, rows), dtype=np.int64)
        self.slot_bytes = np.zeros(layers, dtype=np.int64)  # one slot of every KV head of a row
        self.peak = np.zeros(rows, dtype=np.int64)
        self.evictions = np.zeros(rows, dtype=np.int64)

    @property
    def rows(self) -> int:
        return len(self.padding)

    def lengths(self, layer: int) -> np.ndarray:
        """`[rows]` slots each row's own layer holds: its fullest head's entries."""
        return self.held[layer].max(axis=1)

    def real_tokens(self, seen: int, new: int) -> np.ndarray:
        """`[rows]` of the `new` tokens fed after `seen`, those that are a row's own (not its left padding)."""
        return np.clip(seen + new - self.padding, 0, None) - np.clip(seen - self.padding, 0, None)

    # --- the events, as an unbatched cache of each row meets them ---------------------------------------
    def appended(self, cache: KVCache, layer: int, seen: int, new: int, slot_bytes: int) -> None:
        """`new` tokens were appended after `seen`: each row's own grow its entries, and its buffer where they do
        not fit (or where it was a shared prefill's)."""
        self.slot_bytes[layer] = slot_bytes
        real = self.real_tokens(seen, new)
        end = self.lengths(layer) + real
        grows = (real > 0) & ((end > self.capacity[layer]) | self.borrowed[layer])
        for row in map(int, np.flatnonzero(grows)):
            self._reallocate(cache, layer, row, int(end[row]))
        self.held[layer] += real[:, None]
        self.max_held[layer] = np.maximum(self.max_held[layer], end)

    def kept(self, cache: KVCache, layer: int, rows: np.ndarray, held: np.ndarray) -> None:
        """The `rows` (a mask) now hold `held` `[rows, heads]` (an eviction, a per-head selection, a slide): a
        buffer that was a shared prefill's becomes the row's own at the size it keeps, and one at least twice
        that size shrinks to it."""
        self.held[layer][rows] = held[rows]
        lengths = self.lengths(layer)
        for row in map(int, np.flatnonzero(rows)):
            target = self._capacity(cache, layer, row, int(lengths[row]))
            if self.borrowed[layer, row] or self.capacity[layer, row] >= 2 * target:
                self._set_capacity(layer, row, target)

    def slid(self, cache: KVCache, layer: int, window: int) -> None:
        """A sliding layer dropped what no query sees: each row whose own layer reached the window keeps its
        newest `window - 1` entries per head."""
        rows = self.lengths(layer) >= window
        if rows.any():
            self.kept(cache, layer, rows, np.minimum(self.held[layer], window - 1))

    def owned(self, cache: KVCache, layer: int, rows: np.ndarray | None = None) -> None:
        """The `rows` (default every row) copy what they still read of a shared prefill into buffers of their own."""
        mine = self.borrowed[layer] if rows is None else self.borrowed[layer] & rows
        lengths = self.lengths(layer)
        for row in map(int, np.flatnonzero(mine)):
            self._reallocate(cache, layer, row, int(lengths[row]))

    def adopted(self, layer: int, shared: RowAccounts) -> None:
        """This layer reads a shared prefill's entries in place: their counts, none of their bytes."""
        self.held[layer] = shared.held[layer]
        self.max_held[layer] = shared.max_held[layer]
        self.capacity[layer] = shared.capacity[layer]
        self.slot_bytes[layer] = shared.slot_bytes[layer]
        self.borrowed[layer] = True

    def count_evictions(self, rows: np.ndarray, evicted: np.ndarray) -> int:
        """Add what the `rows` (a mask) evicted; returns the sum (the whole batch's count)."""
        counted = np.where(rows, evicted, 0)
        self.evictions += counted
        return int(counted.sum())

    def select(self, rows: list[int], padding: list[int]) -> RowAccounts:
        """The accounts of `rows` only, now left-padded by `padding`."""
        twin = copy.copy(self)
        for name in ("held", "capacity", "borrowed", "max_held"):
            setattr(twin, name, getattr(self, name)[:, rows].copy())
        for name in ("growth", "headroom", "peak", "evictions"):
            setattr(twin, name, getattr(self, name)[rows].copy())
        twin.padding = np.array(padding, dtype=np.int64)
        twin.slot_bytes = self.slot_bytes.copy()
        return twin

    # --- what a record reads -----------------------------------------------------------------------------
    def physical(self, row: int) -> int:
        """Bytes of the row's own buffers (a shared prefill's, read in place, are not its own)."""
        return int((self.capacity[:, row] * self.slot_bytes * ~self.borrowed[:, row]).sum())

    def stats(self, cache: KVCache, row: int) -> CacheStats:
        """The row's `CacheStats`, as an unbatched cache of it reports them."""
        kv_layers = cache.layers
        layers = [i for i, layer in enumerate(kv_layers) if layer.is_initialized]
        if not layers:
            return CacheStats(0, 0, 0, 0, 0.0, 0, 0, 0)
        heads, head_dim = cache.batch_heads_dim[1:]
        seen = max(0, kv_layers[layers[0]].seen - int(self.padding[row]))
        full_slot = 2 * heads * head_dim * kv_layers[layers[0]].dtype.itemsize
        window = [cache.kinds[i].window for i in layers]
        full_entries = sum(seen if w is None else min(seen, w - 1) for w in window)
        held = self.held[layers, row]  # [layers, heads]
        physical = self.physical(row)
        return CacheStats(
            kv_bytes_live=int((held.sum(axis=1) * self.slot_bytes[layers] // heads).sum()),
            kv_bytes_physical=physical,
            kv_bytes_peak=max(int(self.peak[row]), physical),
            kv_bytes_full=full_entries * full_slot,
            kept_mean=float((held.sum(axis=1) / heads).mean()),
            kept_max=int(held.max()),
            kept_max_ever=int(self.max_held[layers, row].max()),
            evictions=int(self.evictions[row]),
        )

    # --- buffers -----------------------------------------------------------------------------------------
    def _capacity(self, cache: KVCache, layer: int, row: int, live: int) -> int:
        return cache.capacity_for(live, layer, growth=int(self.growth[row]), headroom=int(self.headroom[row]))

    def _reallocate(self, cache: KVCache, layer: int, row: int, live: int) -> None:
        self._set_capacity(layer, row, self._capacity(cache, layer, row, live))

    def _set_capacity(self, layer: int, row: int, capacity: int) -> None:
        """A new buffer of `capacity` slots: it and the old one coexist for a moment (the row's peak counts
        both, as `KVCache.note_allocation` does)."""
        self.peak[row] = max(self.peak[row], self.physical(row) + capacity * int(self.slot_bytes[layer]))
        self.capacity[layer, row] = capacity
        self.borrowed[layer, row] = False


class RowView:
    """One row of a batched layer as its unbatched cache holds it: the row's own slots (its left padding cut
    off), its statistics and its token count. While a layer's slots are still in prompt order (nothing evicted,
    `LayerKV.slots_in_order`), a batch hands each row to a policy's `score` and `select` as this view: the
    policy then makes, on the same slots in the same order, the very call it makes on the unbatched cache, so
    even its ties fall alike (SnapKV's max-pooled scores tie over each pooled window; chunks and partitions
    are cut from a row's first real token). Writes to a view's tensors reach the layer's."""

    def __init__(self, layer: LayerKV, row: int, start: int) -> None:
        self._layer, self._row, self._start = layer, row, start
        self.kind, self.layer_idx, self.device = layer.kind, layer.layer_idx, layer.device
        self.dtype, self.heads_share_positions = layer.dtype, layer.heads_share_positions
        self.length = layer.length - start
        self.seen = layer.seen - start  # before any eviction, the row's tokens are its slots
        self.layer_stats = {name: rows_of(value, slice(row, row + 1)) for name, value in layer.layer_stats.items()}

    @property
    def owner(self) -> KVCache:
        return self._layer.owner

    def _rows(self, tensor: torch.Tensor | None) -> torch.Tensor:
        assert tensor is not None, "a view of a layer that holds entries"
        return tensor[self._row : self._row + 1, :, self._start :]

    @property
    def keys(self) -> torch.Tensor:
        return self._rows(self._layer.keys)

    @property
    def values(self) -> torch.Tensor:
        return self._rows(self._layer.values)

    @property
    def positions(self) -> torch.Tensor:
        return self._rows(self._layer.positions)

    def live_keys(self) -> torch.Tensor:
        return self.keys[:, :, : self.length]

    def live_values(self) -> torch.Tensor:
        return self.values[:, :, : self.length]

    def live_positions(self) -> torch.Tensor:
        return self.positions[:, :, : self.length]

    def next_position(self) -> int:
        return self.seen

    def padding(self) -> None:
        return None  # the row's slots after its left padding: every one holds an entry

    def slot_stat(self, name: str, width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._rows(self._layer.slot_stat(name, width, dtype))


def rows_of(value: Any, rows: slice | torch.Tensor) -> Any:
    """`value` (a per-layer statistic: a tensor `[rows, ...]`, or a dataclass of them) for some rows only."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, np.ndarray):  # per-row counters kept on the host
        return value[rows if isinstance(rows, slice) else rows.cpu().numpy()]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: rows_of(getattr(value, f.name), rows)
                                             for f in dataclasses.fields(value) if f.init})
    return value
