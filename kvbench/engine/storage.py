"""Compressed cache storage: every token kept, in fewer bytes than the model dtype, in tiers by age.

A `Layout` lists tiers from the newest tokens to the oldest. Each tier but the last holds a fixed number of
recent tokens, rounded up to whole `group`s, in a ring indexed by position (no slot moves as tokens age);
the last holds every older token in the cache's movable slots, so an eviction policy composed with a storage
evicts compressed entries exactly as it evicts plain ones. Tokens move to the next tier `group` at a time
(KIVI quantizes keys over groups of tokens, so a group is encoded whole).

A layout with `channel_scores` (ThinK's key channels) is fitted to the compressed prompt: the cache holds the
prompt in plain layers until it is compressed, then stores it (`KVCache.store_prompt`, `Layout.layer(prompt=...)`).

Attention reads a decoded copy of the layer (no fused dequantizing kernel here): one layer's full-precision
K/V exists during its attention, and `kv_bytes_peak` counts it. A layer without a layout never comes here.

A decode step reads nothing back from the device: which positions each tier holds, and while nothing was evicted
which slot holds them, are counted on the host. On a layer that evicted, the slots of a group that ages into the
next tier are found on the device (as many per head as the host knows can move); only when a key-scale table must
grow does it read the oldest position held, to give the rows of evicted groups back first (once per doubling).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.engine.codecs import Codec, Fields, Positions, put_rows
from kvbench.engine.layer import LayerKV, slot_index
from kvbench.errors import KvbenchError


@dataclass
class Tier:
    keys: Codec
    values: Codec
    tokens: int | None = None  # recent tokens it holds; None: the oldest tier, holding the rest


@dataclass
class Layout:
    """How a policy stores entries; `group` is the granularity at which tokens age from tier to tier."""

    name: str
    tiers: list[Tier]
    group: int = 1
    # each KV head's key channel scores `[B, H, D]` from a layer's compressed prompt (ThinK): such a layout stores
    # the prompt once it is compressed (`KVCache.store_prompt`), its key codecs keeping the best channels
    channel_scores: Callable[[LayerKV], torch.Tensor] | None = None

    @property
    def recent_tokens(self) -> list[int]:
        """The tokens each younger tier holds, newest first: every tier but the oldest says how many."""
        recent = [tier.tokens for tier in self.tiers[:-1] if tier.tokens is not None]
        assert len(recent) == len(self.tiers) - 1, f"{self.name}: a younger tier without its tokens"
        return recent

    @property
    def after_prompt(self) -> bool:
        """Whether the layout is fitted to the compressed prompt, so that plain layers hold the prompt until then."""
        return self.channel_scores is not None

    def fit(self, head_dim: int) -> None:
        """Fit the codecs to the model's head_dim, or say in one line why they cannot store it."""
        for tier in self.tiers:
            for codec in (tier.keys, tier.values):
                try:
                    codec.fit(head_dim)
                except ValueError as exc:
                    raise KvbenchError(f"{self.name}: {exc}") from None

    def layer(self, owner, layer_idx: int, prompt: LayerKV | None = None) -> StoredLayerKV:
        """A layer stored by a copy of this layout (codecs keep per-layer tables); one fitted to the prompt is given
        the plain layer holding it, compressed, and its codecs choose their channels from it."""
        layout = copy.deepcopy(self, {id(self.channel_scores): self.channel_scores})  # the scorer is not copied
        if self.channel_scores is not None:
            assert prompt is not None, f"{self.name} stores a prompt once it is compressed"
            scores = self.channel_scores(prompt)
            for tier in layout.tiers:
                tier.keys.choose_channels(scores)
        return StoredLayerKV(owner, layer_idx, layout)


