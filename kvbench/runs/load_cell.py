"""A load cell: its requests drawn from the task's samples, served (kvbench/serving/), and its records.

Each finished request is a record as a sample's is (its prediction scored by the task, its cache as its own cache held
it; a trace's own prompt is not scored: its score is NaN), with the request's latencies in place of an unloaded run's
speed columns and `sample_id` `<request>:<sample>`, so that every policy's request k is the same prompt and the summary
pairs them. What the service measured as a whole (throughput, percentiles, goodput, rejections, the timeline) is the
cell's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvbench.config.cells import Cell
from kvbench.engine.generation import Generation, Prompt, answer
from kvbench.engine.instruments import PeakMemory
from kvbench.engine.measurements import MEMORY_PEAKS
from kvbench.engine.models import LoadedModel
from kvbench.runs.runner import record
from kvbench.serving import Load, Service, TraceRequest, pool_bytes, read_trace, service_metrics
from kvbench.tasks.base import Sample, Task, encode_prompt


def cell_load(lm: LoadedModel, cell: Cell, trace: list[TraceRequest] | None, rate: float | None) -> Load:
    """The `Load` a cell's `load` description gives on `lm` at Poisson `rate` (None: its users or a trace's
    arrivals), its pool resolved."""
    d = cell.description
    spec = d["load"]
    return Load(requests=spec["requests"], rate=rate,
                users=spec.get("users"), arrivals=None if trace is None else tuple(t.arrival_s for t in trace),
                pool_bytes=pool_bytes(lm, spec["kv_pool"], spec["pressure"]), timeout_s=spec["timeout_s"],
                max_queue=spec["max_queue"], horizon_s=spec["horizon_s"], slo_ttft_s=spec["slo"]["ttft_s"],
                slo_tpot_s=spec["slo"]["tpot_s"], seed=d["seed"])


def drawn_samples(samples: list[Sample], count: int, seed: int) -> list[Sample]:
    """`count` requests' samples: the task's samples in a seeded order, cycled."""
    order = np.random.default_rng(seed).permutation(len(samples))
    return [samples[int(order[index % len(samples)])] for index in range(count)]


def run_load(lm: LoadedModel, task: Task, cell: Cell, samples: list[Sample],
             progress: Callable[[str], None] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Serve the cell's requests: the finished requests' records, and the cell's `load` (`service_metrics`) and
    `timeline` (one entry per decode step); `progress` is told how far the service is (`5/8 requests`, and a search's
    rate). A search (`rate: auto`) serves them at each rate it tries (`searched_rates`); its records and service are
    those of the highest rate that held (the lowest tried where none did), and its `load` adds `sustained_rate` (None
    where none held), `missed_rate` (the lowest that did not hold; None where the search reached its limit) and what
    every rate tried measured."""
    spec = cell.description["load"]
    if spec.get("rate") != "auto":
        served = _serve(lm, task, cell, samples, spec.get("rate"), _told(progress, ""))
        return served.records, {"load": served.metrics, "timeline": served.timeline}
    tries: dict[float, _Served] = {}

    def attained(rate: float) -> float:
        tries[rate] = _serve(lm, task, cell, samples, rate,
                             _told(progress, f" at {rate:g} req/s (rate {len(tries) + 1} of the search)"))
        return tries[rate].metrics["slo_attained"] or 0.0

    held, missed, tried = searched_rates(attained, spec["search"], spec["attainment"])
    chosen = tried[0] if held is None else held
    summary = [{"rate": rate, **{key: tries[rate].metrics[key] for key in TRIED}, "score": tries[rate].score}
               for rate in sorted(tried)]
    service = {**tries[chosen].metrics, "rate": chosen, "sustained_rate": held, "missed_rate": missed,
               "attainment": spec["attainment"], "tried": summary}
    return tries[chosen].records, {"load": service, "timeline": tries[chosen].timeline}


def _told(progress: Callable[[str], None] | None, where: str) -> Callable[[int, int], None] | None:
    """A service's progress (requests ended, offered) as `progress` is told it."""
    if progress is None:
        return None
    return lambda ended, offered: progress(f"{ended}/{offered} requests{where}")


