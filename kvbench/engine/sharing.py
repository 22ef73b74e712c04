"""A sweep's shared prefill: one forward over a prompt gathers the statistics of every policy that compresses it, and
each of those cells compresses from its cache instead of running the prompt again.

Cells that compress the prompt the same way (policy, resolved budget, buffer sizes) share that too: the first one
keeps its result for the others to copy."""

from __future__ import annotations

import contextlib
import copy
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from kvbench.engine.generation import left_padded
from kvbench.engine.layer import PADDING, LayerKV
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings, policy_budget, threshold_of
from kvbench.errors import KvbenchError
from kvbench.policies.base import observers_of, state_keys_of
from kvbench.policies.full import Full

if TYPE_CHECKING:
    from kvbench.engine.cache import KVCache
    from kvbench.engine.instruments import PeakMemory, Stopwatch
    from kvbench.engine.models import LoadedModel
    from kvbench.policies.base import Policy
    from kvbench.policies.budgets import Threshold


@dataclass
class SharedPrefill:
    """One forward over a prompt, gathering every listed policy's statistics; each cell of a sweep that
    compresses this prompt starts from its cache instead of running the prompt again (compressing straight
    from it into buffers of its own). Cells that compress it the same way (policy, resolved budget) share that
    too: `wanted` counts them, and the first one's result is kept in `compressed` for the others to copy."""

    cache: KVCache
    logits: torch.Tensor
    seconds: float
    memory: PeakMemory
    wanted: Counter[str] = field(default_factory=Counter)
    compressed: dict[str, tuple[Policy, KVCache, float]] = field(default_factory=dict)

    def select(self, rows: list[int], users: Sequence[tuple[Policy, RunSettings]] = ()) -> SharedPrefill:
        """The prefill of a batch's `rows` only (in that order), for cells that run those rows together; `users`
        are their (policy, settings), as `shared_prefill` takes them."""
        part = SharedPrefill(select_rows(self.cache, rows), self.logits[rows], self.seconds, self.memory)
        part.wanted = wanted_compressions(users, part.fed - part.cache.row_padding[0])
        return part

    @property
    def fed(self) -> int:
        """Tokens the forward fed each row, its left padding included."""
        return self.cache.layers[0].seen

    def seconds_for(self, policy: Policy) -> float:
        """The forward's time without the other policies' statistics: what `policy` alone would have spent."""
        spent = self.cache.observe_seconds
        own = sum(spent.get(leaf.state_key, 0.0) for leaf in {p.state_key: p for p in observers_of(policy)}.values())
        return self.seconds - sum(spent.values()) + own

    def compress_for(self, session: Session, ids: torch.Tensor, clock: Stopwatch) -> tuple[Policy, KVCache, float]:
        """The policy and cache `session` continues with after its prefill of `ids` (this prompt, into an empty
        session): its own cache compressed from this one, or a copy of what a cell that compresses alike kept.
        Also the seconds its prefill counts besides `clock`'s: its statistics' share of the shared forward, and
        the compression a copy did not spend (charged as if it had)."""
        if session.settings.prefill == "chunked" or session.seen or self.fed != ids.shape[1] \
                or self.cache.row_padding != session.cache.row_padding:
            raise ValueError("a shared prefill serves only a `full` prefill of the same prompt")
        statistics_s = self.seconds_for(session.policy)
        cache = session.cache
        wanted = compression_key(session.policy, session.budget, cache.threshold)
        self.wanted[wanted] -= 1
        sizing = [cache.headroom, cache.growth] if cache.rows is None else \
            [cache.rows.headroom.tolist(), cache.rows.growth.tolist()]
        key = json.dumps([wanted, *sizing, cache.evict_every])
        if key in self.compressed and not session.settings.fidelity:
            policy, kept, seconds = self.compressed[key]
            if self.wanted[wanted] <= 0:  # the last cell to want it takes it
                del self.compressed[key]
            else:
                policy, kept = copy.deepcopy((policy, kept))
            clock.lap()
            return policy, kept, statistics_s + seconds
        adopt(cache, self.cache)
        session.policy.after_prompt(session, ids)
        cache.compress()
        own_entries(cache)
        if self.wanted[wanted] > 0 and cache.evictions and not session.settings.fidelity:
            seconds = clock.lap()
            self.compressed[key] = (*copy.deepcopy((session.policy, cache)), seconds)
            clock.lap()  # the copy kept for the others is not this cell's work
            return session.policy, cache, statistics_s + seconds
        return session.policy, cache, statistics_s


def compression_key(policy: Policy, budget: int | None, threshold: Threshold | None = None) -> str:
    """What a shared prompt's compression depends on besides the prompt: cells with one key compress it alike."""
    return json.dumps([policy.describe(), budget, *([threshold.describe()] if threshold else [])], sort_keys=True,
                      default=str)


