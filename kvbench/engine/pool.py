"""A service's KV pool: rows of static buffers, allocated once, that every running request decodes in, one batched
step for all of them.

Each layer's pool is one `[rows, kv_heads, width, head_dim]` key and value buffer, with the slots' positions, the
policy's per-slot statistics and the step's write slots beside them. A request prefills in a session of its own (its
policy compresses the prompt as it does alone); it then joins: its cache goes static (kvbench/engine/step.py) and
its slots are copied into a free row, whose views its layers hold from then on, so its own buffers are freed. A
decode step is one forward of a batch of rows (the rows in use, rounded up to a power of two, so that a compiled step
has a graph per bucket): the projections, MLPs, attention and every layer's rule run on all rows at once, each row
with its own positions, write slots and free slots. So the ops a step dispatches do not grow with the requests
running, and each row's tokens are its run alone's up to the batched matmuls' rounding. After the step each request
counts what its heads hold on the host, by the same rules (`KVCache.account_step`). A request that ends leaves its
row; the last row in use moves into it, so the rows in use stay a prefix.

A row's width is what each layer's rule reads: a bounded rule's own width (the budget and its room), or, where
nothing bounds a layer, the most any request of the service holds once its prompt is compressed and its answer
written (`PoolPlan`). Rows share each layer's rule, so a policy joins a pool only where every request's decoding is
bounded alike and keeps its state per slot (`pool_plan` says why not otherwise, `PoolRefused` once a prompt shows
it; such a service steps its requests jointly, kvbench/engine/joint.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvbench.engine import session as engine_session
from kvbench.engine.cache import CacheSettings, KVCache, Phase, step_blocker
from kvbench.engine.instruments import Stopwatch
from kvbench.engine.layer import PADDING, LayerKV
from kvbench.engine.session import Session
from kvbench.engine.step import Append, EvictEvery, SlotRule, StaticSlots, rule_for, same_rule
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, Wrapper

if TYPE_CHECKING:
    from kvbench.engine.models import LoadedModel


@dataclass(frozen=True)
class PoolPlan:
    """Each layer's rule, shared by every row, and its slots per row."""

    rules: tuple[SlotRule, ...]
    widths: tuple[int, ...]

    def row_bytes(self, lm: LoadedModel) -> int:
        """One row's K/V bytes over the layers."""
        return sum(self.widths) * 2 * lm.kv_heads * lm.head_dim * lm.dtype.itemsize


def pool_blocker(policy: Policy) -> str | None:
    """Why requests under `policy` cannot decode in rows of one pool, in a few words; None: they can."""
    blocker = step_blocker(policy)
    if blocker is not None:
        return f"its decode steps run on the dynamic layout ({blocker})"
    if _bounds_change(policy):
        return "which layers it bounds changes while it runs"
    return None


def _bounds_change(policy: Policy) -> bool:
    """Whether `policy` or a stage of it decides which layers it bounds as it runs (`Policy.bounded`)."""
    if isinstance(policy, Wrapper):
        return type(policy).bounded is not Wrapper.bounded or any(map(_bounds_change, policy.stages))
    return type(policy).bounded is not Policy.bounded


def pool_plan(sessions: Sequence[Session], append_width: int) -> PoolPlan | str:
    """The plan of a pool for requests like `sessions` (sized, not yet fed: one per request), where no request
    holds more than `append_width` slots in a layer nothing bounds; or why they cannot share one."""
    blocker = pool_blocker(sessions[0].policy)
    if blocker is None and sessions[0].cache.threshold is not None:
        blocker = "a threshold keeps counts only the device knows"
    if blocker is not None:
        return blocker
    plans = [[rule_for(s.cache, layer) for layer in s.cache.layers] for s in sessions]
    rules = plans[0]
    if any(not all(map(same_rule, rules, other)) for other in plans[1:]):
        return "its budget bounds each request's decoding at its own length (a ratio of prompts of different lengths)"
    widths = tuple(append_width if rule.bound is None else rule.width(layer)
                   for rule, layer in zip(rules, sessions[0].cache.layers, strict=True))
    return PoolPlan(tuple(rules), widths)


class PoolRefused(Exception):
    """A request the pool cannot hold a row of, known only once its prompt is in: why, in a few words."""


