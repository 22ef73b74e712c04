"""Capacity under a memory limit: the largest batch (at a context length) or the longest context (at a
batch) that completes prefill and a few decode steps, found by doubling then bisection."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvbench.engine.generation import generate_batch
from kvbench.engine.instruments import memory_pressure
from kvbench.engine.models import LoadedModel
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import Policy
from kvbench.tasks.corpus import haystack_text, load_corpus


@dataclass
class Search:
    """The answer and what it took: the largest size that fit, every (size, fit) probed in order, and
    the measurements of the run at the answer."""

    size: int
    probes: list[tuple[int, bool]] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)


def largest_fitting(fits: Callable[[int], dict[str, Any] | None], start: int, bound: int) -> Search:
    """The largest n in [start, bound] for which `fits(n)` returns measurements (None: it did not fit),
    assuming that whatever fits, anything smaller fits too: doubling from `start`, then bisection between
    the last fit and the first failure, O(log n) probes. Size 0 when even `start` does not fit."""
    search = Search(0)

    def probe(n: int) -> bool:
        measured = fits(n)
        search.probes.append((n, measured is not None))
        if measured is not None and n > search.size:
            search.size, search.measurements = n, measured
        return measured is not None

    low, high = 0, None  # low fits (0: nothing yet), high does not (None: not found yet)
    n = start
    while high is None:
        if probe(n):
            low = n
            if n == bound:
                return search
            n = min(2 * n, bound)
        else:
            high = n
    while high - low > 1 and low:
        middle = (low + high) // 2
        if probe(middle):
            low = middle
        else:
            high = middle
    return search


def capacity(lm: LoadedModel, policy: Policy, settings: RunSettings, search: Literal["batch", "context"],
             context: int, batch: int, decode_steps: int, limit_bytes: int | None = None,
             pressure: float | None = None, bound: int | None = None, corpus: str = "embedded") -> Search:
    """Search the largest batch at `context` tokens, or the longest context at `batch` rows, that runs a
    prefill and `decode_steps` decode steps within the memory limit (see `memory_pressure`)."""
    unlimited = limit_bytes is None and pressure is None
    if unlimited and settings.kv_limit_bytes is None and lm.device.type != "cuda":  # a GPU has its own limit
        raise KvbenchError("capacity needs a memory limit (memory_limit, pressure, or the cell's memory condition)")
    default_bound = 1024 if search == "batch" else lm.model.config.max_position_embeddings
    bound = bound or default_bound
    needed = context if search == "batch" else bound
    text, _ = haystack_text(lm.tokenizer, load_corpus(corpus), needed + bound)  # rows start at different tokens
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids

    def fits(n: int) -> dict[str, Any] | None:
        rows, length = (n, context) if search == "batch" else (batch, n)
        if length > len(ids):
            raise KvbenchError(f"capacity: the corpus has {len(ids)} tokens, fewer than {length}")
        prompts = [ids[i : i + length] for i in range(rows)]  # distinct rows, as a real batch would have
        try:
            with contextlib.nullcontext() if unlimited else memory_pressure(lm.devices, pressure, limit_bytes) \
                    as kv_limit:
                limited = settings if kv_limit is None else dataclasses.replace(settings, kv_limit_bytes=kv_limit)
                _, measured = generate_batch(lm, policy, prompts, limited, max_new_tokens=decode_steps + 1,
                                             eos_token_ids=set())
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None
        return measured

    start = 1 if search == "batch" else 16  # short contexts cost little: doubling gets to long ones in a few steps
    return largest_fitting(fits, start, bound)

