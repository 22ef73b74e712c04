"""What a `KVCache` measures: the bytes it holds, keeps at its peak and reads per decode step, and its evictions
(the record columns of docs/measurements.md). Counted from shapes and the host's counts; the device is asked only for
what it alone knows, and only when a record asks."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import torch

from kvbench.engine.layer import LayerKV
from kvbench.engine.stats import CacheStats

__all__ = ["CacheStats", "ReadCounts", "ReadMeans", "cache_stats", "layer_ratios", "row_stats"]

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache


class ReadMeans(TypedDict):
    kv_bytes_read: float | None
    kv_bytes_read_full: float | None


class ReadCounts:
    """The K/V bytes the decode steps' attention read, per row, summed over the layers and steps (`kv_bytes_read`
    is their mean per step), and what a full cache's steps read. Counted from shapes and the host's counts; what
    only the device knows (a sparse selection, heads holding uneven counts) is summed there and read back only when
    a record asks (no sync per step)."""

    def __init__(self, rows: int) -> None:
        self.steps = 0  # one-token forwards in the decode phase
        self.dense = np.zeros(rows)  # bytes of the layers that read every entry they hold
        self.full = np.zeros(rows)
        self.on_device: torch.Tensor | None = None  # [rows] on the device: the layers whose count the host lacks

    def count(self, cache: KVCache, layer: LayerKV, selected: torch.Tensor | None) -> None:
        """`layer`'s read at this step: every entry it holds (the new one included), or the `selected` slots
        `[batch, heads or kv_heads, length]` (a KV head loads what any of its query heads reads)."""
        kv_heads = cache.batch_heads_dim[1]
        self._count_full(cache, layer)
        if selected is not None:
            if selected.shape[1] != kv_heads:
                selected = selected.view(selected.shape[0], kv_heads, -1, selected.shape[-1]).any(dim=2)
            self._add_on_device(selected.sum(dim=(1, 2)) * layer.entry_bytes())
        elif cache.rows is not None:  # each row's own entries, from the host's accounts
            rows = cache.rows
            self.dense += rows.held[layer.layer_idx].sum(axis=1) * rows.slot_bytes[layer.layer_idx] // kv_heads
        elif type(layer) is LayerKV and (padding := layer.padding()) is not None:  # a row's heads hold uneven counts
            self._add_on_device((~padding).sum(dim=(1, 2)) * layer.entry_bytes())
        else:  # one row, or rows that hold alike (compressed storage): a row's share
            self.dense += layer.live_bytes() / len(self.dense)

    def count_held(self, cache: KVCache, layer: LayerKV, held: np.ndarray) -> None:
        """`layer`'s read at a static step: the entries each head holds `[rows, heads]` (the new one included), as
        the host counts them."""
        self._count_full(cache, layer)
        self.dense += held.sum(axis=1) * layer.entry_bytes()

    def _count_full(self, cache: KVCache, layer: LayerKV) -> None:
        """What a full cache's layer reads at this step: each row's tokens (a sliding layer's window of them)."""
        kv_heads, head_dim = cache.batch_heads_dim[1:]
        seen = layer.seen - np.asarray(cache.row_padding)  # each row's tokens, the new one included
        held_by_full = seen if layer.kind.window is None else np.minimum(seen, layer.kind.window)
        self.full += held_by_full * kv_heads * 2 * head_dim * layer.dtype.itemsize

    def _add_on_device(self, read: torch.Tensor) -> None:
        self.on_device = read if self.on_device is None else self.on_device + read

    def means(self, row: int | None = None) -> ReadMeans:
        """`kv_bytes_read` and `kv_bytes_read_full` of `row` (None: the whole batch)."""
        if not self.steps:
            return {"kv_bytes_read": None, "kv_bytes_read_full": None}
        read = self.dense + (0 if self.on_device is None else self.on_device.cpu().numpy())
        picked = slice(None) if row is None else slice(row, row + 1)
        return {"kv_bytes_read": float(read[picked].sum()) / self.steps,
                "kv_bytes_read_full": float(self.full[picked].sum()) / self.steps}

    def select(self, rows: list[int]) -> ReadCounts:
        twin = ReadCounts(len(rows))
        twin.steps, twin.dense, twin.full = self.steps, self.dense[rows], self.full[rows]
        twin.on_device = None if self.on_device is None else self.on_device[rows]
        return twin


def cache_stats(cache: KVCache) -> CacheStats:
    """The whole batch's measurements: its buffers, one rectangle, padding included."""
    batch, heads, head_dim = cache.batch_heads_dim
    layers = [layer for layer in cache.layers if layer.is_initialized]
    full_slot = 2 * batch * heads * head_dim * layers[0].dtype.itemsize if layers else 0
    full_entries = sum(layer.full_entries() for layer in layers)
    lengths = [layer.length for layer in layers] or [0]
    physical = cache.physical_bytes()
    return CacheStats(
        kv_bytes_live=cache.live_bytes(),
        kv_bytes_physical=physical,
        kv_bytes_peak=max(cache.peak_bytes, physical),
        kv_bytes_full=full_entries * full_slot,
        kept_mean=kept_mean(cache),
        kept_max=max(lengths),
        kept_max_ever=max((layer.max_held for layer in layers), default=0),
        evictions=cache.evictions,
        **cache.reads.means(),
    )


def kept_mean(cache: KVCache) -> float:
    """Entries a layer's heads hold, on the mean over the layers (a static layer's from the host's counts)."""
    batch, heads, _ = cache.batch_heads_dim
    per_head = [layer.live_entries() / (batch * heads) for layer in cache.layers if layer.is_initialized] or [0]
    return sum(per_head) / len(per_head)


def row_stats(cache: KVCache, row: int) -> CacheStats:
    """What an unbatched cache of row `row` would report (`cache_stats` of a batch counts the whole rectangle). A
    batch of compressed storage (rows of one length, nothing evicted) holds every row alike: a row's share."""
    if cache.rows is not None:
        return dataclasses.replace(cache.rows.stats(cache, row), **cache.reads.means(row))
    stats, rows = cache_stats(cache), cache.batch_heads_dim[0]
    return dataclasses.replace(stats, kv_bytes_live=stats.kv_bytes_live // rows,
                               kv_bytes_physical=stats.kv_bytes_physical // rows,
                               kv_bytes_peak=stats.kv_bytes_peak // rows, kv_bytes_full=stats.kv_bytes_full // rows,
                               evictions=stats.evictions // rows, **cache.reads.means(row))


def layer_ratios(cache: KVCache) -> list[float]:
    """Each layer's entries held over what a full cache holds there (a threshold cell's record)."""
    batch, heads, _ = cache.batch_heads_dim
    return [layer.live_entries() / (batch * heads * layer.full_entries())
            for layer in cache.layers if layer.is_initialized and layer.seen]
