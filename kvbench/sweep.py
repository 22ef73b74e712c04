"""Expand a config into cells and run them into a resumable run folder, sharing work.

Cells that compress the same prompt in `full` prefill mode (same task sample, context length and
question placement) share one forward over it: the prompt runs once, gathering every policy's
attention statistics, and each cell starts from a copy of that cache. Only `chunked` cells, whose
compression happens during the prompt, run it themselves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.config import SweepConfig
from kvbench.errors import KvbenchError
from kvbench.estimate import parse_bytes
from kvbench.measure import memory_pressure, tracing
from kvbench.models import LoadedModel
from kvbench.policies import POLICIES, Policy
from kvbench.results import RunFolder, environment, now
from kvbench.runner import compressed_prompt, evaluate, repeat_timed
from kvbench.session import RunSettings, SharedPrefill, shared_prefill
from kvbench.tasks import TASKS, Sample, Task


@dataclass(frozen=True)
class Cell:
    """One point of the grid; its id hashes its canonical description, so YAML order changes no id."""

    description: dict[str, Any]

    @property
    def id(self) -> str:
        canonical = json.dumps(self.description, sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    @property
    def group(self) -> tuple[str, int, str]:
        """Cells of one group see the same samples, so they can share the prompt's forward."""
        d = self.description
        return json.dumps(d["task"], sort_keys=True), d["context_length"], d["question"]

    def policy(self) -> Policy:
        return POLICIES.build(self.description["policy"]["name"], self.description["policy"]["params"])

    def settings(self, kv_limit_bytes: int | None = None) -> RunSettings:
        d = self.description
        return RunSettings(budget=d["budget"], prefill=d["prefill"]["mode"], prefill_chunk=d["prefill"]["chunk"] or 1,
                           question=d["question"], evict_every=d["evict_every"], max_new_tokens=d["max_new_tokens"],
                           kv_limit_bytes=kv_limit_bytes, fidelity="fidelity" in d.get("diagnostics", ()))

    @property
    def label(self) -> str:
        d = self.description
        params = ",".join(f"{k}={v}" for k, v in d["policy"]["params"].items())
        budget = "" if d["budget"] is None else f" b={d['budget']}"
        return f"{d['policy']['name']}{f'({params})' if params else ''}{budget} L={d['context_length']}"


def expand(config: SweepConfig) -> list[Cell]:
    """The grid: tasks x context lengths x question placements x policies x budgets (once for a policy that
    keeps every token)."""
    cells = []
    for task in config.tasks:
        for length in config.context_lengths:
            for question in config.question:
                for policy in config.policies:
                    keeps_all = not POLICIES.get(policy.name).phases  # full, or a compression that drops nothing
                    for budget in [None] if keeps_all else policy.budgets or config.budgets:
                        cells.append(Cell({
                            "model": {"id": config.model.id, "dtype": config.model.dtype},
                            "task": task.canonical(),
                            "policy": policy.canonical(),
                            "budget": budget,
                            "context_length": length,
                            "prefill": {"mode": config.prefill.mode,
                                        "chunk": config.prefill.chunk if config.prefill.mode == "chunked" else None},
                            "question": question,
                            "samples": task.samples or config.samples,
                            "seed": config.seed,
                            "evict_every": config.evict_every,
                            "max_new_tokens": config.max_new_tokens,
                        }))
    if config.diagnostics:  # only when set, as timing
        for cell in cells:
            cell.description["diagnostics"] = sorted(config.diagnostics)
    if config.timing:  # only when set: adding the option changed no existing cell's id
        for cell in cells:
            cell.description["timing"] = config.timing.model_dump()
    if config.pressure or config.memory_limit:  # one cell per memory condition
        conditions = [{"pressure": p} for p in config.pressure or []]
        if config.memory_limit:
            conditions.append({"limit_bytes": parse_bytes(config.memory_limit)})
        cells = [Cell({**cell.description, "memory": condition}) for cell in cells for condition in conditions]
    unique = {cell.id: cell for cell in cells}  # a policy listed twice runs once
    return list(unique.values())


def shard(cells: list[Cell], spec: str | None) -> list[Cell]:
    """`i/N`: every N-th cell by id, starting at the i-th (0-based): deterministic on every machine."""
    if not spec:
        return cells
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise KvbenchError(f"--shard '{spec}' is not of the form i/N (e.g. 0/4)") from None
    if not 0 <= index < count:
        raise KvbenchError(f"--shard '{spec}': i must be in [0, N)")
    ordered = sorted(cells, key=lambda cell: cell.id)
    return ordered[index::count]


