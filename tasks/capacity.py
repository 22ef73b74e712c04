"""Capacity as a sweep task: per cell (policy x budget x context length), the largest batch that fits the
memory limit at that context, or the longest context at a batch; see tasks/capacity_search.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, register


@register
@dataclass
class Capacity(Task):
    """The largest batch (or, with `search: context`, the longest context) that completes prefill and
    `decode_steps` steps within `memory_limit` or the cell's memory condition; score = that size."""

    name = "capacity"
    scenario = "capacity"
    shares_prefill = False
    search: Literal["batch", "context"] = "batch"
    batch: int = 1  # the batch of a context search
    decode_steps: int = 8
    memory_limit: str | None = None  # e.g. 2GiB; without it, the cell's `pressure` / `memory_limit`
    max: int | None = None  # upper bound of the search (default: 1024 rows, or the model's context)
    corpus: str = "embedded"

    def __post_init__(self) -> None:
        if self.search not in ("batch", "context"):
            raise KvbenchError(f"task 'capacity' parameter 'search' must be batch or context, got '{self.search}'")
        if self.memory_limit is not None:
            from kvbench.engine.estimate import parse_bytes

            parse_bytes(self.memory_limit)

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        return [Sample(id=f"capacity-{self.search}-{context_length}", context="", question="", answers=[],
                       meta={"context": context_length})]

    def sample_count(self, count: int) -> int:
        return 1

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        return 12 * context_length, 6 * self.decode_steps  # ~6 probes, batches growing then bisected

    def run(self, lm, policy, sample, settings, shared=None):
        from kvbench.engine.estimate import parse_bytes
        from kvbench.engine.generation import Generation
        from kvbench.tasks.capacity_search import capacity

        found = capacity(lm, policy, settings, self.search, context=sample.meta["context"], batch=self.batch,
                         decode_steps=self.decode_steps, bound=self.max, corpus=self.corpus,
                         limit_bytes=None if self.memory_limit is None else parse_bytes(self.memory_limit))
        return Generation("", [], None, dict(found.measurements),
                          extra={"size": found.size, "probes": found.probes})

    def outcome(self, generation, sample: Sample) -> dict[str, Any]:
        size = generation.extra["size"]
        return {"prediction": str(size), "references": [], "scores": {"score": float(size)},
                "capacity": {"search": self.search, "size": size, "probes": generation.extra["probes"]}}
