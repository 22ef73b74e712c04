"""When requests arrive: a Poisson process at a rate, or a trace file's lines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.errors import KvbenchError


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
    # a user's file: its last line counts with or without a newline, and a line's number is its place in the file
    for number, text in enumerate(source.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            raise KvbenchError(f"load trace {path}:{number}: not JSON: {text[:80]}") from None
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
