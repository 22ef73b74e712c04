"""Run and score one sample of a cell: the record. The engine the task drives is the session
(kvbench/engine/session.py); this module only wraps its result in the record's fields and repeats it for timing."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from kvbench.engine.generation import Generation
from kvbench.engine.models import LoadedModel
from kvbench.engine.settings import RunSettings
from kvbench.engine.sharing import SharedPrefill
from kvbench.policies.base import Policy, takes_budget
from kvbench.policies.budgets import budget_description
from kvbench.tasks.base import Sample, Task, encode_prompt

SPEED = ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")


def repeat_timed(run: Callable[[], dict[str, Any]], warmup: int, repeats: int) -> dict[str, Any]:
    """Run a sample `warmup` times unmeasured, then `repeats` times: the last record, with each speed
    column the median of the repeats and `<column>_spread` their [min, max]."""
    for _ in range(warmup):
        run()
    records = [run() for _ in range(repeats)]
    record = records[-1]
    for key in SPEED:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            record[key] = statistics.median(values)
            record[f"{key}_spread"] = [min(values), max(values)]
    record["timing"] = {"warmup": warmup, "repeats": repeats}
    return record


def compressed_prompt(lm: LoadedModel, sample: Sample, question: str) -> list[int]:
    """The tokens compressed before decoding: the whole prompt (`aware`) or its context (`agnostic`)."""
    context_ids, question_ids = encode_prompt(lm.tokenizer, sample)
    return context_ids if question == "agnostic" else context_ids + question_ids


def evaluate(lm: LoadedModel, task: Task, policy: Policy, sample: Sample, settings: RunSettings,
             context_length: int, seed: int, shared: SharedPrefill | None = None) -> dict[str, Any]:
    """Run and score one sample: one record (a JSON-able dict)."""
    policy = dataclasses.replace(policy)  # fresh per-sample state (e.g. the random policy's generator)
    generation = task.run(lm, policy, sample, settings, shared)
    return record(lm, task, policy, sample, settings, context_length, seed, generation)


def evaluate_rows(lm: LoadedModel, task: Task, policy: Policy, samples: list[Sample], settings: RunSettings,
                  context_length: int, seed: int, shared: SharedPrefill | None = None) -> list[dict[str, Any]]:
    """Run and score several samples in one batch (`Task.run_rows`): their records, as `evaluate` gives each."""
    policy = dataclasses.replace(policy)  # fresh state: its per-row parts (the random policy's generators) too
    generations = task.run_rows(lm, policy, samples, settings, shared)
    return [record(lm, task, policy, sample, settings, context_length, seed, generation)
            for sample, generation in zip(samples, generations, strict=True)]


def record(lm: LoadedModel, task: Task, policy: Policy, sample: Sample, settings: RunSettings, context_length: int,
           seed: int, generation: Generation, outcome: dict[str, Any] | None = None) -> dict[str, Any]:
    """One sample's record: what ran, its task fields (`outcome`: instead of the task's) and its measurements."""
    return {
        "model": lm.spec,
        "task": task.describe(),
        "policy": policy.describe(),
        "family": policy.kind,
        "budget": budget_description(settings.budget) if takes_budget(policy) else None,
        "context_length": context_length,
        "sample_id": sample.id,
        "prefill": settings.prefill,
        "prefill_chunk": settings.prefill_chunk if settings.prefill == "chunked" else None,
        "question": settings.question,
        "evict_every": settings.evict_every,
        "seed": seed,
        **(task.outcome(generation, sample) if outcome is None else outcome),
        "higher_is_better": task.higher_is_better,
        "scenario": task.workload(),
        "meta": sample.meta,
        **generation.measurements,
    }
