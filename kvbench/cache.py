"""A transformers `Cache` that physically holds only the KV entries a policy keeps.

Each layer stores keys/values as `[batch, kv_heads, capacity, head_dim]` buffers of which the first
`length` slots are live. Eviction fills the evicted slots with the survivors from the tail (or, when
most entries go, gathers the survivors into a smaller buffer), so decode-time eviction costs
O(evicted) copies and memory really stays at the budget. Slots are not kept in position order:
attention does not care (RoPE is already applied to the keys), and `positions` records each
entry's original position for the policies that need recency.

A sliding-window layer (`LayerKind.window`, from the model's config) holds at most `window - 1` entries between
forwards, as transformers' own sliding-window cache does: after each attention it drops the oldest beyond that,
which no later query can see. A policy's budget bounds it too (a budget below the window evicts there as well).

A policy with a storage layout (quant, mixed_precision, lowrank, think, or `storage:` on an eviction policy) gets
`StoredLayerKV` layers instead (kvbench/storage.py): the same slots, holding compressed entries. A layout fitted to
the compressed prompt (ThinK's key channels) gets them once the prompt is compressed (`store_prompt`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.attention import FULL, LayerKind
from kvbench.errors import KvbenchError
from kvbench.measure import synchronize
from kvbench.rows import RowAccounts, RowView, rows_of

if TYPE_CHECKING:
    from kvbench.budgets import Threshold
    from kvbench.models import ModelInternals
    from kvbench.policies.base import Policy


@dataclass
class CacheStats:
    """Byte and count measurements of a cache at one moment (the record columns of docs/measurements.md)."""

    kv_bytes_live: int
    kv_bytes_physical: int
    kv_bytes_peak: int
    kv_bytes_full: int
    kept_mean: float
    kept_max: int
    kept_max_ever: int
    evictions: int
    # K/V bytes the attention of one decode step read, mean over the decode steps so far, and what a full cache's
    # step read (None before any decode step): what bounds a memory-bound decode step's time
    kv_bytes_read: float | None = None
    kv_bytes_read_full: float | None = None

    @property
    def cache_ratio(self) -> float:
        return self.kv_bytes_live / self.kv_bytes_full if self.kv_bytes_full else 1.0

    @property
    def read_ratio(self) -> float | None:
        return None if not self.kv_bytes_read_full else (self.kv_bytes_read or 0.0) / self.kv_bytes_read_full


class Phase(str, Enum):
    """Where a session is: compressing a prompt, or decoding after it. Only the session sets it (a str, so
    policies compare it with "prefill")."""

    PREFILL = "prefill"
    DECODE = "decode"


PADDING = "padding"  # per-slot stat: True where a head holds no entry (heads kept different counts)


class LayerKV(CacheLayerMixin):
    """One layer's physically evicting store. Policies read `keys`, `positions` and `slot_stat()`."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: KVCache, layer_idx: int) -> None:
        super().__init__()
        # by weak reference: a cache and its layers form no reference cycle, so a finished cell's cache is freed
        # the moment its last user lets go (a cycle would hold it until the garbage collector runs)
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.kind: LayerKind = owner.kinds[layer_idx]
        # every KV head holds the same positions in the same slots (until a policy evicts per head): one mask row
        # then serves all heads of a sliding layer
        self.heads_share_positions = True
        # slot s + (a row's left padding) holds the s-th token of every head: nothing evicted or moved yet. A batch
        # then hands a policy each row's own slots, as they lie in its unbatched cache (`RowView`)
        self.slots_in_order = True
        self.length = 0  # live slots
        self.seen = 0  # tokens ever appended: the position of the next one
        self.max_held = 0
        self.positions: torch.Tensor | None = None  # [batch, kv_heads, capacity] int64
        self.slot_stats: dict[str, torch.Tensor] = {}  # per-slot policy state, moved with the slots
        self.layer_stats: dict[str, Any] = {}  # per-layer policy state (query statistics), copied with the layer
        # the buffers are a shared prefill's (see `borrow`): read in place, never written; the first write moves
        # what this layer keeps into buffers of its own
        self.borrowed = False

    @property
    def owner(self) -> KVCache:
        return self._owner()

    # --- transformers Cache layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._append(key_states.shape[-2])
        self.keys[:, :, start : self.length] = key_states
        self.values[:, :, start : self.length] = value_states
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def _append(self, new: int) -> int:
        """Slots, positions and zeroed statistics for `new` tokens; returns the first new slot."""
        start, end = self.length, self.length + new
        if end > self.capacity or self.borrowed:
            self._reallocate(self.owner.capacity_for(end, self.layer_idx))
        owner = self.owner
        if owner.rows is not None:  # each row's own cache grows by its own tokens
            owner.rows.appended(owner, self.layer_idx, self.seen, new, owner.batch_heads_dim[1] * self.entry_bytes())
        positions = torch.arange(self.seen, self.seen + new, device=self.device)
        pad = owner.left_padding
        if pad is not None:  # a left-padded batch: each row's tokens count from its first real one
            positions = positions - pad.to(self.device)[:, None, None]
        self.positions[:, :, self.length : end] = positions
        for stat in self.slot_stats.values():
            stat[:, :, self.length : end] = 0
        if pad is not None and self.seen < owner.max_padding:  # the padding slots: masked, evicted first
            self.slot_stat(PADDING, dtype=torch.bool)
            self.slot_stats[PADDING][:, :, self.length : end] = self.positions[:, :, self.length : end] < 0
        self.length, self.seen = end, self.seen + new
        self.max_held = max(self.max_held, end)
        return start

    def get_seq_length(self) -> int:
        return self.length

    def select_rows(self, owner: KVCache, rows: torch.Tensor, width: int, seen: int) -> LayerKV:
        """A copy of this layer's `rows` only, for `owner` (see `KVCache.select_rows`): `width` slots, each row's
        entries last in slot order (a prompt's, still in order, stay in order) behind its padding."""
        twin = copy.copy(self)
        twin._owner = weakref.ref(owner)
        padding = self.padding()
        held = (~padding if padding is not None else torch.ones_like(self.live_positions(), dtype=torch.bool))[rows]
        order = torch.sort(held.to(torch.int8), dim=-1, stable=True).indices[..., self.length - width :]
        twin.keys, twin.values = (_take(buffer[rows, :, : self.length], order) for buffer in (self.keys, self.values))
        twin.positions = _take(self.positions[rows, :, : self.length], order)
        twin.slot_stats = {name: _take(stat[rows, :, : self.length], order) for name, stat in self.slot_stats.items()}
        if PADDING in twin.slot_stats and int(held.sum(dim=-1).min()) == width:  # none of these rows is padded
            del twin.slot_stats[PADDING]
        twin.layer_stats = {name: rows_of(value, rows) for name, value in self.layer_stats.items()}
        twin.length, twin.seen, twin.borrowed = width, seen, False
        return twin

    def copy_from(self, other: LayerKV, stats: list[str]) -> None:
        """Hold a copy of `other`'s entries and of those of its per-slot statistics named in `stats`."""
        self._take_state(other, stats)
        self._reallocate(self.owner.capacity_for(other.length, self.layer_idx))
        pairs = [(self.positions, other.positions)]
        for name in stats:
            if name in other.slot_stats:
                theirs = other.slot_stats[name]
                width = theirs.shape[3] if theirs.dim() == 4 else None
                pairs.append((self.slot_stat(name, width, theirs.dtype), theirs))
        for mine, theirs in pairs:
            mine[:, :, : self.length] = theirs[:, :, : self.length]
        self._adopt_entries(other)

    def borrow(self, other: LayerKV, stats: list[str]) -> None:
        """Read `other`'s entries and its per-slot statistics named in `stats` in place, as if copied: compressing
        then gathers only the kept entries into buffers of this layer's own, so a cell of a shared prefill never
        holds a second full-size copy. `own` copies whatever compression left whole."""
        self._take_state(other, stats)
        self.keys, self.values, self.positions = other.keys, other.values, other.positions
        self.slot_stats = {name: other.slot_stats[name] for name in stats if name in other.slot_stats}
        self.borrowed = True

    def own(self) -> None:
        """Copy borrowed entries into buffers of this layer's own (a no-op once it has them)."""
        if self.borrowed:
            self._reallocate(self.owner.capacity_for(self.length, self.layer_idx))

    def _take_state(self, other: LayerKV, stats: list[str]) -> None:
        """`other`'s counters and per-layer statistics: what `copy_from` and `borrow` share."""
        self.lazy_initialization(other.keys, other.values)
        self.length, self.seen, self.max_held = other.length, other.seen, other.max_held
        self.heads_share_positions = other.heads_share_positions
        self.slots_in_order = other.slots_in_order
        self.layer_stats.update({name: copy.deepcopy(other.layer_stats[name]) for name in stats
                                 if name in other.layer_stats})

    def truncate(self, count: int) -> None:
        """Forget the `count` newest tokens, as if never fed (they occupy the last slots: nothing was evicted
        since they arrived). A probe's tokens leave this way (KVzip's reconstruction)."""
        assert self.owner.rows is None, "a probe runs on a single-row cache"
        self.length -= count
        self.seen -= count

    def _adopt_entries(self, other: LayerKV) -> None:
        self.keys[:, :, : self.length] = other.keys[:, :, : self.length]
        self.values[:, :, : self.length] = other.values[:, :, : self.length]

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers < 5.2x passes `cache_position` (a tensor) instead of the query length
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # --- storage --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def live_keys(self) -> torch.Tensor:
        return self.keys[:, :, : self.length]

    def live_values(self) -> torch.Tensor:
        return self.values[:, :, : self.length]

    def entry_bytes(self) -> int:
        """Bytes of one slot of one KV head (its key and value)."""
        return 2 * self.owner.batch_heads_dim[2] * self.dtype.itemsize

    def physical_bytes(self) -> int:
        if self.borrowed:  # the shared prefill's bytes, not this cache's
            return 0
        batch, heads, _ = self.owner.batch_heads_dim
        return self.capacity * batch * heads * self.entry_bytes()

    def live_bytes(self) -> int:
        return self.live_entries() * self.entry_bytes()

    def live_positions(self) -> torch.Tensor:
        return self.positions[:, :, : self.length]

    def next_position(self) -> int | torch.Tensor:
        """The position the next token takes: `seen`, or per row `[batch, 1, 1]` in a left-padded batch."""
        pad = self.owner.left_padding
        return self.seen if pad is None else self.seen - pad.to(self.device)[:, None, None]

    def slot_stat(self, name: str, width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-slot statistic `[batch, kv_heads, length(, width)]` that follows its entry when slots move."""
        if name not in self.slot_stats:
            shape = self.positions.shape + ((width,) if width else ())
            self.slot_stats[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.slot_stats[name][:, :, : self.length]

    def padding(self) -> torch.Tensor | None:
        """`[batch, kv_heads, length]`, True on slots a head does not hold, once heads hold uneven counts."""
        stat = self.slot_stats.get(PADDING)
        return None if stat is None else stat[:, :, : self.length]

    def full_entries(self) -> int:
        """Entries per KV head a stock cache would hold here: every token of a full layer, the last window - 1 of
        a sliding one."""
        return self.seen if self.kind.window is None else min(self.seen, self.kind.window - 1)

    def live_entries(self) -> int:
        """Entries held over all heads (padding slots excluded)."""
        if self.positions is None:  # initialized, buffers not allocated yet
            return 0
        padding = self.padding()
        held = self.positions.shape[0] * self.positions.shape[1] * self.length
        return held - (0 if padding is None else int(padding.sum()))

    def retain(self, keep: torch.Tensor) -> None:
        """Keep the slots marked in `keep` `[batch, heads, length]`, any number per head: each head's survivors
        move to the front and heads that keep fewer than the most are padded (and masked in attention)."""
        self.slots_in_order = False
        counts = keep.sum(dim=-1, keepdim=True)
        width = int(counts.max())
        survivors = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :width]
        self.slot_stat(PADDING, dtype=torch.bool)  # created before moving, so it moves too
        if self.borrowed:
            self._reallocate(self.owner.capacity_for(width, self.layer_idx), order=survivors)
        else:
            for buffer in self._buffers():
                buffer[:, :, :width] = _take(buffer[:, :, : self.length], survivors)
            self.length = width
        self.slot_stats[PADDING][..., :width] = torch.arange(width, device=self.device) >= counts
        target = self.owner.capacity_for(width, self.layer_idx)
        if self.capacity >= 2 * target:
            self._reallocate(target)

    def fit(self) -> None:
        """Give back every slot beyond what the layer's buffer needs now (`retain` and `evict` give them back only
        once the buffer is twice that, so that decode steps do not reallocate)."""
        target = self.owner.capacity_for(self.length, self.layer_idx)
        if self.capacity > target:
            self._reallocate(target)

    def slide(self) -> None:
        """On a sliding layer, drop what no later query can see: beyond `window - 1` entries per head, the oldest
        (padding slots first). Those are all out of the window, and their count needs nothing from the device."""
        if self.kind.window is None or self.length < self.kind.window:
            return
        age = self.live_positions()
        padding = self.padding()
        if padding is not None:
            age = age.masked_fill(padding, torch.iinfo(age.dtype).min)
        excess = self.length - (self.kind.window - 1)
        self.evict(age.topk(excess, dim=-1, largest=False, sorted=False).indices)
        if self.owner.rows is not None:  # padding went first: a row loses what its own layer would
            self.owner.rows.slid(self.owner, self.layer_idx, self.kind.window)

    def out_of_window(self) -> torch.Tensor | None:
        """`[batch, kv_heads, length]`, True on entries the next query of a sliding layer cannot see (None: a full
        layer). A policy bound below the window may leave some held until the layer fills up again."""
        if self.kind.window is None:
            return None
        return self.live_positions() <= self.next_position() - self.kind.window

    def _buffers(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, *self.slot_stats.values()]

    def _reallocate(self, capacity: int, order: torch.Tensor | None = None) -> None:
        """Move the live slots into new buffers of `capacity` slots; with `order` `[batch, heads, k]`, only those
        slots, in that order (a borrowed layer's compression: the kept entries go straight into its own buffers)."""
        batch, heads, _ = self.owner.batch_heads_dim
        old = None if self.positions is None else self._buffers()
        self.owner.note_allocation(capacity * batch * heads * self.entry_bytes())
        self._allocate_entries(capacity)
        self.positions = torch.zeros((batch, heads, capacity), dtype=torch.long, device=self.device)
        self.slot_stats = {
            name: torch.zeros((batch, heads, capacity) + stat.shape[3:], dtype=stat.dtype, device=self.device)
            for name, stat in self.slot_stats.items()
        }
        self.borrowed = False
        if old is not None:
            for src, dst in zip(old, self._buffers(), strict=True):
                if order is None:
                    dst[:, :, : self.length] = src[:, :, : self.length]
                else:
                    dst[:, :, : order.shape[-1]] = _take(src[:, :, : self.length], order)
        if order is not None:
            self.length = order.shape[-1]

    def _allocate_entries(self, capacity: int) -> None:
        """The K/V buffers of `capacity` slots (their contents are copied in by `_reallocate`)."""
        kv_shape = (*self.owner.batch_heads_dim[:2], capacity, self.owner.batch_heads_dim[2])
        self.keys = torch.empty(kv_shape, dtype=self.dtype, device=self.device)
        self.values = torch.empty(kv_shape, dtype=self.dtype, device=self.device)

    def evict(self, evicted: torch.Tensor) -> None:
        """Drop the slots `evicted` `[batch, heads, e]` (distinct per head); the others stay live."""
        e = evicted.shape[-1]
        if e == 0:
            return
        self.slots_in_order = False
        keep = self.length - e
        if e == 1:  # the usual decode step: the last slot fills the hole (or is the hole)
            holes, sources = evicted, torch.full_like(evicted, keep)
        else:
            gone = torch.zeros(evicted.shape[:2] + (self.length,), dtype=torch.bool, device=self.device)
            gone.scatter_(-1, evicted, True)
            if e > keep:  # most entries go (a prompt compressed to its budget): gather survivors to the front
                holes = torch.arange(keep, device=self.device).expand(*evicted.shape[:2], keep)
                sources = torch.sort(gone.to(torch.int8), dim=-1, stable=True).indices[..., :keep]
            else:  # few go: the survivors found in the tail move into the holes in front
                holes = torch.sort((~gone[..., :keep]).to(torch.int8), dim=-1, stable=True).indices[..., :e]
                movers = keep + torch.sort(gone[..., keep:].to(torch.int8), dim=-1, stable=True).indices
                real = torch.arange(e, device=self.device) < gone[..., :keep].sum(-1, keepdim=True)
                sources = torch.where(real, movers, holes)  # past the last hole: a slot onto itself
        if self.borrowed:  # the same slot order, gathered into buffers of its own at the size it keeps
            order = torch.arange(self.length, device=self.device).expand(*evicted.shape[:2], self.length)
            self._reallocate(self.owner.capacity_for(keep, self.layer_idx),
                             order=order.scatter(-1, holes, sources)[..., :keep])
            return
        for buffer in self._buffers():
            live = buffer[:, :, : self.length]
            live.scatter_(2, _expand(holes, buffer), _take(live, sources))  # gather copies before writing
        self.length = keep
        target = self.owner.capacity_for(keep, self.layer_idx)
        if self.capacity >= 2 * target:  # give back the memory a long prompt needed
            self._reallocate(target)


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
        kv_heads, head_dim = cache.batch_heads_dim[1:]
        seen = layer.seen - np.asarray(cache.row_padding)  # each row's tokens, the new one included
        held_by_full = seen if layer.kind.window is None else np.minimum(seen, layer.kind.window)
        self.full += held_by_full * kv_heads * 2 * head_dim * layer.dtype.itemsize
        if selected is not None:
            if selected.shape[1] != kv_heads:
                selected = selected.view(selected.shape[0], kv_heads, -1, selected.shape[-1]).any(dim=2)
            self._add_on_device(selected.sum(dim=(1, 2)) * layer.entry_bytes())
        elif cache.rows is not None:  # each row's own entries, from the host's accounts
            rows = cache.rows
            self.dense += rows.held[layer.layer_idx].sum(axis=1) * rows.slot_bytes[layer.layer_idx] // kv_heads
        elif type(layer) is LayerKV and layer.padding() is not None:  # one row whose heads hold uneven counts
            self._add_on_device((~layer.padding()).sum(dim=(1, 2)) * layer.entry_bytes())
        else:  # one row, or rows that hold alike (compressed storage): a row's share
            self.dense += layer.live_bytes() / len(self.dense)

    def _add_on_device(self, read: torch.Tensor) -> None:
        self.on_device = read if self.on_device is None else self.on_device + read

    def means(self, row: int | None = None) -> dict[str, float | None]:
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


def _folds(policy: Policy) -> bool:
    """Whether `policy` (or a stage of it) folds evicted entries into kept ones, writing into the cache."""
    from kvbench.policies.base import Policy

    stages = getattr(policy, "_stages", ())
    return any(map(_folds, stages)) if stages else type(policy).fold is not Policy.fold


def _expand(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return index if like.dim() == 3 else index.unsqueeze(-1).expand(*index.shape, like.shape[-1])


def _take(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return buffer.gather(2, _expand(index, buffer))


class KVCache(Cache):
    """The cache handed to the model: one `LayerKV` per layer, compressed by `policy` to `budget`.

    `budget` is the resolved token count per layer and KV head (None: keep everything). With `threshold`, each
    compression keeps instead what reaches it by the policy's `threshold_score`, any count per head (`budget` is
    then the prompt: the most it may keep).
    `evict_every` is the slack of a decode-time policy: it evicts once `evict_every` entries have
    arrived beyond the budget. While the budget holds (always for a decode-time policy, during the
    prompt for a prefill-time one) a layer's buffer has `budget + headroom` slots, so prefill chunks
    and decode steps land without reallocating; a growing cache grows `growth` slots at a time.
    """

    def __init__(
        self,
        num_layers: int,
        batch_heads_dim: tuple[int, int, int],
        policy: Policy,
        budget: int | None,
        evict_every: int = 1,
        headroom: int = 1,
        growth: int = 256,
        observers: list[Policy] | None = None,
        limit_bytes: int | None = None,
        left_padding: torch.Tensor | None = None,
        phase: Phase = Phase.PREFILL,
        prompt_tokens: int | None = None,
        model: ModelInternals | None = None,
        kinds: list[LayerKind] | None = None,
        rows: RowAccounts | None = None,
        read_budget: int | None = None,
        threshold: Threshold | None = None,
    ) -> None:
        self.policy = policy
        if threshold is not None and batch_heads_dim[0] > 1:
            raise KvbenchError(f"policy '{policy.name}' at {threshold}: a threshold keeps each sequence's own count, "
                               "so it runs one sequence at a time")
        self.threshold = threshold
        self.threshold_seen = 0  # tokens seen at the last threshold compression (decode applies it every evict_every)
        self.kinds = kinds or [FULL] * num_layers  # how each layer attends (sliding window, soft cap)
        self.slides = True  # sliding layers drop what left their window (not during a probe, which is forgotten)
        self._model = model  # what a policy may read of the model (rotary embedding, output projections)
        self.limit_bytes = limit_bytes  # KV bytes allowed (a memory-pressure cell on CPU): beyond, out of memory
        self.left_padding = left_padding  # [batch] padding tokens in front of each row (batch > 1)
        # on the host, read once: each row's padding, and the most of any
        self.row_padding = [0] * batch_heads_dim[0] if left_padding is None else left_padding.tolist()
        self.max_padding = max(self.row_padding)
        # a batch: what each row's own cache would hold (kvbench/rows.py), for its record and its evictions
        self.rows = rows
        self.budget = budget
        # per-layer budgets: equal, unless the policy spreads the total unevenly (PyramidKV)
        self.layer_budgets = None if budget is None else policy.layer_budgets(budget, num_layers, prompt_tokens)
        self.evict_every = evict_every
        self.batch_heads_dim = batch_heads_dim
        self.headroom = headroom
        self.growth = growth
        # policies whose attention statistics this cache gathers: its own, or every policy of a shared prefill,
        # which times each one's (whatever their number) so a cell's prefill time counts its own statistics only
        self.times_observers = observers is not None
        if observers is None:
            observers = [policy]
        # one observer per statistic: two cells of a shared prefill that read the same one (h2o alone and
        # inside hybrid) gather it once
        leaves = [leaf for p in observers for leaf in p.observers()]
        self.observers = list({leaf.state_key: leaf for leaf in leaves}.values())
        self.observing = bool(self.observers)
        self.observe_seconds: dict[str, float] = {}
        self.phase = phase  # from here on the session's to set (kvbench/session.py)
        self.evictions = 0
        self.peak_bytes = 0
        # a sparse policy's tokens read per layer and head at a decode step (its `read_mask`); None: read them all
        self.read_budget = read_budget
        if read_budget is not None and any(kind.window is not None for kind in self.kinds):
            raise KvbenchError(f"policy '{policy.name}': sparse reading does not run on sliding-window layers")
        self._reads = ReadCounts(batch_heads_dim[0])
        self.folds = _folds(policy)
        layout = policy.layout()  # compressed storage, or None: plain slots in the model dtype
        if layout is not None:
            if any(kind.window is not None for kind in self.kinds):
                raise KvbenchError(f"policy '{policy.name}': compressed storage does not run on sliding-window layers")
            # rows of one length under a policy that evicts nothing hold alike: each is the batch's share
            if left_padding is not None or rows is not None or (batch_heads_dim[0] > 1 and policy.phases):
                raise KvbenchError(f"policy '{policy.name}': compressed storage runs at batch 1, or batches rows of "
                                   "one length without eviction")
            layout.fit(batch_heads_dim[2])
        # a layout fitted to the compressed prompt (ThinK's key channels) waits for it in plain layers
        self.prompt_layout = layout if layout is not None and layout.after_prompt else None
        stored_now = layout is not None and self.prompt_layout is None
        super().__init__(layers=[layout.layer(self, i) if stored_now else LayerKV(self, i) for i in range(num_layers)])

    def __deepcopy__(self, memo: dict) -> KVCache:
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        for layer in twin.layers:
            layer._owner = weakref.ref(twin)
        return twin

    @property
    def model(self) -> ModelInternals:
        if self._model is None:
            raise KvbenchError(f"policy '{self.policy.name}' reads the model, but this cache was built without one")
        return self._model

    def capacity_for(self, live: int, layer_idx: int, growth: int | None = None, headroom: int | None = None) -> int:
        """Slots a layer's buffer gets when it must hold `live` entries (with a row's own `growth` and `headroom`:
        what that row's cache alone would get)."""
        growth = self.growth if growth is None else growth
        headroom = self.headroom if headroom is None else headroom
        bounded = self.phase is Phase.PREFILL or self.policy.evicts_during_decode
        held = None  # the most entries the layer keeps between forwards, if bounded
        # a threshold bounds nothing ahead: the buffer fits what it kept, growing as a full cache does
        if self.budget is not None and self.threshold is None and bounded and self.policy.active(self) and \
                self.policy.bounded(self.layers[layer_idx]):
            held = self.layer_budgets[layer_idx]
        window = self.kinds[layer_idx].window
        if window is not None:
            held = window - 1 if held is None else min(held, window - 1)
        return live + growth if held is None else max(live, held + headroom)

    def note_allocation(self, new_bytes: int) -> None:
        """Called before a layer's buffers are replaced: old and new coexist for a moment, count both."""
        needed = self.physical_bytes() + new_bytes
        self.peak_bytes = max(self.peak_bytes, needed)
        if self.limit_bytes is not None and needed > self.limit_bytes:
            raise torch.OutOfMemoryError(f"KV cache needs {needed} bytes, over the limit of {self.limit_bytes}")

    def note_transient(self, nbytes: int) -> None:
        """A decoded copy of one layer's entries, alive while that layer attends (compressed storage)."""
        self.peak_bytes = max(self.peak_bytes, self.physical_bytes() + nbytes)

    def physical_bytes(self) -> int:
        return sum(layer.physical_bytes() for layer in self.layers if layer.is_initialized)

    def read_mask(self, layer_idx: int, query: torch.Tensor) -> torch.Tensor | None:
        """Called by the kvbench attention function before each layer's attention (see attention.py): at a decode
        step (one new token per row), the `[batch, heads, length]` slots the `query` `[batch, heads, 1, dim]`
        reads, as a sparse policy chooses them (None: every slot); every policy's step is counted in
        `kv_bytes_read`. A forward of several tokens (a prompt, a question) reads every slot, as Quest's does."""
        if self.phase is not Phase.DECODE or query.shape[-2] != 1:
            return None
        layer = self.layers[layer_idx]
        if layer_idx == 0:
            self._reads.steps += 1
        selected = None if self.read_budget is None else self.policy.read_mask(layer, query, self.read_budget)
        self._reads.count(self, layer, selected)
        if selected is None:
            return None
        return selected.repeat_interleave(query.shape[1] // selected.shape[1], dim=1)

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Called by the kvbench attention function after each layer's attention (see attention.py)."""
        if not self.times_observers:
            for policy in self.observers:
                policy.observe(self.layers[layer_idx], query, key, scaling, self.phase)
            return
        for policy in self.observers:
            synchronize(query.device)
            start = time.perf_counter()
            policy.observe(self.layers[layer_idx], query, key, scaling, self.phase)
            synchronize(query.device)
            self.observe_seconds[policy.state_key] = self.observe_seconds.get(policy.state_key, 0.0) + (
                time.perf_counter() - start)

    def slide(self, layer_idx: int) -> None:
        """Called by the kvbench attention function after each layer's attention (see attention.py)."""
        if self.slides:
            self.layers[layer_idx].slide()

    def layer_kinds(self) -> dict[str, int]:
        """How many layers of each kind (`full`, `sliding`) the model has: the record's `layer_kinds`."""
        return dict(Counter(kind.name for kind in self.kinds))

    def adopt(self, shared: KVCache) -> None:
        """Start from a shared prefill's cache (with this policy's statistics), as if this cache had run the prompt
        itself, so compressing it gives identical results. Plain layers borrow the shared entries (compression
        gathers the kept ones into this cache's own buffers: the shared cache plus the compressed one, never two
        full copies); compressed-storage layers encode a copy. Call `own_entries` after compressing."""
        if self.rows is not None and shared.rows is None:
            raise ValueError("a batch adopts a shared prefill of the same rows")
        stats = [*self.policy.state_keys(), PADDING]  # a batch's padding marks come along
        for mine, theirs in zip(self.layers, shared.layers, strict=True):
            if type(mine) is LayerKV:
                mine.borrow(theirs, stats=stats)
                if self.rows is not None and shared.rows is not None:
                    self.rows.adopted(mine.layer_idx, shared.rows)
            else:
                mine.copy_from(theirs, stats=stats)

    def own_entries(self) -> None:
        """Copy what compression left borrowed (a layer it did not shrink) into buffers of this cache's own."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.own()
                if self.rows is not None:
                    self.rows.owned(self, layer.layer_idx)

    def store_prompt(self) -> None:
        """Once the prompt is compressed, store it by a layout fitted to it (`Layout.after_prompt`): each plain layer
        becomes a stored one holding the same entries and statistics. A no-op for any other cache, or once done."""
        layout, self.prompt_layout = self.prompt_layout, None
        if layout is None:
            return
        stats = [*self.policy.state_keys(), PADDING]
        for index, plain in enumerate(self.layers):
            if plain.is_initialized:
                stored = layout.layer(self, index, prompt=plain)
                stored.copy_from(plain, stats=stats)
                self.layers[index] = stored

    def compress(self) -> None:
        """Evict down to the budget: always after a prefill chunk, every `evict_every` tokens in decode."""
        if self.budget is None or not self.policy.active(self):
            return
        if self.threshold is not None:
            self._compress_to_threshold()
            return
        slack = 1 if self.phase is Phase.PREFILL else self.evict_every
        for layer, budget in zip(self.layers, self.layer_budgets, strict=True):
            if not self.policy.bounded(layer):  # left whole by the policy (SimLayerKV's layers that are not lazy)
                continue
            if self.rows is not None:
                self._compress_rows(layer, budget, slack)
                continue
            excess = layer.length - budget
            if excess < slack:
                continue
            layer.heads_share_positions = False
            chosen = self.policy.select(layer, budget)
            if chosen is not None:  # uneven heads (Ada-KV): the policy picks the kept set itself
                before = layer.live_entries()
                layer.retain(chosen)
                self.evictions += before - layer.live_entries()
                continue
            scores = self.policy.score(layer, budget)
            padding = layer.padding()
            if padding is not None:  # a batch's padding goes first, whatever the policy protects
                scores = scores.masked_fill(padding, float("-inf"))
            unseen = layer.out_of_window()
            if unseen is not None:  # and on a sliding layer, what no query can see any more
                scores = scores.masked_fill(unseen, float("-inf"))
            evicted = scores.topk(excess, dim=-1, largest=False, sorted=False).indices
            if self.folds:  # a merging policy writes into the entries that stay
                layer.own()
            self.policy.fold(layer, evicted)
            layer.evict(evicted)
            self.evictions += evicted.numel()

    def _compress_to_threshold(self) -> None:
        """`compress` under a threshold: every layer keeps, per KV head, the entries whose `threshold_score` reaches
        it (the policy's protected, +inf ones always; never more than it holds), through `retain` as Ada-KV's
        uneven heads do. After each prompt chunk, and while decoding every `evict_every` tokens."""
        assert self.threshold is not None
        seen = self.layers[0].seen
        if self.phase is Phase.DECODE and seen - self.threshold_seen < self.evict_every:
            return
        self.threshold_seen = seen
        for layer in self.layers:
            layer.heads_share_positions = False
            keep = self.policy.threshold_score(layer) >= self.threshold.value
            padding = layer.padding()
            if padding is not None:  # slots an earlier compression left a head without: never kept
                keep &= ~padding
            unseen = layer.out_of_window()
            if unseen is not None:  # on a sliding layer, what no query can see goes whatever its score
                keep &= ~unseen
            before = layer.live_entries()
            layer.retain(keep)
            if self.phase is Phase.PREFILL:  # whatever share it kept, the prompt's compression frees what it dropped
                layer.fit()
            self.evictions += before - layer.live_entries()

    def layer_ratios(self) -> list[float]:
        """Each layer's entries held over what a full cache holds there (a threshold cell's record)."""
        batch, heads, _ = self.batch_heads_dim
        return [layer.live_entries() / (batch * heads * layer.full_entries())
                for layer in self.layers if layer.is_initialized and layer.seen]

    def _compress_rows(self, layer: LayerKV, budget: int, slack: int) -> None:
        """`compress` for a batch: each row evicts when and what its own cache would (its real entries beyond the
        budget, by its own scores), whatever the others do. The rows' counts are the host's (`self.rows`).

        Rows due to evict keep their best `budget` entries per head; the buffer shrinks to the widest row that
        remains, padding slots going first. When a row must drop more real entries than the others let the buffer
        shrink (a row due while a wider one is not), its extra drops become padding slots in place (`retain`)."""
        rows = self.rows
        assert rows is not None
        held = rows.held[layer.layer_idx]  # [rows, heads]
        lengths = held.max(axis=1)
        due = lengths - budget >= slack
        if not due.any():
            return
        padding = layer.padding()
        if padding is not None and layer.slots_in_order:  # a padded prompt's first compression
            self._compress_each_row(layer, budget, due)
            return
        layer.heads_share_positions = False
        target = np.where(due[:, None], np.minimum(held, budget), held)
        due_rows = torch.from_numpy(due).to(layer.device)[:, None, None]
        chosen = self.policy.select(layer, budget)
        if chosen is not None:  # uneven heads (Ada-KV): the policy picks a due row's kept set itself
            real = torch.ones_like(chosen) if padding is None else ~padding
            keep = torch.where(due_rows, chosen & real, real)
            layer.retain(keep)
            counts = keep.sum(dim=-1).cpu().numpy()
            self.evictions += rows.count_evictions(due, held.sum(axis=1) - counts.sum(axis=1))
            rows.kept(self, layer.layer_idx, due, counts)
            return
        scores = self.policy.score(layer, budget)
        unseen = layer.out_of_window()
        if unseen is not None:  # what no query can see goes first after padding: the lowest finite score
            scores = scores.masked_fill(unseen, torch.finfo(scores.dtype).min)
        if padding is not None:
            scores = scores.masked_fill(padding, float("-inf"))
        width = int(target.max())
        # the real entries each head loses when the buffer shrinks to `width` (padding first), beyond its target
        extra = (held - target) - np.clip(held - width, 0, None)
        if not extra.any():  # every due row drops what the buffer sheds: the decode step's fast path
            evicted = scores.topk(layer.length - width, dim=-1, largest=False, sorted=False).indices
            if self.folds:  # a merging policy writes into the entries that stay (it batches equal rows only)
                layer.own()
                rows.owned(self, layer.layer_idx, due)
            self.policy.fold(layer, evicted)
            layer.evict(evicted)
        else:
            assert not self.folds, "a merging policy batches rows of equal length only"
            rank = scores.argsort(dim=-1, descending=True).argsort(dim=-1)
            layer.retain(rank < torch.from_numpy(target).to(layer.device)[..., None])
        # an unbatched cache counts the slots it evicts: its fullest head's excess, in every head
        self.evictions += rows.count_evictions(due, (lengths - budget) * held.shape[1])
        rows.kept(self, layer.layer_idx, due, target)

    def _compress_each_row(self, layer: LayerKV, budget: int, due: np.ndarray) -> None:
        """A due row's prompt compressed by the very calls its unbatched cache makes, on its own slots in prompt
        order (`RowView`): once per prompt and row, so that what the policy keeps, its ties included, is what it
        keeps alone. The rows then keep what they chose, padding dropped (`retain`)."""
        rows = self.rows
        assert rows is not None and not self.folds, "a merging policy batches rows of one length only"
        held = rows.held[layer.layer_idx]
        padding = layer.padding()
        assert padding is not None
        keep = ~padding
        unseen = layer.out_of_window()
        # an unbatched cache counts the slots it evicts (its fullest head's excess, in every head), or what a
        # per-head selection dropped
        evicted = np.zeros(len(due), dtype=np.int64)
        for row in np.flatnonzero(due):
            start = layer.length - int(held[row].max())  # the row's left padding still held
            view = RowView(layer, int(row), start)
            chosen = self.policy.select(view, budget)
            if chosen is None:
                scores = self.policy.score(view, budget)
                if unseen is not None:
                    scores = scores.masked_fill(unseen[row : row + 1, :, start:], float("-inf"))
                dropped = scores.topk(view.length - budget, dim=-1, largest=False, sorted=False).indices
                chosen = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, dropped, False)
                evicted[row] = dropped.numel()
            else:
                evicted[row] = int(held[row].sum()) - int(chosen.sum())
            keep[row, :, start:] = chosen[0]
        layer.heads_share_positions = False
        layer.retain(keep)
        self.evictions += rows.count_evictions(due, evicted)
        rows.kept(self, layer.layer_idx, due, keep.sum(dim=-1).cpu().numpy())

    def select_rows(self, rows: list[int]) -> KVCache:
        """A copy of this batch's `rows` only (a shared prefill's cache, as fed), as a batch of them alone holds
        it: their entries, re-padded to the longest of them (one row: no padding, no accounts but its own), and
        their accounts. A cell that runs only some of a shared prefill's rows together starts from it."""
        accounts = self.rows
        assert accounts is not None, "select_rows() selects rows of a batch"
        fed = [self.layers[0].seen - self.row_padding[row] for row in rows]  # each row's own tokens
        seen = max(fed)
        padding = [seen - tokens for tokens in fed]
        twin = copy.copy(self)
        twin.batch_heads_dim = (len(rows), *self.batch_heads_dim[1:])
        twin.row_padding, twin.max_padding = padding, max(padding)
        twin.left_padding = torch.tensor(padding) if max(padding) else None
        twin.rows = accounts.select(rows, padding) if len(rows) > 1 else None
        twin._reads = self._reads.select(rows)
        twin.observe_seconds = dict(self.observe_seconds)
        index = torch.tensor(rows, device=self.layers[0].device)
        widths = accounts.held[:, rows].max(axis=(1, 2))
        assert all(layer.is_initialized for layer in self.layers), "select_rows() selects from a prompt fed"
        twin.layers = [layer.select_rows(twin, index, int(width), seen)
                       for layer, width in zip(self.layers, widths, strict=True)]
        if twin.rows is None:  # one row: its own counters, as its unbatched cache keeps them
            twin.peak_bytes = int(accounts.peak[rows[0]])
            for layer in twin.layers:
                layer.max_held = int(accounts.max_held[layer.layer_idx, rows[0]])
        return twin

    def row_stats(self, row: int) -> CacheStats:
        """What an unbatched cache of row `row` would report (`stats` of a batch counts the whole rectangle). A
        batch of compressed storage (rows of one length, nothing evicted) holds every row alike: a row's share."""
        if self.rows is not None:
            return dataclasses.replace(self.rows.stats(self, row), **self._reads.means(row))
        stats, rows = self.stats(), self.batch_heads_dim[0]
        return dataclasses.replace(stats, kv_bytes_live=stats.kv_bytes_live // rows,
                                   kv_bytes_physical=stats.kv_bytes_physical // rows,
                                   kv_bytes_peak=stats.kv_bytes_peak // rows, kv_bytes_full=stats.kv_bytes_full // rows,
                                   evictions=stats.evictions // rows, **self._reads.means(row))

    def padding(self, layer_idx: int) -> torch.Tensor | None:
        return self.layers[layer_idx].padding()

    def live_bytes(self) -> int:
        return sum(layer.live_bytes() for layer in self.layers if layer.is_initialized)

    def stats(self) -> CacheStats:
        batch, heads, head_dim = self.batch_heads_dim
        layers = [layer for layer in self.layers if layer.is_initialized]
        full_slot = 2 * batch * heads * head_dim * layers[0].dtype.itemsize if layers else 0
        full_entries = sum(layer.full_entries() for layer in layers)
        lengths = [layer.length for layer in layers] or [0]
        per_head = [layer.live_entries() / (batch * heads) for layer in layers] or [0]
        physical = self.physical_bytes()
        return CacheStats(
            kv_bytes_live=self.live_bytes(),
            kv_bytes_physical=physical,
            kv_bytes_peak=max(self.peak_bytes, physical),
            kv_bytes_full=full_entries * full_slot,
            kept_mean=sum(per_head) / len(per_head),
            kept_max=max(lengths),
            kept_max_ever=max((layer.max_held for layer in layers), default=0),
            evictions=self.evictions,
            **self._reads.means(),
        )
