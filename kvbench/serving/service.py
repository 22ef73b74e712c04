"""The service's loop: arrivals, admission, one prefill at a time, the joint decode step of the running requests,
and their ends (kvbench/serving/__init__.py tells how it runs)."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbench.engine.accounting import kept_mean
from kvbench.engine.generation import Prompt, stopped
from kvbench.engine.instruments import PeakMemory
from kvbench.engine.models import LoadedModel
from kvbench.engine.pool import Pool, PoolRefused, pool_plan
from kvbench.engine.session import Session, step_together
from kvbench.engine.settings import RunSettings
from kvbench.policies.base import Policy
from kvbench.serving.arrivals import poisson_arrivals
from kvbench.serving.requests import Load, Request, Served
from kvbench.serving.scheduler import FirstComeFirstServed, Scheduler
from kvbench.serving.sizing import cache_need, need_tokens


class _Clock:
    """Seconds since the start, an idle wait skipped."""

    def __init__(self) -> None:
        self.start, self.skipped = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start + self.skipped

    def skip_to(self, moment: float) -> None:
        self.skipped += max(0.0, moment - self.now())


class Service:
    """`prompts` (in arrival order for an open loop) served under `load`, each request with a fresh copy of `policy`
    (its own state, as each sample of a sweep has) at `settings`. `policy` is prepared once here, before the clock
    starts (a server's start-up: what a calibrated policy reads is then kept per model). Every session's memory peaks
    are the service's (`memory`, entered by the caller); `on_step` sees the progress (requests ended, offered);
    `scheduler` decides admissions and preemptions (kvbench/serving/scheduler.py; first come, first served)."""

    def __init__(self, lm: LoadedModel, policy: Policy, settings: RunSettings, prompts: list[Prompt], load: Load,
                 memory: PeakMemory, on_step: Callable[[int, int], None] | None = None,
                 scheduler: Scheduler | None = None) -> None:
        self.lm, self.settings, self.load, self.memory = lm, settings, load, memory
        self.scheduler = scheduler or FirstComeFirstServed()
        self.policy, self.on_step = policy, on_step
        self.eos = lm.eos_token_ids
        if load.users is None:
            assert load.rate is not None or load.arrivals is not None, "open-loop load needs a rate or a trace"
            times = list(load.arrivals) if load.arrivals is not None else \
                poisson_arrivals(len(prompts), load.rate, load.seed)  # type: ignore[arg-type]
            self.requests = [Request(i, p, t) for i, (p, t) in enumerate(zip(prompts, times, strict=True))]
        else:  # a closed loop: each user's first request at 0, the next when the last one ended
            self.requests = [Request(i, p, 0.0 if i < load.users else float("inf"), user=i % load.users)
                             for i, p in enumerate(prompts)]
        self.needs = [cache_need(lm, policy, settings, p) for p in prompts]
        self.pool, self.joint_because = self._pool(prompts)
        self.queue: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.prefilling: Request | None = None  # admitted, its prompt being fed a chunk at a time
        self.unarrived = deque(self.requests)
        self.timeline: list[dict[str, Any]] = []
        self.preemptions = 0
        policy.prepare(lm)  # start-up: each request's copy then finds what it reads kept per model
        self.clock = _Clock()

    def run(self) -> Served:
        clock, told = self.clock, -1
        while any(not r.ended for r in self.requests):
            now = clock.now()
            if self.load.horizon_s is not None and now >= self.load.horizon_s:
                self._cut_at_horizon()
                break
            self._arrive(now)
            self._time_out(now)
            self._admit()
            self._prefill_chunk()
            if self.running:
                self._step()
            elif self.prefilling is None and not self.queue:  # idle up to the next arrival, or the horizon
                horizon = self.load.horizon_s
                clock.skip_to(self._next_arrival() if horizon is None else min(self._next_arrival(), horizon))
            ended = sum(r.ended for r in self.requests)
            if self.on_step and ended != told:
                self.on_step(ended, len(self.requests))
                told = ended
        pool = self.pool
        return Served(self.requests, self.timeline, self.preemptions, clock.now(), self.load.pool_bytes,
                      None if pool is None else pool.rows, None if pool is None else pool.physical_bytes(),
                      self.joint_because)

    def _pool(self, prompts: list[Prompt]) -> tuple[Pool | None, str | None]:
        """The pool the requests decode in, with a row each, or why they decode jointly instead
        (kvbench/engine/pool.py). A row holds the largest request once its prompt is compressed and its answer
        written; the pool has as many as its bytes hold, and grows by doubling where they are not bounded."""
        agnostic = self.settings.question == "agnostic"
        widest = max(need_tokens(self.policy, self.settings, len(p.context) + len(p.question), p.max_new_tokens,
                                 self.lm.num_layers).held + (len(p.question) if agnostic else 0) for p in prompts)
        plan = pool_plan([self._session(p) for p in prompts], widest)
        if isinstance(plan, str):
            return None, plan
        pool = self.load.pool_bytes
        if pool is None:
            return Pool(self.lm, plan, min(len(prompts), 4), grows=True), None
        return Pool(self.lm, plan, pool // plan.row_bytes(self.lm)), None

    def _session(self, prompt: Prompt) -> Session:
        """A request's session, sized for what it is fed and answers (the question after compression with
        `question: agnostic`)."""
        agnostic = self.settings.question == "agnostic"
        return Session(self.lm, dataclasses.replace(self.policy), self.settings,
                       prompt_tokens=len(prompt.context) + len(prompt.question),
                       arrival=len(prompt.question) if agnostic else 1,
                       adds=prompt.max_new_tokens + (len(prompt.question) if agnostic else 0))

    # --- the queue -------------------------------------------------------------------------------------
    def _next_arrival(self) -> float:
        return self.unarrived[0].arrival_s if self.unarrived else self.clock.now()

    def _arrive(self, now: float) -> None:
        while self.unarrived and self.unarrived[0].arrival_s <= now:
            request = self.unarrived.popleft()
            if self.load.max_queue is not None and len(self.queue) >= self.load.max_queue:
                self._reject(request, "queue full")
            else:
                self.queue.append(request)

    def _time_out(self, now: float) -> None:
        timeout = self.load.timeout_s
        if timeout is None:
            return
        for request in [r for r in self.queue if r.admitted_s is None and now - r.arrival_s > timeout]:
            self.queue.remove(request)
            self._reject(request, "timed out in the queue")

    def _reject(self, request: Request, why: str) -> None:
        request.rejected = why
        self._ended(request)

    def _ended(self, request: Request) -> None:
        """A closed loop's user sends its next request now."""
        if request.user is None:
            return
        following = next((r for r in self.unarrived if r.user == request.user), None)
        if following is not None:
            following.arrival_s = self.clock.now()
            self.unarrived = deque(sorted(self.unarrived, key=lambda r: r.arrival_s))

    def _cut_at_horizon(self) -> None:
        """What arrived by the horizon and has not ended is rejected; what had not arrived was never offered."""
        assert self.load.horizon_s is not None
        cut = [*self.running, *([self.prefilling] if self.prefilling else []), *self.queue, *self.unarrived]
        for request in cut:
            if self.pool is not None and request.session in self.pool.members:
                self.pool.leave(request.session)
            request.session, request.prefill = None, None
            if request.arrival_s <= self.load.horizon_s:
                request.rejected = "not ended by the horizon"
            else:
                request.offered = False
        self.running, self.prefilling, self.queue, self.unarrived = [], None, deque(), deque()

    # --- admission and prefill ---------------------------------------------------------------------------
    def _admitted(self) -> list[Request]:
        return [*self.running, *([self.prefilling] if self.prefilling else [])]

    def held_bytes(self) -> int:
        """Bytes the admitted requests' caches hold now."""
        return sum(r.session.cache.physical_bytes() for r in self._admitted() if r.session is not None)

    def reserved_bytes(self) -> int:
        """Bytes the admitted requests hold or will hold: each one's own now, or what its cache holds once its
        prompt is compressed, whichever is more (a request still prefilling: its peak)."""
        return sum(max(r.session.cache.physical_bytes(), self.needs[r.index].held if r.prefill is None else
                       max(self.needs[r.index])) for r in self._admitted() if r.session is not None)

    def _admit(self) -> None:
        """Start the prefill of the request the scheduler admits, if none is prefilling; or reject the one it turns
        away."""
        if self.prefilling is not None:
            return
        pool, rows = self.load.pool_bytes, self.pool
        decided = self.scheduler.admission(
            list(self.queue), self.running,
            lambda r: rows.has_room() if rows is not None else
            pool is None or self.reserved_bytes() + max(self.needs[r.index]) <= pool)
        if decided is None:
            return
        request = decided.request
        self.queue.remove(request)
        if decided.rejected is not None:
            self._reject(request, decided.rejected)
            return
        if request.admitted_s is None:
            request.admitted_s = self.clock.now()
        prompt, agnostic = request.prompt, self.settings.question == "agnostic"
        request.session = self._session(prompt)
        request.session.memory = self.memory
        request.prefill = request.session.prefill_chunks(prompt.context if agnostic else
                                                         prompt.context + prompt.question)
        self.prefilling = request

    def _prefill_chunk(self) -> None:
        """The prefilling request's next chunk (its whole prompt in `full` mode), fed as `generate` feeds it (the
        question after compression with `question: agnostic`); after its last one it joins the running batch."""
        request = self.prefilling
        if request is None:
            return
        assert request.session is not None and request.prefill is not None
        if next(request.prefill, "done") is None:
            return  # a chunk of a chunked prefill: more to come
        session, question = request.session, request.prompt.question
        if self.settings.question == "agnostic" and question:
            session.append(question)
        assert session.logits is not None
        request.tokens, request.prefill, self.prefilling = [int(session.logits.argmax(-1)[0])], None, None
        if request.first_token_s is None:
            request.first_token_s = self.clock.now()
        self.running.append(request)
        if self.pool is not None:
            self._join(session)
        self._finish_ended()

    def _join(self, session: Session) -> None:
        """The request's session takes a row of the pool; a policy whose first request shows that its rows cannot
        share one (`PoolRefused`) has all its requests step jointly instead."""
        assert self.pool is not None
        try:
            self.pool.join(session)
        except PoolRefused as refused:
            assert not self.pool.members, "the requests of one policy share the pool or none does"
            self.pool, self.joint_because = None, str(refused)

    # --- decoding -----------------------------------------------------------------------------------------
    def _step(self) -> None:
        """One decode step of the running requests (the pool's batched step, or a joint one), then the ends it
        reached and the pool's check."""
        sessions = [r.session for r in self.running if r.session is not None]
        evicted = sum(s.cache.evictions for s in sessions)
        if self.pool is None:
            stepped = self.running
            logits = step_together(sessions, [r.tokens[-1] for r in stepped])
        else:  # in the order of the pool's rows
            by_session = {id(r.session): r for r in self.running}
            stepped = [by_session[id(member)] for member in self.pool.members]
            logits = self.pool.step([r.tokens[-1] for r in stepped])
        for request, token in zip(stepped, logits.argmax(-1).tolist(), strict=True):
            request.tokens.append(int(token))
        # the pool's occupancy: the slots in use (a joint step's caches: the buffers they hold)
        held = self.held_bytes() if self.pool is None else sum(s.cache.live_bytes() for s in sessions)
        self.timeline.append({
            "t_s": round(self.clock.now(), 6),
            "running": len(self.running),
            "prefilling": int(self.prefilling is not None),  # a chunked prefill paused for this step
            "queued": len(self.queue),
            "pool_bytes": held,
            "evictions": sum(s.cache.evictions for s in sessions) - evicted,
            "kept_mean": float(np.mean([kept_mean(s.cache) for s in sessions])),
        })
        self._finish_ended()
        self._preempt()

    def _finish_ended(self) -> None:
        for request in [r for r in self.running if self._answered(r)]:
            self.running.remove(request)
            request.finished_s = self.clock.now()
            session = request.session
            assert session is not None
            session.generated_tokens = len(request.tokens)
            request.measured, request.session = session.measurements(), None
            if self.pool is not None:
                self.pool.leave(session)
            self._ended(request)

    def _answered(self, request: Request) -> bool:
        tokens, prompt = request.tokens, request.prompt
        return tokens[-1] in self.eos or len(tokens) >= prompt.max_new_tokens or stopped(self.lm, tokens, prompt.stop)

    def _preempt(self) -> None:
        """While the running caches outgrow the pool, the request the scheduler names (FCFS: the newest) goes back to
        the front of the queue, to be recomputed from its prompt; a request that outgrows the pool alone is
        rejected."""
        pool = self.load.pool_bytes
        while pool is not None and self.pool is None and self.running and self.held_bytes() > pool:
            newest = self.scheduler.preempted(self.running)
            self.running.remove(newest)
            newest.session, newest.tokens = None, []
            if not self.running:
                self._reject(newest, "outgrew the pool alone")
                return
            newest.times_preempted += 1
            self.preemptions += 1
            self.queue.appendleft(newest)