def wanted_compressions(users: Sequence[tuple[Policy, RunSettings]], prompt_tokens: int) -> Counter[str]:
    """How many of the cells that adopt a shared prefill (each its policy and settings) compress it each way: the
    first of those that compress alike keeps its result for the others to copy."""
    wanted: Counter[str] = Counter()
    for policy, setting in users:
        with contextlib.suppress(KvbenchError):  # a cell that cannot run this budget fails on its own
            wanted[compression_key(policy, policy_budget(policy, setting, prompt_tokens, chunked=False),
                                   threshold_of(setting))] += 1
    return wanted


def shared_prefill(lm: LoadedModel, ids: list[int] | list[list[int]], observers: list[Policy],
                   settings: list[RunSettings] | None = None) -> SharedPrefill:
    """The prompt's forward once (or a batch's prompts, left-padded into one forward), gathering every
    `observers` policy's statistics, for cells to adopt. `settings`, paired with `observers`, are those of the
    cells that will adopt it: the ones that compress it alike then compress it once."""
    prompts = [row for row in ids if isinstance(row, list)] or [cast("list[int]", ids)]
    batch = left_padded(lm, prompts) if len(prompts) > 1 else None
    for policy in observers:  # each gathers its statistics here: made ready for the model as its own session would
        policy.prepare(lm)
    session = Session(lm, Full(), RunSettings(), prompt_tokens=[len(p) for p in prompts], adds=0,
                      observers=observers, left_padding=None if batch is None else batch[1])
    with session:
        session.prefill(prompts[0] if batch is None else batch[0])
    assert session.logits is not None and session.memory is not None, "measured over a prefill"
    wanted = wanted_compressions(list(zip(observers, settings or [], strict=False)), len(prompts[0]))
    return SharedPrefill(session.cache, session.logits, session.prefill_s, session.memory, wanted)


def adopt(cache: KVCache, shared: KVCache) -> None:
    """Start from a shared prefill's cache (with this policy's statistics), as if `cache` had run the prompt
    itself, so compressing it gives identical results. Plain layers borrow the shared entries (compression
    gathers the kept ones into `cache`'s own buffers: the shared cache plus the compressed one, never two
    full copies); compressed-storage layers encode a copy. Call `own_entries` after compressing."""
    if cache.rows is not None and shared.rows is None:
        raise ValueError("a batch adopts a shared prefill of the same rows")
    stats = [*state_keys_of(cache.policy), PADDING]  # a batch's padding marks come along
    for mine, theirs in zip(cache.layers, shared.layers, strict=True):
        if type(mine) is LayerKV:
            mine.borrow(theirs, stats=stats)
            if cache.rows is not None and shared.rows is not None:
                cache.rows.adopted(mine.layer_idx, shared.rows)
        else:
            mine.copy_from(theirs, stats=stats)


def own_entries(cache: KVCache) -> None:
    """Copy what compression left borrowed (a layer it did not shrink) into buffers of `cache`'s own."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.own()
            if cache.rows is not None:
                cache.rows.owned(cache, layer.layer_idx)


def select_rows(cache: KVCache, rows: list[int]) -> KVCache:
    """A copy of batch `cache`'s `rows` only (a shared prefill's cache, as fed), as a batch of them alone holds
    it: their entries, re-padded to the longest of them (one row: no padding, no accounts but its own), and
    their accounts. A cell that runs only some of a shared prefill's rows together starts from it."""
    accounts = cache.rows
    assert accounts is not None, "select_rows() selects rows of a batch"
    fed = [cache.layers[0].seen - cache.row_padding[row] for row in rows]  # each row's own tokens
    seen = max(fed)
    padding = [seen - tokens for tokens in fed]
    twin = copy.copy(cache)
    twin.batch_heads_dim = (len(rows), *cache.batch_heads_dim[1:])
    twin.row_padding, twin.max_padding = padding, max(padding)
    twin.left_padding = torch.tensor(padding) if max(padding) else None
    twin.rows = accounts.select(rows, padding) if len(rows) > 1 else None
    twin.reads = cache.reads.select(rows)
    twin.observe_seconds = dict(cache.observe_seconds)
    index = torch.tensor(rows, device=cache.layers[0].device)
    widths = accounts.held[:, rows].max(axis=(1, 2))
    assert all(layer.is_initialized for layer in cache.layers), "select_rows() selects from a prompt fed"
    twin.layers = [layer.select_rows(twin, index, int(width), seen)
                   for layer, width in zip(cache.layers, widths, strict=True)]
    if twin.rows is None:  # one row: its own counters, as its unbatched cache keeps them
        twin.peak_bytes = int(accounts.peak[rows[0]])
        for layer in twin.layers:
            layer.max_held = int(accounts.max_held[layer.layer_idx, rows[0]])
    return twin
