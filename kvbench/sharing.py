"""A sweep's shared prefill: one forward over a prompt gathers the statistics of every policy that compresses it, and
each of those cells compresses from its cache instead of running the prompt again.

Cells that compress the prompt the same way (policy, resolved budget, buffer sizes) share that too: the first one
keeps its result for the others to copy. `kvbench.session` re-exports these names.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from kvbench.errors import KvbenchError
from kvbench.generation import left_padded
from kvbench.settings import RunSettings, policy_budget, threshold_of

if TYPE_CHECKING:
    from kvbench.budgets import Threshold
    from kvbench.cache import KVCache, LayerKV
    from kvbench.measure import PeakMemory, Stopwatch
    from kvbench.models import LoadedModel
    from kvbench.policies.base import Policy
    from kvbench.session import Session


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
        part = SharedPrefill(self.cache.select_rows(rows), self.logits[rows], self.seconds, self.memory)
        part.wanted = wanted_compressions(users, part.fed - part.cache.row_padding[0])
        return part

    @property
    def fed(self) -> int:
        """Tokens the forward fed each row, its left padding included."""
        return cast("list[LayerKV]", self.cache.layers)[0].seen  # transformers' `Cache` types them as its own kinds

    def seconds_for(self, policy: Policy) -> float:
        """The forward's time without the other policies' statistics: what `policy` alone would have spent."""
        spent = self.cache.observe_seconds
        own = sum(spent.get(leaf.state_key, 0.0) for leaf in {p.state_key: p for p in policy.observers()}.values())
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
        cache.adopt(self.cache)
        session.policy.after_prompt(session, ids)
        cache.compress()
        cache.own_entries()
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
    from kvbench.policies.full import Full
    from kvbench.session import Session  # the session re-exports this module

    prompts = [row for row in ids if isinstance(row, list)] or [cast("list[int]", ids)]
    batch = left_padded(lm, prompts) if len(prompts) > 1 else None
    session = Session(lm, Full(), RunSettings(), prompt_tokens=[len(p) for p in prompts], growth=0,
                      observers=observers, left_padding=None if batch is None else batch[1])
    with session:
        session.prefill(prompts[0] if batch is None else batch[0])
    assert session.logits is not None and session.memory is not None, "measured over a prefill"
    wanted = wanted_compressions(list(zip(observers, settings or [], strict=False)), len(prompts[0]))
    return SharedPrefill(session.cache, session.logits, session.prefill_s, session.memory, wanted)
