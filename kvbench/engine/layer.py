"""One layer's store of a `KVCache`: `[batch, kv_heads, capacity, head_dim]` key and value buffers of which the first
`length` slots are live, with each entry's original position and the per-slot statistics policies keep.

Eviction fills the evicted slots with the survivors from the tail (or, when most entries go, gathers the survivors into
a smaller buffer), so a decode-time eviction costs O(evicted) copies and memory really stays at the budget. Slots are
not kept in position order: attention does not care (RoPE is already applied to the keys), and `positions` records
each entry's original position for the policies that need recency.

A sliding-window layer (`LayerKind.window`, from the model's config) holds at most `window - 1` entries between
forwards, as transformers' own sliding-window cache does: after each attention it drops the oldest beyond that,
which no later query can see.

The layer decides nothing: its cache (kvbench/engine/cache.py) sizes its buffers and kvbench/engine/eviction.py
decides what it keeps.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from kvbench.engine.attention import LayerKind
from kvbench.engine.row_accounts import rows_of

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache
    from kvbench.engine.step import StaticSlots

# the positions of a layer before its buffers are allocated (no slot yet)
UNALLOCATED = torch.empty(0, dtype=torch.long)
PADDING = "padding"  # per-slot stat: True where a head holds no entry (heads kept different counts)


class LayerKV(CacheLayerMixin):
    """One layer's physically evicting store. Policies read `keys`, `positions` and `slot_stat()`."""

    is_sliding = False
    is_compileable = False
    # `[batch, kv_heads, capacity, head_dim]`, allocated when the first tokens arrive (None before, as transformers'
    # layers start; a stored layer keeps its entries in `fields` instead)
    keys: torch.Tensor
    values: torch.Tensor

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
        self.positions = UNALLOCATED  # [batch, kv_heads, capacity] int64, with the entries' buffers
        self.slot_stats: dict[str, torch.Tensor] = {}  # per-slot policy state, moved with the slots
        self.layer_stats: dict[str, Any] = {}  # per-layer policy state (query statistics), copied with the layer
        # the new tokens' hidden states at the attention's input `[batch, new, hidden]`, while the observers run, for
        # a policy that asked for them (`attention.record_attention_inputs`); None otherwise
        self.attention_input: torch.Tensor | None = None
        # a static decode step's attention weights `[batch, kv_heads, group, slots]` (float32), while the observers
        # run, where a policy scores by them (`attention.query_weights`); None otherwise
        self.step_weights: torch.Tensor | None = None
        # the buffers are a shared prefill's (see `borrow`): read in place, never written; the first write moves
        # what this layer keeps into buffers of its own
        self.borrowed = False
        # while the cache decodes on buffers that never move (kvbench/engine/step.py): the rule, write slot and counts
        self.static: StaticSlots | None = None

    @property
    def owner(self) -> KVCache:
        owner = self._owner()
        assert owner is not None, "a layer is used only while its cache lives"
        return owner

    @property
    def slots(self) -> StaticSlots:
        """This layer's state in a static decode step (kvbench/engine/step.py), which it is in."""
        assert self.static is not None, "a layer stepping on static buffers"
        return self.static

    @property
    def allocated(self) -> bool:
        """Whether the slots' buffers exist (after the first tokens arrived)."""
        return self.positions is not UNALLOCATED

    # --- transformers Cache layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.static is not None:
            return self._write(key_states, value_states)
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

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A static decode step's token `[batch, kv_heads, 1, head_dim]` into each head's write slot (a free one),
        its statistics zeroed and its slot no longer free; the attention reads every slot of the step's width."""
        assert self.static is not None
        slot = self.static.write[..., None]  # [batch, kv_heads, 1]
        entry = slot[..., None].expand(*slot.shape, key_states.shape[-1])
        self.keys.scatter_(2, entry, key_states)
        self.values.scatter_(2, entry, value_states)
        position = self.owner.position
        assert position is not None, "a static step knows its token's position"
        self.positions.scatter_(2, slot, position.expand_as(slot))
        for stat in self.slot_stats.values():
            stat.scatter_(2, slot if stat.dim() == 3 else slot[..., None].expand(*slot.shape, stat.shape[3]), 0)
        return self.live(self.keys), self.live(self.values)

    def live(self, buffer: torch.Tensor) -> torch.Tensor:
        """A buffer's first `length` slots: the buffer itself when it has no more (a static step's usual case, where
        a slice is one more op dispatched)."""
        return buffer if buffer.shape[2] == self.length else buffer[:, :, : self.length]

    def reorder(self, order: torch.Tensor) -> None:
        """Move the first `order.shape[-1]` slots of every buffer into the order `order` `[batch, heads, n]` gives."""
        width = order.shape[-1]
        for buffer in self._buffers():
            buffer[:, :, :width] = gather_slots(buffer[:, :, :width], order)

    def held_counts(self) -> np.ndarray:
        """`[batch, kv_heads]` the entries each head holds (the host's count where it has one)."""
        owner = self.owner
        if self.static is not None:
            return self.static.held
        if owner.rows is not None:
            return owner.rows.held[self.layer_idx].copy()
        padding = self.padding()
        if padding is None:
            return np.full(owner.batch_heads_dim[:2], self.length)
        return (~padding).sum(dim=-1).cpu().numpy()

    def get_seq_length(self) -> int:
        return self.length

    def select_rows(self, owner: KVCache, rows: torch.Tensor, width: int, seen: int) -> LayerKV:
        """A copy of this layer's `rows` only, for `owner` (`select_rows` in sharing.py): `width` slots, each row's
        entries last in slot order (a prompt's, still in order, stay in order) behind its padding."""
        twin = copy.copy(self)
        twin._owner = weakref.ref(owner)
        padding = self.padding()
        held = (~padding if padding is not None else torch.ones_like(self.live_positions(), dtype=torch.bool))[rows]
        order = torch.sort(held.to(torch.int8), dim=-1, stable=True).indices[..., self.length - width :]
        def picked(buffer: torch.Tensor) -> torch.Tensor:
            return gather_slots(buffer[rows, :, : self.length], order)

        twin.keys, twin.values, twin.positions = picked(self.keys), picked(self.values), picked(self.positions)
        twin.slot_stats = {name: picked(stat) for name, stat in self.slot_stats.items()}
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
        return self.live(self.keys)

    def live_values(self) -> torch.Tensor:
        return self.live(self.values)

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
        return self.live(self.positions)

    def next_position(self) -> int | torch.Tensor:
        """The position the next token takes: `seen`, or per row `[batch, 1, 1]` in a left-padded batch (on the
        device while the cache steps statically: the host's counts are not read in a step)."""
        if self.static is not None:
            assert self.owner.fed is not None
            return self.owner.fed
        pad = self.owner.left_padding
        return self.seen if pad is None else self.seen - pad.to(self.device)[:, None, None]

    def slot_stat(self, name: str, width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-slot statistic `[batch, kv_heads, length(, width)]` that follows its entry when slots move."""
        if name not in self.slot_stats:
            shape = self.positions.shape + ((width,) if width else ())
            self.slot_stats[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.live(self.slot_stats[name])

    def held_slots(self) -> torch.Tensor:
        """`[batch, kv_heads, length]`, True on the slots that hold an entry (between the steps of a static decode, a
        head's write slot holds none: it is free, or its entry was evicted)."""
        if self.static is not None:
            free = self.slot_stats[PADDING][:, :, : self.static.width]
            if self.static.rule.bound is not None:  # a bounded rule's write slot may hold an evicted entry
                free = free.scatter(2, self.static.write[..., None], True)
            return ~free[:, :, : self.length]  # an exact step reads a prefix of the width
        padding = self.padding()
        return torch.ones_like(self.live_positions(), dtype=torch.bool) if padding is None else ~padding

    def padding(self) -> torch.Tensor | None:
        """`[batch, kv_heads, length]`, True on slots a head does not hold, once heads hold uneven counts."""
        stat = self.slot_stats.get(PADDING)
        return None if stat is None else self.live(stat)

    def full_entries(self) -> int:
        """Entries per KV head a stock cache would hold here: every token of a full layer, the last window - 1 of
        a sliding one."""
        return self.seen if self.kind.window is None else min(self.seen, self.kind.window - 1)

    def live_entries(self) -> int:
        """Entries held over all heads (padding slots excluded)."""
        if not self.allocated:  # initialized, buffers not allocated yet
            return 0
        if self.static is not None:
            return int(self.static.held.sum())
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
                buffer[:, :, :width] = gather_slots(buffer[:, :, : self.length], survivors)
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
        if self.kind.window is None or self.length < self.kind.window or self.static is not None:
            return  # a static step's rule drops what left the window
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
        old = self._buffers() if self.allocated else None
        self.owner.note_allocation(capacity * batch * heads * self.entry_bytes())
        self._allocate_entries(capacity)
        self.positions = torch.zeros((batch, heads, capacity), dtype=torch.long, device=self.device)
        self.slot_stats = {
            name: torch.zeros((batch, heads, capacity) + stat.shape[3:], dtype=stat.dtype, device=self.device)
            for name, stat in self.slot_stats.items()
        }
        self.borrowed = False
        # a static layer's slots past an exact step's prefix are its: free, or written by the steps to come
        kept = self.length if self.static is None else self.static.width
        if old is not None:
            for src, dst in zip(old, self._buffers(), strict=True):
                if order is None:
                    dst[:, :, :kept] = src[:, :, :kept]
                else:
                    dst[:, :, : order.shape[-1]] = gather_slots(src[:, :, : self.length], order)
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
            live.scatter_(2, slot_index(holes, buffer), gather_slots(live, sources))  # gather copies before writing
        self.length = keep
        target = self.owner.capacity_for(keep, self.layer_idx)
        if self.capacity >= 2 * target:  # give back the memory a long prompt needed
            self._reallocate(target)



def slot_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return index if like.dim() == 3 else index.unsqueeze(-1).expand(*index.shape, like.shape[-1])


def gather_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return buffer.gather(2, slot_index(index, buffer))