class StoredLayerKV(LayerKV):
    """A layer whose entries are stored by a `Layout`. Policies see the same slots, positions and statistics
    as on a plain layer; `live_keys()` decodes."""

    def __init__(self, owner, layer_idx: int, layout: Layout) -> None:
        super().__init__(owner, layer_idx)
        self.layout = layout
        self.final = layout.tiers[-1]
        self.fields: Fields = {}  # the oldest tier's per-slot fields, "keys.<name>" / "values.<name>"
        self.rings: list[Fields] = []  # each younger tier's ring, one cell per position modulo its size (+1 spare)
        self.ring_sizes = [_round_up(tokens, layout.group) + (layout.group if i == 0 else 0)
                           for i, tokens in enumerate(layout.recent_tokens)]
        self.starts = [0] * len(self.ring_sizes)  # first position of each younger tier, newest first
        self.in_order = True  # slot s holds position s in every head: nothing was evicted (the host's to know)

    # --- transformers Cache layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, head_dim = self.owner.batch_heads_dim
        self._entry_bytes = _entry_bytes(self.final, head_dim, self.dtype)
        self._ring_bytes = sum(batch * heads * (size + 1) * _entry_bytes(tier, head_dim, self.dtype)
                               for tier, size in zip(self.layout.tiers, self.ring_sizes, strict=False))
        self.owner.note_allocation(self._ring_bytes)
        self.rings = [{name: torch.zeros((batch, heads, size + 1) + shape, dtype=dtype, device=self.device)
                       for name, (shape, dtype) in _fields(tier, head_dim, self.dtype).items()}
                      for tier, size in zip(self.layout.tiers, self.ring_sizes, strict=False)]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # the new tokens attend in full precision (as KIVI's prefill does); they are stored compressed after
        keys, values = self._decoded(extra=key_states.shape[-2])
        keys[:, :, self.length :], values[:, :, self.length :] = key_states, value_states
        self.owner.note_transient(keys.nbytes + values.nbytes)
        self._store(keys, values, self._append(key_states.shape[-2]))
        return keys, values

    def _adopt_entries(self, other: LayerKV) -> None:
        in_order = torch.arange(self.length, device=self.device).expand_as(self.live_positions())
        self.in_order = self.length == self.seen and torch.equal(self.live_positions(), in_order)
        assert other.values is not None, "a layer adopted from holds entries"
        self._store(other.live_keys(), other.values[:, :, : self.length], new_from=0)

    def evict(self, evicted: torch.Tensor) -> None:
        if evicted.shape[-1]:
            self.in_order = False
        super().evict(evicted)

    def retain(self, keep: torch.Tensor) -> None:
        self.in_order = False
        super().retain(keep)

    def truncate(self, count: int) -> None:
        raise KvbenchError("compressed storage cannot forget tokens it has stored (a probe needs plain slots)")

    # --- storage --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.positions.shape[-1] if self.allocated else 0

    def live_keys(self) -> torch.Tensor:
        return self._decoded()[0]

    def live_values(self) -> torch.Tensor:
        return self._decoded()[1]

    def entry_bytes(self) -> int:
        return self._entry_bytes

    def physical_bytes(self) -> int:
        tables = sum(codec.table_bytes() for tier in self.layout.tiers for codec in (tier.keys, tier.values))
        return super().physical_bytes() + self._ring_bytes + tables

    def live_bytes(self) -> int:
        if not self.allocated:  # initialized, nothing stored yet
            return 0
        padding = self.padding()
        if self.in_order and padding is None:  # each tier holds a range of positions in every head: the host knows
            return self._live_bytes_in_order()
        positions = self.live_positions()
        held = torch.ones_like(positions, dtype=torch.bool) if padding is None else ~padding
        tiers = self._tiers(positions)
        total = 0
        for index, tier in enumerate(self.layout.tiers):
            in_tier = held & (tiers == index)
            total += int(in_tier.sum()) * _entry_bytes(tier, self.owner.batch_heads_dim[2], self.dtype)
            total += tier.keys.table_bytes(positions, in_tier) + tier.values.table_bytes(positions, in_tier)
        return total

    def _live_bytes_in_order(self) -> int:
        batch, heads, head_dim = self.owner.batch_heads_dim
        bounds = [self.seen, *self.starts, 0]
        total = 0
        for index, tier in enumerate(self.layout.tiers):
            held = range(bounds[index + 1], bounds[index])
            total += batch * heads * len(held) * _entry_bytes(tier, head_dim, self.dtype)
            total += tier.keys.table_bytes(held) + tier.values.table_bytes(held)
        return total

    def _buffers(self) -> list[torch.Tensor]:
        return [self.positions, *self.fields.values(), *self.slot_stats.values()]

    def _allocate_entries(self, capacity: int) -> None:
        batch, heads, head_dim = self.owner.batch_heads_dim
        self.fields = {name: torch.zeros((batch, heads, capacity) + shape, dtype=dtype, device=self.device)
                       for name, (shape, dtype) in _fields(self.final, head_dim, self.dtype).items()}

    def _tiers(self, positions: torch.Tensor, starts: list[int] | None = None) -> torch.Tensor:
        """Each slot's tier, by `starts` (the current ones by default): 0 for the newest, len(ring_sizes) for the
        oldest."""
        tiers = torch.zeros_like(positions)
        for start in self.starts if starts is None else starts:  # compared with plain numbers: nothing copied over
            tiers += positions < start
        return tiers

    def _decoded(self, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The live entries in full precision, `[B, H, length + extra, D]` each in slot order (the `extra` last
        slots left for the caller to fill)."""
        batch, heads, head_dim = self.owner.batch_heads_dim
        # one slot past the live ones at least: the younger tiers' unused ring cells are written there, then
        # overwritten by the caller (or cut off)
        keys, values = (torch.empty((batch, heads, self.length + max(extra, 1), head_dim), dtype=self.dtype,
                                    device=self.device) for _ in range(2))
        if self.length:
            self._decode_into(keys, values)
        return keys[:, :, : self.length + extra], values[:, :, : self.length + extra]

    def _decode_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, _ = self.owner.batch_heads_dim
        positions = self.live_positions()
        if not self.starts or self.starts[-1] > 0:  # the oldest tier holds something
            # in order, it holds the first slots (positions the host knows); otherwise any, so every slot is decoded
            # and the younger tiers' slots overwritten below
            held = self.starts[-1] if self.in_order and self.starts else self.length
            _decode(self.final, {name: buffer[:, :, :held] for name, buffer in self.fields.items()},
                    range(held) if self.in_order else positions, keys[:, :, :held], values[:, :, :held])
        bounds = [self.seen, *self.starts]
        slots = torch.arange(self.length, device=self.device)
        for index, (tier, ring, size) in enumerate(zip(self.layout.tiers, self.rings, self.ring_sizes, strict=False)):
            start, end = bounds[index + 1], bounds[index]
            if end <= start:
                continue  # an empty tier
            # each ring cell's slot, found by scattering slot numbers into the cells; cells no live slot holds (and
            # the spare) point to the slot past the live ones
            mine = (positions >= start) & (positions < end)
            slot_of_cell = torch.full((batch, heads, size + 1), self.length, device=self.device)
            slot_of_cell.scatter_(2, torch.where(mine, positions % size, size), torch.where(mine, slots, self.length))
            cell_positions = (start + (torch.arange(size + 1, device=self.device) - start) % size).expand(
                batch, heads, size + 1)
            tier_keys, tier_values = _decode(tier, ring, cell_positions)
            put_rows(keys, slot_of_cell, tier_keys)
            put_rows(values, slot_of_cell, tier_values)

    def _store(self, keys: torch.Tensor, values: torch.Tensor, new_from: int) -> None:
        """Encode the slots that are new (from `new_from`) or changed tier since the last call; `keys` and
        `values` hold every live slot in full precision."""
        first_new = self.seen - (self.length - new_from)  # the position of the first new slot
        earlier = self.starts
        before = [min(bound, first_new) for bound in (first_new, *earlier)]  # each tier's end at the last call
        self.starts, start = [], self.seen
        for tokens in self.layout.recent_tokens:  # each younger tier ends where the newer one starts, group-aligned
            start = max(0, (start - tokens) // self.layout.group * self.layout.group)
            self.starts.append(start)
        after = [self.seen, *self.starts, 0]
        # tier i holds positions [after[i + 1], after[i]); those beyond what it held before join it now
        joining = [(max(after[index + 1], before[index]), after[index]) for index in range(len(self.layout.tiers))]
        if not self.in_order and any(low < min(high, first_new) for low, high in joining):
            # entries aged on a layer that evicted: where? At most this many per head move
            moving = min(self.length, sum(max(0, high - low) for low, high in joining))
            self._store_found(keys, values, new_from, earlier, moving)
            return
        offset = 0 if self.in_order else new_from - first_new  # the slot of a position that joins a tier
        for index, (low, high) in enumerate(joining):
            if low < high:
                slots = slice(low + offset, high + offset)
                positions = self.positions[:, :, slots]
                self._encode(index, keys[:, :, slots], values[:, :, slots], slots, positions,
                             torch.ones_like(positions, dtype=torch.bool), newest=self.seen - 1)

    def _store_found(self, keys: torch.Tensor, values: torch.Tensor, new_from: int, earlier: list[int],
                     moving: int) -> None:
        """`_store` where the slots to encode are found on the device, from each slot's tier by the `earlier` starts
        and by the current ones: each head's `moving` slots most likely to have moved (all that did, then any)."""
        positions = self.live_positions()
        after = self._tiers(positions)
        moved = self._tiers(positions, earlier) != after
        moved[..., new_from:] = True
        slots = moved.to(torch.int8).topk(moving, dim=-1, sorted=False).indices  # [B, H, moving], distinct per head
        moved, after, positions = moved.gather(2, slots), after.gather(2, slots), positions.gather(2, slots)
        keys, values = keys.gather(2, slot_index(slots, keys)), values.gather(2, slot_index(slots, values))
        for index in range(len(self.layout.tiers)):
            self._encode(index, keys, values, slots, positions, moved & (after == index), newest=self.seen - 1)

    def _encode(self, index: int, keys: torch.Tensor, values: torch.Tensor, slots: slice | torch.Tensor,
                positions: torch.Tensor, chosen: torch.Tensor, newest: int) -> None:
        """Encode the `chosen` of these slots (the same `slots` in every head, or `[B, H, k]` per head) into tier
        `index`."""
        tier = self.layout.tiers[index]
        if index == len(self.rings) and not self.in_order:  # entries join the oldest tier: before a table grows,
            for codec in (tier.keys, tier.values):  # let it drop the rows of groups no slot holds any more
                if codec.frees_rows and not codec.has_row(newest):
                    codec.forget_before(int(self.live_positions().min()))
        encoded = {f"{kind}.{name}": field for kind, codec, x in (("keys", tier.keys, keys),
                                                                  ("values", tier.values, values))
                   for name, field in codec.encode(x, positions, chosen, newest).items()}
        if index < len(self.rings):
            size = self.ring_sizes[index]
            cells = torch.where(chosen, positions % size, size)  # the others write the spare cell
            for name, buffer in self.rings[index].items():
                buffer.scatter_(2, slot_index(cells, buffer), encoded[name])
        elif isinstance(slots, slice):
            for name, buffer in self.fields.items():
                buffer[:, :, slots] = torch.where(chosen[..., None], encoded[name], buffer[:, :, slots])
        else:
            for name, buffer in self.fields.items():
                per_head = slot_index(slots, buffer)
                buffer.scatter_(2, per_head, torch.where(chosen[..., None], encoded[name], buffer.gather(2, per_head)))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _fields(tier: Tier, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {f"{kind}.{name}": spec for kind, codec in (("keys", tier.keys), ("values", tier.values))
            for name, spec in codec.fields(head_dim, dtype).items()}


def _entry_bytes(tier: Tier, head_dim: int, dtype: torch.dtype) -> int:
    return tier.keys.entry_bytes(head_dim, dtype) + tier.values.entry_bytes(head_dim, dtype)


def _decode(tier: Tier, fields: Fields, positions: Positions, keys: torch.Tensor | None = None,
            values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    def of(kind: str) -> Fields:
        return {name.partition(".")[2]: field for name, field in fields.items() if name.startswith(kind + ".")}
    return tier.keys.decode(of("keys"), positions, keys), tier.values.decode(of("values"), positions, values)

