"""A service under load: requests arrive, wait for room in a pool of KV memory, prefill, join the running batch and
leave it at their end, on the engine's own sessions.

The scheduler is first come, first served, one prefill at a time: it admits the request at the head of the queue when
the pool has room for its cache and runs its prefill in a session of its own (one row, so its policy compresses the
prompt as it does alone); then the request joins the joint decode step of every running request
(kvbench/engine/joint.py). A `full` prefill runs whole between two decode steps (prefill-then-join, as vLLM's scheduler
without chunked prefill); a `chunked` one feeds one chunk between two decode steps (as vLLM's and Sarathi's chunked
prefill), so a long prompt stalls the running requests a chunk at a time. Room is judged before the prefill from the
request's lengths (`cache_need`: the prompt's full cache while a policy compresses it, then what the policy keeps plus
the output), beside what the admitted requests hold or will hold, and checked after every step against the bytes the
caches really hold: a pool outgrown by decoding preempts the newest running request, which goes back to the front of the
queue and is recomputed from its prompt (its answer is its run alone's again; vLLM re-prefills the prompt with the
output so far, which a prefill-time policy would then compress as prompt). A request waits at most `timeout_s` in the
queue, the queue holds at most `max_queue`, and nothing runs past `horizon_s`: each request offered ends finished or
rejected, with the reason; one the horizon came before (not arrived yet, or not sent yet by its closed-loop user) was
never offered.

Time is the wall clock from when the service is set up, except that an idle service skips to the next arrival
(nothing runs meanwhile, so no measurement changes). Setting up is a server's start-up, off the clock: the policy is
prepared once (its calibration artifacts read, the model's digest hashed, RazorAttention's calibration run), and what
that read or computed is kept per model, so each request's session finds it there and its times are its own work.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvbench.engine.session import step_together
from kvbench.errors import KvbenchError
from kvbench.generation import Prompt, stopped
from kvbench.measure import PeakMemory
from kvbench.models import LoadedModel
from kvbench.policies.base import Policy
from kvbench.session import Session
from kvbench.settings import RunSettings, resolve_budget


@dataclass(frozen=True)
class Load:
    """How requests arrive and what the service holds: Poisson arrivals at `rate` requests/s, a closed loop of `users`
    (each sends its next request when its last one ended), or a trace's `arrivals`; `requests` in all. `pool_bytes`
    of KV memory (None: unbounded). A request waits in the queue at most `timeout_s`, the queue holds at most
    `max_queue`, and whatever arrived but has not ended by `horizon_s` is rejected (what had not arrived by then is not
    offered). `slo_ttft_s` and `slo_tpot_s`: what a good request meets."""

    requests: int
    rate: float | None = None
    users: int | None = None
    arrivals: tuple[float, ...] | None = None  # a trace's arrival times, one per request
    pool_bytes: int | None = None
    timeout_s: float | None = None
    max_queue: int | None = None
    horizon_s: float | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    seed: int = 0


# why a request is turned away: its cache cannot fit the empty pool, its decoding outgrew the pool while it ran
# alone, it arrived at a full queue, waited past the timeout, or had arrived but not ended by the horizon
REJECTED = ("larger than the pool", "outgrew the pool alone", "queue full", "timed out in the queue",
            "not ended by the horizon")


@dataclass
class Request:
    """One request and what happened to it; times are seconds since the service started."""

    index: int
    prompt: Prompt
    arrival_s: float
    user: int | None = None
    admitted_s: float | None = None  # its first admission (a preempted request keeps it)
    first_token_s: float | None = None  # its first token, as the client received it
    finished_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    times_preempted: int = 0  # this request's own preemptions (the service's total: `Served.preemptions`)
    rejected: str | None = None  # why it was turned away: one of REJECTED
    offered: bool = True  # False: the horizon came before it arrived (or before its closed-loop user sent it)
    session: Session | None = None  # while it runs
    prefill: Iterator[None] | None = None  # its prefill's chunks still to run
    measured: dict[str, Any] = field(default_factory=dict)  # its session's measurements, taken as it finished

    @property
    def ended(self) -> bool:
        return self.finished_s is not None or self.rejected is not None or not self.offered

    def latencies(self) -> dict[str, Any]:
        """The record's latency columns (vLLM's definitions): time to first token from arrival, time per output
        token after the first, end-to-end latency, time waiting for admission."""
        assert self.finished_s is not None and self.first_token_s is not None and self.admitted_s is not None
        generated = len(self.tokens)
        return {
            "arrival_s": round(self.arrival_s, 6),
            "ttft_s": self.first_token_s - self.arrival_s,
            "tpot_s": (self.finished_s - self.first_token_s) / (generated - 1) if generated > 1 else None,
            "e2e_s": self.finished_s - self.arrival_s,
            "queue_s": self.admitted_s - self.arrival_s,
            "times_preempted": self.times_preempted,
        }


@dataclass
class Served:
    """What a run under load measured: every request (finished or rejected), the service's timeline (one entry per
    step) and its counters."""

    requests: list[Request]
    timeline: list[dict[str, Any]]
    preemptions: int
    duration_s: float
    pool_bytes: int | None


class _Clock:
    """Seconds since the start, an idle wait skipped."""

    def __init__(self) -> None:
        self.start, self.skipped = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start + self.skipped

    def skip_to(self, moment: float) -> None:
        self.skipped += max(0.0, moment - self.now())


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """`count` arrival times of a Poisson process of `rate` per second (exponential gaps), seeded; the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    return [0.0, *np.cumsum(gaps[1:]).tolist()]


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace: when it arrives (seconds from the start), and optionally its prompt (text, sent as a
    user turn and not scored) and its most output tokens."""

    arrival_s: float
    prompt: str | None = None
    max_tokens: int | None = None


def read_trace(path: str | Path) -> list[TraceRequest]:
    """A trace file, JSON lines of `{"arrival_s": 0.5, "prompt": "...", "max_tokens": 64}` (only `arrival_s` is
    needed), in arrival order; a bad line is a one-line error naming it."""
    from kvbench.results import read_jsonl

    source = Path(path)
    if not source.is_file():
        raise KvbenchError(f"load trace '{path}': no such file")
    requests = []
    for number, line in enumerate(read_jsonl(source), start=1):
        try:
            request = TraceRequest(**line)
            valid = isinstance(request.arrival_s, int | float) and request.arrival_s >= 0 and \
                (request.prompt is None or isinstance(request.prompt, str)) and \
                (request.max_tokens is None or isinstance(request.max_tokens, int) and request.max_tokens > 0)
        except TypeError:
            valid = False
        if not valid:
            raise KvbenchError(f"load trace {path}:{number}: want {{\"arrival_s\": seconds >= 0, \"prompt\": text, "
                               f"\"max_tokens\": a positive integer}} (only arrival_s needed), got {line}")
        requests.append(request)
    if not requests:
        raise KvbenchError(f"load trace '{path}': no requests in it")
    return sorted(requests, key=lambda r: r.arrival_s)


class Need(NamedTuple):
    """Slots per layer a request's cache holds at its largest (`peak`, while its prompt is compressed) and once its
    prompt is compressed, to its last token (`held`)."""

    peak: int
    held: int


def cache_need(lm: LoadedModel, policy: Policy, settings: RunSettings, prompt: Prompt) -> Need:
    """Bytes the request's cache holds at its largest and once its prompt is compressed, judged from its lengths
    before it runs (`need_tokens`)."""
    need = need_tokens(policy, settings, len(prompt.context) + len(prompt.question), prompt.max_new_tokens,
                       lm.num_layers)
    return Need(_bytes(lm, need.peak), _bytes(lm, need.held))


def need_tokens(policy: Policy, settings: RunSettings, prompt_tokens: int, max_new_tokens: int, layers: int) -> Need:
    """What a request's cache holds, as the session sizes its buffers: a full cache, its prompt plus output (its
    buffer grows by the answer at once). A policy that compresses a whole prompt holds all of it and, for a moment,
    one layer's compressed buffer beside it (the layers compress one after another); a chunked prefill holds the budget
    plus a chunk throughout. Either buffer has that room beyond the budget; a decode-time policy stays in it, a
    prefill-time one's output grows the buffer by the whole answer once the room is full (each layer's old buffer
    beside its new one for a moment). A storage layout's savings are not counted ahead."""
    budget = resolve_budget(settings.budget, prompt_tokens)
    schedule = policy.schedule
    if budget is None or not schedule.evicts or budget >= prompt_tokens:
        return Need(prompt_tokens + max_new_tokens, prompt_tokens + max_new_tokens)
    chunked = settings.prefill == "chunked"
    room = max(schedule.every or settings.evict_every, settings.prefill_chunk if chunked else 1)
    buffer = budget + room
    held = buffer if schedule.decodes or max_new_tokens <= room else buffer + 1 + max_new_tokens
    moment = -(-buffer // layers)  # one layer's old buffer beside the others' new ones, or the prompt's beside its own
    grown = held + moment if held > buffer else held
    return Need(max(grown, buffer if chunked else prompt_tokens + moment), held)


def pool_spec(text: str) -> tuple[int, str]:
    """A `kv_pool` as a config writes it: `(count, "bytes")` for `512MiB`, `(count, "tokens")` for `4096 tokens`."""
    from kvbench.estimate import parse_bytes

    words = text.split()
    if len(words) == 2 and words[1] == "tokens":
        if not words[0].isdigit() or int(words[0]) < 1:
            raise KvbenchError(f"kv_pool '{text}': a token count is a positive integer, as '4096 tokens'")
        return int(words[0]), "tokens"
    return parse_bytes(text), "bytes"


def pool_bytes(lm: LoadedModel, kv_pool: str | None, pressure: float | None) -> int | None:
    """The KV pool of a load cell on `lm`: `kv_pool` bytes or tokens of a full cache, or `pressure` (a share of the
    GPU memory free now, after the weights); None: unbounded."""
    if kv_pool is not None:
        count, unit = pool_spec(kv_pool)
        return count if unit == "bytes" else _bytes(lm, count)
    if pressure is None:
        return None
    if lm.device.type != "cuda":
        raise KvbenchError(f"load pressure {pressure} is a share of free GPU memory: on {lm.device.type}, give "
                           "kv_pool instead (bytes as 512MiB, or 4096 tokens)")
    return int(pressure * torch.cuda.mem_get_info(lm.device)[0])


def _bytes(lm: LoadedModel, tokens: int) -> int:
    """A single row's KV bytes for `tokens` entries in every layer (a sliding layer holds its window at most)."""
    slot = 2 * lm.kv_heads * lm.head_dim * lm.dtype.itemsize
    return sum(min(tokens, kind.window or tokens) for kind in lm.layer_kinds) * slot


class Service:
    """`prompts` (in arrival order for an open loop) served under `load`, each request with a fresh copy of `policy`
    (its own state, as each sample of a sweep has) at `settings`. `policy` is prepared once here, before the clock
    starts (a server's start-up: what a calibrated policy reads is then kept per model). Every session's memory peaks
    are the service's (`memory`, entered by the caller); `on_step` sees the progress (requests ended, offered)."""

    def __init__(self, lm: LoadedModel, policy: Policy, settings: RunSettings, prompts: list[Prompt], load: Load,
                 memory: PeakMemory,
                 on_step: Callable[[int, int], None] | None = None) -> None:
        self.lm, self.settings, self.load, self.memory = lm, settings, load, memory
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
        return Served(self.requests, self.timeline, self.preemptions, clock.now(), self.load.pool_bytes)

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
        """Start the head of the queue's prefill if none is running and the pool has room for it; one that could
        never fit is rejected."""
        if not self.queue or self.prefilling is not None:
            return
        request, pool = self.queue[0], self.load.pool_bytes
        if pool is not None and self.reserved_bytes() + max(self.needs[request.index]) > pool:
            if not self.running:
                self.queue.popleft()
                self._reject(request, "larger than the pool")
            return
        self.queue.popleft()
        if request.admitted_s is None:
            request.admitted_s = self.clock.now()
        prompt, agnostic = request.prompt, self.settings.question == "agnostic"
        request.session = Session(self.lm, dataclasses.replace(self.policy), self.settings,
                                  prompt_tokens=len(prompt.context) + len(prompt.question),
                                  arrival=len(prompt.question) if agnostic else 1,
                                  adds=prompt.max_new_tokens + (len(prompt.question) if agnostic else 0))
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
        self._finish_ended()

    # --- decoding -----------------------------------------------------------------------------------------
    def _step(self) -> None:
        """One joint decode step of the running requests, then the ends it reached and the pool's check."""
        sessions = [r.session for r in self.running if r.session is not None]
        evicted = sum(s.cache.evictions for s in sessions)
        logits = step_together(sessions, [r.tokens[-1] for r in self.running])
        for request, token in zip(self.running, logits.argmax(-1).tolist(), strict=True):
            request.tokens.append(int(token))
        held = self.held_bytes()
        self.timeline.append({
            "t_s": round(self.clock.now(), 6),
            "running": len(self.running),
            "prefilling": int(self.prefilling is not None),  # a chunked prefill paused for this step
            "queued": len(self.queue),
            "pool_bytes": held,
            "evictions": sum(s.cache.evictions for s in sessions) - evicted,
            "kept_mean": float(np.mean([s.cache.stats().kept_mean for s in sessions])),
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
            self._ended(request)

    def _answered(self, request: Request) -> bool:
        tokens, prompt = request.tokens, request.prompt
        return tokens[-1] in self.eos or len(tokens) >= prompt.max_new_tokens or stopped(self.lm, tokens, prompt.stop)

    def _preempt(self) -> None:
        """While the running caches outgrow the pool, the newest request goes back to the front of the queue, to be
        recomputed from its prompt; a request that outgrows the pool alone is rejected."""
        pool = self.load.pool_bytes
        while pool is not None and self.running and self.held_bytes() > pool:
            newest = self.running.pop()
            newest.session, newest.tokens = None, []
            if not self.running:
                self._reject(newest, "outgrew the pool alone")
                return
            newest.times_preempted += 1
            self.preemptions += 1
            self.queue.appendleft(newest)


def percentiles(values: list[float], name: str) -> dict[str, float | None]:
    """`<name>_p50`, `_p90` and `_p99` of `values` (None where there are none)."""
    return {f"{name}_p{q}": float(np.percentile(values, q)) if values else None for q in (50, 90, 99)}


def service_metrics(served: Served, load: Load) -> dict[str, Any]:
    """A load cell's service columns: what was offered (every request that arrived before the horizon), finished,
    rejected (by why) and preempted; throughput; TTFT, TPOT, end-to-end latency and queue wait at p50 / p90 / p99;
    goodput (finished requests per second that met the SLO: every bound given) and SLO attainment (their share of the
    offered); concurrency and pool use over the steps (mean, peak)."""
    offered = [r for r in served.requests if r.offered]
    finished = [r for r in served.requests if r.finished_s is not None]
    latency = [r.latencies() for r in finished]
    duration = max(served.duration_s, 1e-9)

    def good(row: dict[str, Any]) -> bool:
        tpot = row["tpot_s"] or 0.0
        return (load.slo_ttft_s is None or row["ttft_s"] <= load.slo_ttft_s) and \
            (load.slo_tpot_s is None or tpot <= load.slo_tpot_s)

    met = sum(map(good, latency))
    rejected: dict[str, int] = {}
    for request in served.requests:
        if request.rejected is not None:
            rejected[request.rejected] = rejected.get(request.rejected, 0) + 1
    steps = served.timeline
    return {
        "offered": len(offered),
        "finished": len(finished),
        "rejected": sum(rejected.values()),
        "rejected_why": rejected,
        "preemptions": served.preemptions,
        "duration_s": served.duration_s,
        "request_rate": len(finished) / duration,
        "output_tok_s": sum(len(r.tokens) for r in finished) / duration,
        "goodput": met / duration,
        "slo_attained": met / len(offered) if offered else None,
        **percentiles([row["ttft_s"] for row in latency], "ttft"),
        **percentiles([row["tpot_s"] for row in latency if row["tpot_s"] is not None], "tpot"),
        **percentiles([row["e2e_s"] for row in latency], "e2e"),
        **percentiles([row["queue_s"] for row in latency], "queue"),
        "concurrency_mean": float(np.mean([s["running"] for s in steps])) if steps else 0.0,
        "concurrency_peak": max((s["running"] for s in steps), default=0),
        "pool_bytes": served.pool_bytes,
        "pool_used_mean": float(np.mean([s["pool_bytes"] for s in steps])) if steps else 0.0,
        "pool_used_peak": max((s["pool_bytes"] for s in steps), default=0),
    }
