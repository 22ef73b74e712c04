"""A transformers `Cache` that physically holds only the KV entries a policy keeps.

One `LayerKV` per layer stores the entries (kvbench/engine/layer.py); kvbench/engine/eviction.py decides what a
compression keeps and the cache applies it; kvbench/engine/accounting.py measures bytes held, peaked and read;
kvbench/engine/sharing.py starts a cache from a shared prefill's entries; kvbench/engine/step.py lays the layers out for
static decode steps. The cache sizes the layers' buffers, bounds them by the budget, and counts allocations against a
memory limit.

A policy with a storage layout (quant, mixed_precision, lowrank, think, or `storage:` on an eviction policy) gets
`StoredLayerKV` layers instead (kvbench/engine/storage.py): the same slots, holding compressed entries. A layout
fitted to the compressed prompt (ThinK's key channels) gets them once the prompt is compressed (`store_prompt`).
"""

from __future__ import annotations

import copy
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, cast

import torch
from transformers.cache_utils import Cache

from kvbench.engine.accounting import CacheStats, ReadCounts, cache_stats, layer_ratios, row_stats
from kvbench.engine.attention import FULL, LayerKind
from kvbench.engine.eviction import Decision, decide
from kvbench.engine.instruments import synchronize
from kvbench.engine.layer import PADDING, LayerKV
from kvbench.engine.row_accounts import RowAccounts
from kvbench.engine.step import Append, EvictEvery, SlotRule, enter, leave, rule_for, same_rule
from kvbench.errors import KvbenchError
from kvbench.policies.base import (
    Policy,
    fold_evicted,
    folds,
    observers_of,
    sparse_reads,
    spread_budgets,
    state_keys_of,
)

if TYPE_CHECKING:
    from kvbench.engine.models import ModelInternals
    from kvbench.engine.storage import Layout
    from kvbench.policies.budgets import Threshold

# plugin code imports these from here
__all__ = ["PADDING", "CacheSettings", "CacheStats", "KVCache", "LayerKV", "Phase"]


class Phase(str, Enum):
    """Where a session is: compressing a prompt, or decoding after it. Only the session sets it (a str, so
    policies compare it with "prefill")."""

    PREFILL = "prefill"
    DECODE = "decode"



@dataclass(frozen=True)
class CacheSettings:
    """How a `KVCache` bounds and sizes its layers.

    `budget` is the resolved token count per layer and KV head (None: keep everything). With `threshold`, each
    compression keeps instead what reaches it by the policy's `threshold_score`, any count per head (`budget` is then
    the prompt: the most it may keep). `evict_every` is the slack of a decode-time policy: it evicts once
    `evict_every` entries have arrived beyond the budget. While the budget holds (always for a decode-time policy,
    during the prompt for a prefill-time one) a layer's buffer has `budget + headroom` slots, so prefill chunks and
    decode steps land without reallocating; a growing cache grows `growth` slots at a time. `limit_bytes`: the KV
    bytes allowed (a memory-pressure cell on CPU), beyond which it is out of memory. `read_budget`: a sparse policy's
    tokens read per layer and head at a decode step (its `read_mask`). `prompt_tokens`: the prompt a policy spreads
    its layer budgets over."""

    budget: int | None = None
    threshold: Threshold | None = None
    evict_every: int = 1
    headroom: int = 1
    growth: int = 256
    limit_bytes: int | None = None
    read_budget: int | None = None
    prompt_tokens: int | None = None


def step_blocker(policy: Policy) -> str | None:
    """Why `policy`'s decode steps run on the dynamic layout rather than on static buffers
    (kvbench/engine/step.py), in a few words; None: they step on static buffers, eager or compiled (`kvbench policies`
    lists it)."""
    if policy.schedule.when == "read":
        return "a sparse policy's reads are chosen on the dynamic layout"
    if policy.layout() is not None:
        return "compressed storage"
    if folds(policy):
        return "merging writes evicted entries into kept ones"
    return policy.static_blocker()


