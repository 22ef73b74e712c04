"""The decode step on buffers that never move: where each new token goes, and which slot a policy's eviction frees.

While a cache decodes one token per row at a time, each layer reads its buffers as they are: the first `width`
slots of its buffer, of which the free ones (its `PADDING` stat) are masked. The new token is written into the layer's
`write` slot, always a free one, and after the attention the layer's rule chooses the next:

- `Append` (nothing bounds the layer now: `full`, a prefill-time policy while decoding): the next slot along.
- `Ring` (the oldest entry past the first `sinks` goes: window, streaming_llm, a sliding layer's window): the next
  slot around a ring of the slots past the sinks, which once every slot is written holds the oldest entry.
- `Overwrite` (a policy that scores entries and evicts one per step): the slot of the entry it scores lowest, or a
  free slot while one is left. The evicted entry's slot takes the next token; nothing moves.
- `EvictEvery` (a policy that evicts `every` entries at a time): when due, its lowest become free slots.

Nothing in the step reads the device back or allocates: the write slots and the position of the token live on the
device, and the host counts what each head holds by the same rules (`SlotRule.account`), for the records. So a step's
shapes never change, and it compiles to one graph (`Stepper`). The rules keep the cache's semantics exactly: a head
evicts when it holds `every` entries beyond its budget, down to the budget, as `kvbench/engine/eviction.py` decides it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvbench.engine.layer import PADDING, LayerKV

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache


@dataclass
class StaticSlots:
    """A layer's state while it steps on its buffers: its rule, the slot `[batch, kv_heads]` the next token goes
    to (on the device), what each head holds between steps (on the host), and the slots the attention reads."""

    rule: SlotRule
    write: torch.Tensor
    held: np.ndarray
    width: int
    length: int  # the layer's slots in use when it went static
    had_padding: bool  # the layer had a PADDING stat before (uneven heads, a batch's left padding)
    # an eager step of a layer whose entries fill a prefix of its slots (one row, heads alike, no window) reads just
    # that prefix, unmasked, as the dynamic layout does: bit for bit the attention a stock cache computes. A compiled
    # step reads every slot of `width`, masked, so that its shapes never change
    exact: bool = False
    filling: bool = False  # an exact step's prefix is not the whole width yet: the next slot along is free
    steps: int = 0

    def plan(self) -> int:
        """Before an exact step (on the host): the slots it reads, the new token's included."""
        read = min(int(self.held.max()) + 1, self.width)
        self.filling = read < self.width
        return read