# what a search keeps of each rate it tried, beside the mean score of its answers
TRIED = ("slo_attained", "goodput", "ttft_p99", "tpot_p99", "finished", "rejected")


class Search(NamedTuple):
    """What a rate search found: the highest rate that held (None: the first did not), the lowest that did not
    (None: the search reached its limit), and every rate tried, in order."""

    held: float | None
    missed: float | None
    tried: list[float]


def searched_rates(attained: Callable[[float], float], search: dict[str, Any], attainment: float) -> Search:
    """The highest rate that held (`attained(rate)`, the share of requests within the SLO, at least `attainment`), the
    lowest that did not, and every rate tried, in order: from `search["start"]`, doubling while a rate holds, up to
    `search["limit"]`, then `search["refine"]` halvings of the gap between the last rate that held and the first that
    did not (as a serving benchmark finds the highest rate sustained: its curve rises with the rate until it falls
    off)."""
    held: float | None = None
    failed: float | None = None
    rate, tried = float(search["start"]), []
    while True:
        tried.append(rate)
        if attained(rate) < attainment:
            failed = rate
            break
        held = rate
        if rate * 2 > search["limit"]:
            break
        rate *= 2
    for _ in range(search["refine"] if held is not None and failed is not None else 0):
        assert held is not None and failed is not None
        rate = round((held + failed) / 2, 6)
        tried.append(rate)
        if attained(rate) >= attainment:
            held = rate
        else:
            failed = rate
    return Search(held, failed, tried)


@dataclass
class _Served:
    records: list[dict[str, Any]]
    metrics: dict[str, Any]
    timeline: list[dict[str, Any]]

    @property
    def score(self) -> float:
        """The mean score of the answers (NaN: none finished, or a trace's own prompts)."""
        values = [r["scores"]["score"] for r in self.records]
        return float(np.mean(values)) if values else float("nan")


def _serve(lm: LoadedModel, task: Task, cell: Cell, samples: list[Sample], rate: float | None,
           on_step: Callable[[int, int], None] | None) -> _Served:
    """The cell's requests served at `rate` (its own arrivals where None: users or a trace), and their records."""
    d = cell.description
    trace = read_trace(d["load"]["trace"]) if "trace" in d["load"] else None
    policy, settings = cell.policy(), cell.settings()
    load = cell_load(lm, cell, trace, rate)
    drawn = drawn_samples(samples, load.requests, d["seed"])
    limits = [settings.max_new_tokens or sample.max_new_tokens for sample in drawn]
    if trace is not None:  # a trace's own prompts and output limits
        drawn = [Sample(f"trace-{index}", line.prompt, "", [], stop=()) if line.prompt is not None else sample
                 for index, (line, sample) in enumerate(zip(trace, drawn, strict=True))]
        limits = [line.max_tokens or limit for line, limit in zip(trace, limits, strict=True)]
    encoded = [encode_prompt(lm.tokenizer, sample) for sample in drawn]
    prompts = [Prompt(context, question, limit, sample.stop)
               for (context, question), sample, limit in zip(encoded, drawn, limits, strict=True)]
    with PeakMemory(lm.devices) as memory:
        served = Service(lm, policy, settings, prompts, load, memory, on_step).run()
    records = []
    for request, sample in zip(served.requests, drawn, strict=True):
        if request.finished_s is None:
            continue
        text, tokens = answer(lm, request.tokens, lm.eos_token_ids, request.prompt.stop)
        measured = {**request.measured, **request.latencies(),
                    **{column: getattr(memory, name) for column, name in MEMORY_PEAKS.items()}}  # the service's
        generation = Generation(text, tokens, None, measured)
        unscored = {"prediction": text, "references": [], "scores": {"score": float("nan")}}  # a trace's own prompt
        row = record(lm, task, policy, sample, settings, d["context_length"], d["seed"], generation,
                     outcome=unscored if sample.id.startswith("trace-") else None)
        records.append({**row, "sample_id": f"{request.index:04d}:{sample.id}", "request": request.index})
    return _Served(records, service_metrics(served, load), served.timeline)
