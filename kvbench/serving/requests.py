"""What a service serves: the load it is under, each request and what happened to it, and what it served."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbench.engine.generation import Prompt
    from kvbench.engine.session import Session


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
    step) and its counters; the pool's rows and the bytes they were allocated, where the requests decoded in one
    (`joint_because`: why they decoded jointly instead)."""

    requests: list[Request]
    timeline: list[dict[str, Any]]
    preemptions: int
    duration_s: float
    pool_bytes: int | None
    pool_rows: int | None = None
    pool_allocated: int | None = None
    joint_because: str | None = None
