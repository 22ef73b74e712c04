"""When requests arrive: a Poisson process at a rate, or a trace file's lines."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.errors import KvbenchError
from kvbench.results import read_jsonl


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