class SlotRule:
    """How a layer in the static step chooses the slot of the next token, on the device, and what its heads hold
    after a step, on the host. `bound`: what each head holds between steps (None: no bound)."""

    counted = True  # its evictions are the policy's (a sliding window's are not: a stock cache drops those too)
    bound: int | None

    def width(self, layer: LayerKV) -> int:
        """Slots the step reads: the bound and the room for the token it adds before evicting."""
        assert self.bound is not None
        return self.bound + 1

    def first_write(self, layer: LayerKV, free: torch.Tensor) -> torch.Tensor:
        """The slot of the first token, `[batch, kv_heads]`: the first free one."""
        return free.to(torch.uint8).argmax(dim=-1)

    def next_slot(self, cache: KVCache, layer: LayerKV) -> None:
        """After the step's attention: the slot the next token goes to (in place, on the device)."""
        raise NotImplementedError

    def account(self, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`held` `[rows, heads]` after the token was added -> what the heads hold after the step, and each row's
        evictions as an unbatched cache counts them (its fullest head's excess, in every head)."""
        assert self.bound is not None
        due = held.max(axis=1) > self.bound
        dropped = np.where(due, (held.max(axis=1) - self.bound) * held.shape[1], 0)
        return np.minimum(held, self.bound), dropped


class Append(SlotRule):
    """A layer nothing bounds: the next slot along (its buffer was sized for what will be added)."""

    bound = None

    def width(self, layer: LayerKV) -> int:
        return layer.capacity

    def first_write(self, layer: LayerKV, free: torch.Tensor) -> torch.Tensor:
        # every row and head adds at the same slot, a batch's left padding staying in front
        return torch.full(free.shape[:2], layer.length, dtype=torch.long, device=free.device)

    def next_slot(self, cache: KVCache, layer: LayerKV) -> None:
        layer.slots.write.add_(1)

    def account(self, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return held, np.zeros(held.shape[0], dtype=np.int64)


@dataclass
class Ring(SlotRule):
    """The oldest entry past the first `sinks` goes: a ring over the slots past the sinks, once the entries are in
    position order (`first_write` sorts them). `counted`: the policy's evictions (window, streaming_llm), or a
    sliding layer's window, which a stock cache drops too."""

    bound: int
    sinks: int = 0
    counted: bool = True

    def first_write(self, layer: LayerKV, free: torch.Tensor) -> torch.Tensor:
        # each row's entries in position order, its free slots after them: the ring's next slot then holds the oldest
        order = layer.positions[:, :, : free.shape[-1]].masked_fill(free, torch.iinfo(torch.long).max).argsort(-1)
        layer.reorder(order)
        return (~layer.slot_stats[PADDING][:, :, : free.shape[-1]]).sum(dim=-1)

    def next_slot(self, cache: KVCache, layer: LayerKV) -> None:
        write = layer.slots.write
        after = write + 1
        write.copy_(torch.where(after < layer.slots.width, after, self.sinks))


@dataclass
class Overwrite(SlotRule):
    """A policy scoring entries, evicting one per step: the next token takes the slot of the entry it scores lowest
    (the entry is evicted), or a free one while a head has one (nothing is)."""

    bound: int

    def next_slot(self, cache: KVCache, layer: LayerKV) -> None:
        if layer.slots.filling:  # an exact step's prefix: the slot after it is free
            layer.slots.write.add_(1)
            return
        scores = victim_scores(cache, layer, self.bound)
        free = layer.live(layer.slot_stats[PADDING])
        torch.argmin(scores.masked_fill(free, float("-inf")), dim=-1, out=layer.slots.write)


@dataclass
class EvictEvery(SlotRule):
    """A policy evicting `every` entries at a time, when a head holds `every` beyond its budget: those it scores
    lowest become free slots, which the next tokens fill. Whether a step is due is the host's to know (`due`)."""

    bound: int
    every: int
    due: bool = False
    held: torch.Tensor | None = None  # [batch, kv_heads] on the device: what each head holds

    def width(self, layer: LayerKV) -> int:
        return self.bound + self.every

    def first_write(self, layer: LayerKV, free: torch.Tensor) -> torch.Tensor:
        self.held = (~free).sum(dim=-1)
        return super().first_write(layer, free)

    def next_slot(self, cache: KVCache, layer: LayerKV) -> None:
        assert self.held is not None
        self.held.add_(1)
        padding = layer.slot_stats[PADDING][:, :, : layer.slots.width]
        if self.due:
            scores = victim_scores(cache, layer, self.bound).masked_fill(padding, float("inf"))
            due = self.held.amax(dim=-1, keepdim=True) - self.bound >= self.every  # each row by its fullest head
            going = torch.where(due, self.held - self.bound, 0).clamp(min=0)  # below its budget, a head keeps all
            lowest = scores.topk(self.every, dim=-1, largest=False, sorted=True).indices
            padding.scatter_(-1, lowest, torch.arange(self.every, device=lowest.device) < going[..., None])
            self.held.sub_(going)
        layer.slots.write.copy_(padding.to(torch.uint8).argmax(dim=-1))

    def account(self, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        due = held.max(axis=1) - self.bound >= self.every
        dropped = np.where(due, (held.max(axis=1) - self.bound) * held.shape[1], 0)
        return np.where(due[:, None], np.minimum(held, self.bound), held), dropped

    def plan(self, held: np.ndarray) -> None:
        """Before a step: whether it evicts (a head will hold `every` beyond the budget once its token is in)."""
        self.due = bool((held.max(axis=1) + 1 - self.bound >= self.every).any())


def victim_scores(cache: KVCache, layer: LayerKV, budget: int) -> torch.Tensor:
    """The policy's scores of a layer's slots, what no query of a sliding layer can see lowest (as
    `eviction._scored` ranks them)."""
    scores = cache.policy.score(layer, budget)
    unseen = layer.out_of_window()
    return scores if unseen is None else scores.masked_fill(unseen, torch.finfo(scores.dtype).min)


def rule_for(cache: KVCache, layer: LayerKV) -> SlotRule:
    """The rule of `layer` in the decode phase, from what bounds it now: the policy's budget while it evicts during
    decoding, a sliding layer's window, or nothing."""
    policy, window = cache.policy, layer.kind.window
    bound = None
    if cache.budget is not None and policy.schedule.decodes and policy.bounded(layer):
        assert cache.layer_budgets is not None
        bound = cache.layer_budgets[layer.layer_idx]
    if window is not None and (bound is None or window - 1 <= bound):
        return Ring(window - 1, counted=False)  # what leaves the window goes: the policy's budget never binds
    if bound is None:
        return Append()
    if cache.evict_every > 1:
        return EvictEvery(bound, cache.evict_every)
    if policy.ring is not None and (window is None or policy.ring == 0):  # a sliding layer drops its sinks too
        return Ring(bound, sinks=policy.ring)
    return Overwrite(bound)


def enter(layer: LayerKV, rule: SlotRule, exact: bool) -> None:
    """Step `layer` on its buffers from now on: the rule's width of slots read, those past the live ones free, the
    first write slot chosen. Its buffer already has the room (`KVCache.capacity_for`). `exact`: eager steps may read
    just the prefix its entries fill, where they fill one (`StaticSlots.exact`)."""
    layer.own()
    width = rule.width(layer)
    assert layer.length <= width <= layer.capacity, "a static step reads slots the buffer has"
    held, had_padding, length = layer.held_counts(), PADDING in layer.slot_stats, layer.length
    layer.slot_stat(PADDING, dtype=torch.bool)
    free = layer.slot_stats[PADDING][:, :, :width]
    free[:, :, length:] = True
    # masked slots still take part in the attention's sums (their weight is 0): never-written memory, which may
    # hold a NaN, must not
    layer.keys[:, :, length:width] = 0
    layer.values[:, :, length:width] = 0
    write = rule.first_write(layer, free)
    layer.length = width
    prefix = exact and not had_padding and layer.owner.left_padding is None and layer.kind.window is None
    layer.static = StaticSlots(rule, write, held, width, length, had_padding, exact=prefix)
    if not isinstance(rule, Append):  # entries move and heads evict apart
        layer.slots_in_order = layer.heads_share_positions = False


def leave(layer: LayerKV) -> None:
    """Back to the dynamic layout (kvbench/engine/layer.py): each head's entries first, in slot order, the layer as
    wide as its widest head; the buffer stays."""
    static, layer.static = layer.static, None
    assert static is not None
    padding = layer.slot_stats[PADDING]
    if isinstance(static.rule, Append):  # nothing moved: the slots in use are the first ones
        layer.length = static.length + static.steps
    else:
        free = padding[:, :, : static.width].clone()
        free.scatter_(2, static.write[..., None], True)  # an evicted entry's slot, or a free one
        layer.length = int(static.held.max())
        layer.reorder(torch.sort(free.to(torch.int8), dim=-1, stable=True).indices)
        counts = torch.from_numpy(static.held).to(layer.device)
        padding[:, :, : layer.length] = torch.arange(layer.length, device=layer.device) >= counts[..., None]
    alike = bool((static.held == layer.length).all()) and layer.owner.left_padding is None
    if not static.had_padding and alike:
        del layer.slot_stats[PADDING]


def same_rule(a: SlotRule, b: SlotRule) -> bool:
    return type(a) is type(b) and a.bound == b.bound and getattr(a, "sinks", 0) == getattr(b, "sinks", 0)


# the stepper's step: the ids `[rows, 1]` in, the next token's logits `[rows, vocab]` out
Step = Callable[[torch.Tensor], torch.Tensor]