@dataclass
class _LayerPool:
    """One layer's buffers over every row."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    stats: dict[str, torch.Tensor]
    write: torch.Tensor  # [rows, kv_heads]
    held: torch.Tensor  # [rows, kv_heads]: what each head holds, for an `EvictEvery` rule

    def buffers(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, *self.stats.values(), self.write, self.held]


class Pool:
    """`rows` rows of `plan`'s widths for `lm`'s sessions; `members[i]` is the session decoding in row i. Its
    steps are compiled where `lm`'s are (`--compile`). A pool that `grows` doubles its rows when a request finds
    none free (what an unbounded pool does)."""

    def __init__(self, lm: LoadedModel, plan: PoolPlan, rows: int, grows: bool = False) -> None:
        self.lm, self.device = lm, lm.device
        self.plan, self.rows, self.grows = plan, rows, grows
        self.members: list[Session] = []
        self.layers: list[_LayerPool] = []  # allocated when the first request joins (its statistics' shapes)
        # each row's token position and the one after it (`KVCache.position`, `fed`)
        self.position = self.fed = torch.zeros((rows, 1, 1), dtype=torch.long)
        self._buckets: dict[int, KVCache] = {}

    def has_room(self) -> bool:
        """Whether a request may join now."""
        return self.grows or len(self.members) < self.rows

    def physical_bytes(self) -> int:
        """The pool's K/V buffers' bytes (0 before the first request joins)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    # --- joining and leaving ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def join(self, session: Session) -> None:
        """Move `session` (prefilled, its prediction pending) into a free row: its cache goes static, its slots
        are copied into the row and its layers read and write the row from then on."""
        assert self.has_room(), "a request joins a pool with a free row"
        cache = session.cache
        if session.policy.schedule.decodes and any(layer.layer_stats for layer in cache.layers):
            # a window of each request's queries (R-KV), their moments (Expected Attention while decoding)
            raise PoolRefused("it keeps statistics of each request's queries per layer while decoding")
        if len(self.members) == self.rows and self.layers:
            self._grow()
        session.enter_decode()
        if not cache.go_static(compiled=True):
            raise PoolRefused("its cache does not step on static buffers once its prompt is in")
        if not self.layers:
            self._allocate(cache)
        row = len(self.members)
        for index, (layer, pool) in enumerate(zip(cache.layers, self.layers, strict=True)):
            static = layer.slots
            if not same_rule(static.rule, self.plan.rules[index]) or set(layer.slot_stats) != set(pool.stats):
                raise KvbenchError(f"a request's layer {index} steps by {static.rule}, the pool's rows by "
                                   f"{self.plan.rules[index]}: it cannot join")
            # what the request's layer holds: an appending layer's slots past those in use are free
            width = static.length if isinstance(static.rule, Append) else static.width
            if width > self.plan.widths[index]:
                raise KvbenchError(f"a request's layer {index} holds {width} slots, the pool's rows "
                                   f"{self.plan.widths[index]}: the pool was sized for less")
            for name, source in [("keys", layer.keys), ("values", layer.values), ("positions", layer.positions)]:
                target = getattr(pool, name)[row]
                target[:, :width] = source[0, :, :width]
                target[:, width:] = 0
            for name, stat in pool.stats.items():
                stat[row, :, :width] = layer.slot_stats[name][0, :, :width]
                stat[row, :, width:] = name == PADDING  # the row's slots beyond the request's are free
            pool.write[row] = static.write[0]
            rule = static.rule
            if isinstance(rule, EvictEvery):
                assert rule.held is not None
                pool.held[row] = rule.held[0]
        self.position[row] = cache.position[0]  # type: ignore[index]
        self.fed[row] = cache.fed[0]  # type: ignore[index]
        self.members.append(session)
        self._point(session, row)
        cache.pooled = True

    @torch.inference_mode()
    def leave(self, session: Session) -> None:
        """`session`'s request ended (its measurements taken): its row is free, the last row in use moves into it."""
        row = self.members.index(session)
        last = len(self.members) - 1
        if row != last:
            for pool in self.layers:
                for buffer in pool.buffers():
                    buffer[row] = buffer[last]
            self.position[row], self.fed[row] = self.position[last], self.fed[last]
            self.members[row] = self.members[last]
            self._point(self.members[row], row)
        self.members.pop()
        session.cache.pooled = False

    def _grow(self) -> None:
        """Twice the rows, the members' copied into the first ones."""
        old, position, fed = self.layers, self.position, self.fed
        self.rows, self.layers, self._buckets = 2 * self.rows, [], {}
        self._allocate(self.members[0].cache)
        for source, target in zip(old, self.layers, strict=True):
            for a, b in zip(source.buffers(), target.buffers(), strict=True):
                b[: a.shape[0]] = a
        self.position[: position.shape[0]], self.fed[: fed.shape[0]] = position, fed
        for row, session in enumerate(self.members):
            self._point(session, row)

    def _allocate(self, cache: KVCache) -> None:
        rows, (_, heads, dim) = self.rows, cache.batch_heads_dim
        self.position = torch.zeros((rows, 1, 1), dtype=torch.long, device=self.device)
        self.fed = torch.zeros_like(self.position)
        self.layers = []
        for layer, width in zip(cache.layers, self.plan.widths, strict=True):
            shape = (rows, heads, width)
            stats = {name: torch.zeros(shape + stat.shape[3:], dtype=stat.dtype, device=self.device)
                     for name, stat in layer.slot_stats.items()}
            stats[PADDING].fill_(True)
            self.layers.append(_LayerPool(
                keys=torch.zeros((*shape, dim), dtype=layer.keys.dtype, device=self.device),
                values=torch.zeros((*shape, dim), dtype=layer.values.dtype, device=self.device),
                positions=torch.zeros(shape, dtype=torch.long, device=self.device), stats=stats,
                write=torch.zeros((rows, heads), dtype=torch.long, device=self.device),
                held=torch.zeros((rows, heads), dtype=torch.long, device=self.device)))

    def _point(self, session: Session, row: int) -> None:
        """`session`'s layers read and write row `row` of the pool."""
        cache, rows = session.cache, slice(row, row + 1)
        for layer, pool, width in zip(cache.layers, self.layers, self.plan.widths, strict=True):
            _view(layer, pool, rows, width)
            static = layer.slots
            static.write, static.width = pool.write[rows], width
            if isinstance(static.rule, EvictEvery):
                static.rule.held = pool.held[rows]
        cache.position, cache.fed = self.position[rows], self.fed[rows]

    # --- the step ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step of every member, each fed its token (in row order): the next tokens' logits
        `[members, vocab]`. Each member counts the step as its own decode step."""
        members = self.members
        for session in members:
            for layer in session.cache.layers:
                static = layer.slots
                if isinstance(static.rule, Append) and static.length + static.steps >= static.width:
                    raise KvbenchError("a request outgrew its row of the pool: the pool was sized for less")
            session.cache.count_token()
        bucket = self._bucket(len(members))
        cache = self._bucket_cache(bucket)
        for index, layer in enumerate(cache.layers):
            held = np.zeros((bucket, cache.batch_heads_dim[1]), dtype=np.int64)
            held[: len(members)] = [s.cache.layers[index].slots.held[0] for s in members]
            layer.slots.held = held
            plan = getattr(layer.slots.rule, "plan", None)
            if plan is not None:
                plan(held)
        ids = torch.zeros((bucket, 1), dtype=torch.long)
        ids[: len(members), 0] = torch.tensor(list(tokens))
        lm = self.lm
        clock = Stopwatch(lm.devices)
        step = engine_session.compiled_step(self.device) if lm.compile else engine_session.static_step
        logits = step(lm, cache, ids.to(self.device))
        logits = logits[: len(members)].clone()  # a CUDA graph's output is overwritten by its next replay
        seconds = clock.lap()
        for session, row in zip(members, logits.split(1), strict=True):  # one op for every row
            session.cache.account_step(compiled=True)
            session.logits = row
            session.step_s.append(seconds)
        return logits

    def _bucket(self, running: int) -> int:
        return min(self.rows, 1 << max(0, running - 1).bit_length())

    def _bucket_cache(self, bucket: int) -> KVCache:
        """The cache the model steps for rows `[0, bucket)`: static layers over the pool's first rows."""
        if bucket in self._buckets:
            return self._buckets[bucket]
        first = self.members[0].cache
        heads, dim = first.batch_heads_dim[1:]
        settings = CacheSettings(budget=first.budget, evict_every=first.evict_every, headroom=first.headroom,
                                 growth=first.growth)
        cache = KVCache(len(self.layers), (bucket, heads, dim), self.members[0].policy, settings,
                        phase=Phase.DECODE, model=self.lm.internals, kinds=first.kinds)
        cache.layer_budgets = first.layer_budgets
        rows = slice(0, bucket)
        for layer, pool, rule, width in zip(cache.layers, self.layers, self.plan.rules, self.plan.widths,
                                            strict=True):
            layer.lazy_initialization(pool.keys, pool.values)
            _view(layer, pool, rows, width)
            rule = copy.copy(rule)  # the rows' own: an `EvictEvery` rule's counts on the device are the pool's
            if isinstance(rule, EvictEvery):
                rule.held = pool.held[rows]
            layer.static = StaticSlots(rule, pool.write[rows], np.zeros((bucket, heads), dtype=np.int64), width,
                                       width, had_padding=True)
            layer.slots_in_order = layer.heads_share_positions = False
        cache.position, cache.fed, cache.static, cache.pooled = self.position[rows], self.fed[rows], True, True
        if self.lm.compile and self.device.type == "cuda":
            cache._pin_for_graphs()
        self._buckets[bucket] = cache
        return cache


def _view(layer: LayerKV, pool: _LayerPool, rows: slice, width: int) -> None:
    """`layer`'s buffers become the pool's rows `rows`, all `width` slots of them read by its step."""
    layer.keys, layer.values, layer.positions = pool.keys[rows], pool.values[rows], pool.positions[rows]
    layer.slot_stats = {name: stat[rows] for name, stat in pool.stats.items()}
    layer.length = width