@dataclass
class Progress:
    """What the progress display shows; the sweep calls `update` as it goes."""

    cells_total: int
    samples_total: int
    update: Callable[[Progress], None] = lambda progress: None
    cells_done: int = 0
    samples_done: int = 0
    current: str = ""
    log: list[str] = field(default_factory=list)


class Interrupt:
    """First Ctrl-C: finish the sample in flight, then stop. Second Ctrl-C: stop now."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> Interrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def manifest(config: SweepConfig, cells: list[Cell], lm: LoadedModel, shard_spec: str | None) -> dict[str, Any]:
    return {
        "name": config.name,
        "config": config.model_dump(),
        "config_hash": config.result_hash(),
        "shard": shard_spec,
        "cells": [cell.id for cell in cells],
        "cell_descriptions": {cell.id: cell.description for cell in cells},
        "model": lm.describe(),
        "environment": environment(lm.device),
        "seed": config.seed,
        "started": now(),
    }


def sample_total(cells: list[Cell]) -> int:
    """Samples the grid scores in all (cells x the samples each cell's task makes)."""
    return sum(cell_task(cell).sample_count(cell.description["samples"]) for cell in cells)


def cell_task(cell: Cell) -> Task:
    return TASKS.build(cell.description["task"]["name"], cell.description["task"]["params"])


def finished_cells(folder: RunFolder, retry_failed: bool) -> set[str]:
    """Cells a rerun skips: those with a final status (ok, or failed unless retrying them)."""
    return {cid for cid, status in folder.cells().items() if status["status"] == "ok" or not retry_failed}


def run_sweep(lm: LoadedModel, folder: RunFolder, cells: list[Cell], progress: Progress, share: bool = True,
              retry_failed: bool = False, trace: bool = False) -> bool:
    """Run every unfinished (cell, sample) into `folder`; True if it completed, False if interrupted."""
    done = folder.done()
    finished = finished_cells(folder, retry_failed)
    pending = [cell for cell in cells if cell.id not in finished]
    progress.cells_done = len(cells) - len(pending)
    progress.samples_done = sum(1 for cell_id, _ in done if cell_id in {c.id for c in cells})
    progress.update(progress)
    groups: dict[tuple, list[Cell]] = {}
    for cell in pending:
        groups.setdefault(cell.group, []).append(cell)
    with Interrupt() as interrupt:
        for group in groups.values():
            if not _run_group(lm, folder, group, done, progress, share, interrupt, trace):
                return False
    return True


def _run_group(lm: LoadedModel, folder: RunFolder, cells: list[Cell], done: set[tuple[str, str]],
               progress: Progress, share: bool, interrupt: Interrupt, trace: bool) -> bool:
    first = cells[0].description
    failed: dict[str, dict[str, Any]] = {}
    try:
        task = cell_task(cells[0])
        samples = task.samples(lm.tokenizer, first["context_length"], first["samples"], first["seed"])
    except KvbenchError as exc:  # e.g. a context length too short for the task: every cell of the group fails
        for cell in cells:
            folder.add_cell(_failure(cell, exc))
            progress.cells_done += 1
        progress.log.append(f"{cells[0].label}: {exc}")
        return True
    started = {cell.id: time.perf_counter() for cell in cells}
    for sample in samples:
        todo = [c for c in cells if (c.id, sample.id) not in done and c.id not in failed]
        shared = None
        if share and task.shares_prefill:
            try:
                shared = _shared(lm, todo, sample, first["question"])
            except Exception as exc:  # the prompt's forward failed (out of memory): each cell it served fails
                for cell in [c for c in todo if _sharable(c)]:
                    _fail(folder, progress, failed, cell, exc)
            if any(c.id in failed for c in todo):
                _release_cached_memory()  # after the failed forward's tensors went with its traceback
                todo = [c for c in todo if c.id not in failed]
        for cell in todo:
            if interrupt.requested:
                return False
            progress.current = f"{cell.label} {sample.id}"
            progress.update(progress)
            try:
                with tracing() if trace else contextlib.nullcontext() as traces, \
                        memory_pressure(lm.device, **cell.description["memory"]) if "memory" in cell.description \
                        else contextlib.nullcontext() as kv_limit:
                    run = functools.partial(evaluate, lm, task, cell.policy(), sample, cell.settings(kv_limit),
                                            cell.description["context_length"], cell.description["seed"],
                                            shared=shared if _sharable(cell) else None)
                    timing = cell.description.get("timing")
                    record = repeat_timed(run, **timing) if timing else run()
            except Exception as exc:  # one failing cell never stops the sweep
                _fail(folder, progress, failed, cell, exc)
            if cell.id in failed:
                _release_cached_memory()  # now that the failed cell's tensors went with its traceback
                continue
            folder.add_record({"cell_id": cell.id, "cell": cell.description, **record})
            if trace:
                folder.add_trace(cell.id, sample.id, traces)
            progress.samples_done += 1
            progress.update(progress)
        del shared
    for cell in cells:
        if cell.id not in failed:
            folder.add_cell({"cell_id": cell.id, "cell": cell.description, "status": "ok", "samples": len(samples),
                             "seconds": round(time.perf_counter() - started[cell.id], 3), "finished": now()})
            progress.cells_done += 1
    progress.update(progress)
    return True


def _sharable(cell: Cell) -> bool:
    """Whether the cell may start from the sample's shared prompt forward: not a speed cell (it times its
    own) nor a memory-pressure one (the prompt's forward is what may not fit)."""
    d = cell.description
    return d["prefill"]["mode"] == "full" and "timing" not in d and "memory" not in d


def _shared(lm: LoadedModel, cells: list[Cell], sample: Sample, question: str) -> SharedPrefill | None:
    users = [cell for cell in cells if _sharable(cell)]
    if not users:
        return None
    return shared_prefill(lm, compressed_prompt(lm, sample, question), [cell.policy() for cell in users])


def _fail(folder: RunFolder, progress: Progress, failed: dict[str, dict[str, Any]], cell: Cell,
          exc: Exception) -> None:
    failed[cell.id] = _failure(cell, exc)
    folder.add_cell(failed[cell.id])
    progress.log.append(f"{cell.label}: {failed[cell.id]['status']}: {failed[cell.id]['message']}")
    progress.cells_done += 1


def _release_cached_memory() -> None:
    """Give the allocator's cached blocks back, so the next cell meets its memory limit with what it allocates."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def outcome(folder: RunFolder, cells: list[Cell]) -> tuple[dict[str, int], bool]:
    """How many of `cells` ended in each status, and whether that is a failed sweep: a cell ended in `error`,
    or none succeeded (an `oom` of a memory-pressure cell is a result: it says what does not fit)."""
    statuses = folder.cells()
    counts: dict[str, int] = {}
    succeeded = False
    for cell in cells:
        status = statuses.get(cell.id, {}).get("status", "missing")
        counts[status] = counts.get(status, 0) + 1
        succeeded |= status == "ok" or (status == "oom" and "memory" in cell.description)
    return counts, counts.get("error", 0) > 0 or not succeeded


def _failure(cell: Cell, exc: Exception) -> dict[str, Any]:
    oom = isinstance(exc, torch.OutOfMemoryError)
    message = str(exc) if isinstance(exc, KvbenchError) else f"{type(exc).__name__}: {exc}"
    return {"cell_id": cell.id, "cell": cell.description, "status": "oom" if oom else "error",
            "message": message.splitlines()[0] if message else type(exc).__name__, "finished": now()}


def estimate_seconds(cells: list[Cell], parameters: int, device: torch.device, share: bool) -> float:
    """A rough wall-time guess from model size: a prompt token costs 2 x parameters FLOPs at an assumed
    throughput (1.2e11 FLOP/s on 2 CPU cores: the ~450 prompt tokens/s measured for 135M parameters);
    a decoded token, bound by memory and latency, about 40 times more (~90 ms there)."""
    flops = 2e14 if device.type == "cuda" else 1.2e11
    per_token = 2 * parameters / flops
    seconds, prompts_run = 0.0, set()
    for cell in cells:
        d = cell.description
        task = cell_task(cell)
        samples = task.sample_count(d["samples"])
        prompt, decoded = task.work(d["context_length"], d["max_new_tokens"])
        if not (share and task.shares_prefill and _sharable(cell) and cell.group in prompts_run):
            seconds += prompt * samples * per_token
        prompts_run.add(cell.group)
        seconds += decoded * samples * per_token * 40
    return seconds