class KVCache(Cache):
    """The cache handed to the model: one `LayerKV` per layer of a `[batch, kv_heads, head_dim]` shape, compressed by
    `policy` as `settings` say. A batch (`left_padding` `[batch]`, padding tokens in front of each row) keeps each
    row's accounts in `rows` (row_accounts.py). `observers`: the policies whose attention statistics it gathers
    (default: its own; a shared prefill's are every cell's). `kinds`: how each layer attends; `model`: what a policy
    may read of the model (rotary embedding, output projections)."""

    layers: list[LayerKV]  # type: ignore[assignment]  # transformers' list admits any kind of layer; kvbench's are these

    def __init__(self, num_layers: int, batch_heads_dim: tuple[int, int, int], policy: Policy,
                 settings: CacheSettings = CacheSettings(), *, observers: list[Policy] | None = None,
                 left_padding: torch.Tensor | None = None, phase: Phase = Phase.PREFILL,
                 model: ModelInternals | None = None, kinds: list[LayerKind] | None = None,
                 rows: RowAccounts | None = None) -> None:
        self.policy = policy
        self.budget, self.threshold = settings.budget, settings.threshold
        self.evict_every, self.headroom, self.growth = settings.evict_every, settings.headroom, settings.growth
        self.limit_bytes, self.read_budget = settings.limit_bytes, settings.read_budget
        self.batch_heads_dim = batch_heads_dim
        self.kinds = kinds or [FULL] * num_layers
        self.slides = True  # sliding layers drop what left their window (not during a probe, which is forgotten)
        self._model = model
        self.left_padding = left_padding
        # on the host, read once: each row's padding, and the most of any
        self.row_padding = [0] * batch_heads_dim[0] if left_padding is None else left_padding.tolist()
        self.max_padding = max(self.row_padding)
        self.rows = rows
        # per-layer budgets: equal, unless the policy spreads the total unevenly (PyramidKV)
        self.layer_budgets = None if self.budget is None else \
            spread_budgets(policy, self.budget, num_layers, settings.prompt_tokens)
        self.threshold_seen = 0  # tokens seen at the last threshold compression (decode applies it every evict_every)
        self._gather_observers(observers)
        self.phase = phase  # from here on the session's to set (kvbench/engine/session.py)
        self.evictions = 0
        self.peak_bytes = 0
        self.reads = ReadCounts(batch_heads_dim[0])
        # while decoding on static buffers (kvbench/engine/step.py): the position `[batch, 1, 1]` of the token being
        # fed, and the one after it (`LayerKV.next_position`), on the device
        self.static = False
        self.pooled = False  # its static buffers are a row of a service's pool (kvbench/engine/pool.py)
        self.position: torch.Tensor | None = None
        self.fed: torch.Tensor | None = None
        # a decode-time policy that observes scores by each step's attention: the static step keeps its weights
        self.keeps_step_weights = self.observing and policy.schedule.decodes
        self.folds = folds(policy)
        layout = policy.layout()  # compressed storage, or None: plain slots in the model dtype
        self._check(layout)
        if layout is not None:
            layout.fit(batch_heads_dim[2])
        # a layout fitted to the compressed prompt (ThinK's key channels) waits for it in plain layers
        self.prompt_layout = layout if layout is not None and layout.after_prompt else None
        stored_now = layout is not None and self.prompt_layout is None
        super().__init__(layers=[layout.layer(self, i) if stored_now else LayerKV(self, i) for i in range(num_layers)])

    def _gather_observers(self, observers: list[Policy] | None) -> None:
        """The policies whose statistics this cache gathers, one per statistic: two cells of a shared prefill that
        read the same one (h2o alone and inside hybrid) gather it once. A shared prefill's cache times each one's,
        so that a cell's prefill time counts its own statistics only."""
        self.times_observers = observers is not None
        leaves = [leaf for p in observers or [self.policy] for leaf in observers_of(p)]
        self.observers = list({leaf.state_key: leaf for leaf in leaves}.values())
        self.observing = bool(self.observers)
        self.observe_seconds: dict[str, float] = {}

    def _check(self, layout: Layout | None) -> None:
        """What this cache cannot run, in one line each."""
        name, sliding = self.policy.name, any(kind.window is not None for kind in self.kinds)
        if self.threshold is not None and self.batch_heads_dim[0] > 1:
            raise KvbenchError(f"policy '{name}' at {self.threshold}: a threshold keeps each sequence's own count, "
                               "so it runs one sequence at a time")
        if self.read_budget is not None and sliding:
            raise KvbenchError(f"policy '{name}': sparse reading does not run on sliding-window layers")
        if layout is None:
            return
        if sliding:
            raise KvbenchError(f"policy '{name}': compressed storage does not run on sliding-window layers")
        # rows of one length under a policy that evicts nothing hold alike: each is the batch's share
        if self.left_padding is not None or self.rows is not None or \
                (self.batch_heads_dim[0] > 1 and self.policy.schedule.evicts):
            raise KvbenchError(f"policy '{name}': compressed storage runs at batch 1, or batches rows of one length "
                               "without eviction")

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
        bounded = self.phase is Phase.PREFILL or self.policy.schedule.decodes
        held = None  # the most entries the layer keeps between forwards, if bounded
        # a threshold bounds nothing ahead: the buffer fits what it kept, growing as a full cache does
        if self.budget is not None and self.threshold is None and bounded and \
                self.policy.bounded(self.layers[layer_idx]):
            assert self.layer_budgets is not None
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
            self.reads.steps += 1
        selected = None if self.read_budget is None else sparse_reads(self.policy, layer, query, self.read_budget)
        self.reads.count(self, layer, selected)
        if selected is None:
            return None
        return selected.repeat_interleave(query.shape[1] // selected.shape[1], dim=1)

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Called by the kvbench attention function after each layer's attention (see attention.py)."""
        try:
            self._observe(layer_idx, query, key, scaling)
        finally:  # held for this forward's observers only, never longer
            self.layers[layer_idx].attention_input = self.layers[layer_idx].step_weights = None

    def _observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
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

    def store_prompt(self) -> None:
        """Once the prompt is compressed, store it by a layout fitted to it (`Layout.after_prompt`): each plain layer
        becomes a stored one holding the same entries and statistics. A no-op for any other cache, or once done."""
        layout, self.prompt_layout = self.prompt_layout, None
        if layout is None:
            return
        stats = [*state_keys_of(self.policy), PADDING]
        for index, plain in enumerate(self.layers):
            if plain.is_initialized:
                stored = layout.layer(self, index, prompt=plain)
                stored.copy_from(plain, stats=stats)
                self.layers[index] = stored


    def compress(self) -> None:
        """Evict down to the budget (kvbench/engine/eviction.py decides what stays): after each prefill chunk, and while
        decoding once `evict_every` tokens arrived beyond it. A static step's rules evict on their own."""
        if self.static or self.budget is None or not self._threshold_due():
            return
        assert self.layer_budgets is not None
        slack = 1 if self.phase is Phase.PREFILL else self.evict_every
        for layer, budget in zip(self.layers, self.layer_budgets, strict=True):
            decision = decide(self, layer, budget, slack)
            if decision is not None:
                self._apply(layer, decision)

    def _threshold_due(self) -> bool:
        """Whether a threshold compresses now: after each prompt chunk, and every `evict_every` decoded tokens."""
        if self.threshold is None:
            return True
        seen = self.layers[0].seen
        if self.phase is Phase.DECODE and seen - self.threshold_seen < self.evict_every:
            return False
        self.threshold_seen = seen
        return True

    def _apply(self, layer: LayerKV, decision: Decision) -> None:
        """Make `layer` keep what `decision` says, and count what left."""
        layer.heads_share_positions = False
        if decision.evicted is not None:
            if self.folds:  # a merging policy writes into the entries that stay
                layer.own()
                if self.rows is not None:
                    self.rows.owned(self, layer.layer_idx, decision.due)
            fold_evicted(self.policy, layer, decision.evicted)
            layer.evict(decision.evicted)
        else:
            assert decision.keep is not None and not self.folds, "a merging policy batches rows of one length only"
            layer.retain(decision.keep)
            if decision.fit:
                layer.fit()
        if self.rows is None:
            self.evictions += int(decision.dropped[decision.due].sum())
        else:
            assert decision.held is not None, "a batch's decision says what each row holds"
            self.evictions += self.rows.count_evictions(decision.due, decision.dropped)
            self.rows.kept(self, layer.layer_idx, decision.due, decision.held)

    # --- the static decode step (kvbench/engine/step.py) ---------------------------------------------
    def static_blocker(self, compiled: bool = False) -> str | None:
        """Why this cache's decode steps run on the dynamic layout (`compiled`: or eager rather than compiled), in
        a few words; None: they step on static buffers."""
        if self.threshold is not None:
            return "a threshold keeps counts only the device knows"
        if self.times_observers and compiled:
            return "it times the statistics it gathers for other policies"
        return step_blocker(self.policy)

    def prepare_step(self, compiled: bool = False) -> bool:
        """Before a decode step's forward (one token per row): step on static buffers if this cache can (laying
        them out once), and count the token on the host. False: the step runs on the dynamic layout. A `compiled`
        step reads every slot of each layer's width (`StaticSlots.exact`)."""
        if not self.go_static(compiled):
            return False
        self.count_token()
        return True

    def go_static(self, compiled: bool = False) -> bool:
        """Lay the layers out on static buffers for the decode steps to come, if this cache can (a no-op while they
        still fit). False: its steps run on the dynamic layout."""
        if self.static and not self._static_still_fits(compiled):
            self.leave_static()
        if not self.static:
            if self.static_blocker(compiled) is not None or not all(layer.allocated for layer in self.layers):
                return False
            rules = [rule_for(self, layer) for layer in self.layers]
            for layer, rule in zip(self.layers, rules, strict=True):
                if rule.bound is not None and layer.length >= rule.width(layer):
                    return False  # it holds more than its rule keeps (adaptive's switch): compressed first
                if rule.width(layer) > layer.capacity and layer.length < layer.capacity:
                    return False  # its buffer grows to the width only once the slots it has are full
            self._enter_static(rules, compiled)
        return True

    def count_token(self) -> None:
        """A static step's token, counted on the host before its forward."""
        for layer in self.layers:
            static = layer.slots
            layer.seen += 1
            if static.exact:
                layer.length = static.plan()
            plan = getattr(static.rule, "plan", None)
            if plan is not None:
                plan(static.held)

    def _static_still_fits(self, compiled: bool) -> bool:
        """Whether each layer's rule is still what bounds it (adaptive switches at its limit), an appending layer's
        buffer has a slot left, and the layers were laid out for this kind of step."""
        for layer in self.layers:
            static = layer.slots
            if not same_rule(static.rule, rule_for(self, layer)) or (compiled and static.exact):
                return False
            if isinstance(static.rule, Append) and static.length + static.steps >= static.width:
                return False
        return True

    def _enter_static(self, rules: list[SlotRule], compiled: bool) -> None:
        for layer, rule in zip(self.layers, rules, strict=True):
            if layer.length >= layer.capacity:  # the token this step adds does not fit: as `LayerKV._append` grows
                layer._reallocate(self.capacity_for(layer.length + 1, layer.layer_idx))
            enter(layer, rule, exact=not compiled)
        seen = self.layers[0].seen
        device = self.layers[0].device
        pad = torch.zeros(self.batch_heads_dim[0], dtype=torch.long) if self.left_padding is None \
            else self.left_padding.to(torch.long)
        self.fed = (seen - pad).to(device)[:, None, None]
        self.position = self.fed - 1
        self.static = True
        if compiled and device.type == "cuda":
            self._pin_for_graphs()

    def _pin_for_graphs(self) -> None:
        """Tell the compiler the static step's tensors keep their addresses from step to step, so that its CUDA
        graphs read and write them in place (a graph copies the inputs it does not know to be static)."""
        state = [self.position, self.fed]
        for layer in self.layers:
            static = layer.slots
            state += [layer.keys, layer.values, layer.positions, *layer.slot_stats.values(), static.write]
            held = getattr(static.rule, "held", None)
            state += [held] if held is not None else []
        for tensor in state:
            torch._dynamo.mark_static_address(tensor)

    @torch.inference_mode()
    def leave_static(self) -> None:
        """Back to the dynamic layout (a no-op unless static): before a forward of several tokens, a probe, or what
        reads the cache's slots."""
        if not self.static:
            return
        for layer in self.layers:
            leave(layer)
        self.static, self.position, self.fed = False, None, None

    def open_step(self) -> None:
        """A static step's first device work: the position of its token (on the device, in place)."""
        assert self.position is not None and self.fed is not None
        self.position.add_(1)
        self.fed.add_(1)

    def close_step(self) -> None:
        """A static step's last device work: each layer's rule chooses the slot of the next token."""
        for layer in self.layers:
            layer.slots.rule.next_slot(self, layer)

    def account_step(self, compiled: bool = False) -> None:
        """After a static step, on the host: what each head of each layer holds, the evictions, the rows' accounts
        and the bytes read, by the layers' rules (as `compress` and `LayerKV._append` count them)."""
        self.reads.steps += 1
        reallocated = False
        heads = self.batch_heads_dim[1]
        for layer in self.layers:
            static, index = layer.slots, layer.layer_idx
            held = static.held + 1  # every row's token is its own in the decode phase
            if self.rows is not None:
                self.rows.appended(self, index, layer.seen - 1, 1, heads * layer.entry_bytes())
            self.reads.count_held(self, layer, held)
            layer.max_held = max(layer.max_held, int(held.max()))
            after, dropped = static.rule.account(held)
            due = dropped > 0
            if not static.rule.counted:
                if self.rows is not None:
                    self.rows.slid(self, index, cast(int, layer.kind.window))
            elif self.rows is None:
                self.evictions += int(dropped.sum())
            elif due.any():
                self.evictions += self.rows.count_evictions(due, dropped)
                self.rows.kept(self, index, due, after)
            static.held, static.steps = after, static.steps + 1
            if isinstance(static.rule, EvictEvery) and due.any() and static.exact:
                static.exact, layer.length = False, static.width  # the freed slots are holes: masked from now on
            if due.any() and not self.pooled:  # as an eviction gives back what a long prompt needed (`LayerKV.evict`)
                target = self.capacity_for(int(after.max()), index)
                if layer.capacity >= 2 * target:
                    layer._reallocate(target)
                    reallocated = True
        if reallocated and compiled and self.layers[0].device.type == "cuda":
            self._pin_for_graphs()
        if any(not same_rule(layer.slots.rule, rule_for(self, layer)) for layer in self.layers):
            assert not self.pooled, "a pool's rows keep their rules (`pool_blocker`)"
            self.leave_static()  # a policy bounds a layer now (adaptive at its limit): it compresses at once
            self.compress()

    def layer_ratios(self) -> list[float]:
        """Each layer's entries held over what a full cache holds there (a threshold cell's record)."""
        self.leave_static()
        return layer_ratios(self)

    def row_stats(self, row: int) -> CacheStats:
        """What an unbatched cache of row `row` would report (`stats` of a batch counts the whole rectangle)."""
        return row_stats(self, row)

    def padding(self, layer_idx: int) -> torch.Tensor | None:
        return self.layers[layer_idx].padding()

    def live_bytes(self) -> int:
        return sum(layer.live_bytes() for layer in self.layers if layer.is_initialized)

    def stats(self) -> CacheStats:
        self.leave_static()  # the slots a layer holds, on the layout the accounts read
        return cache_stats(self)
