"""Run a grid's cells into a resumable run folder, one model at a time, sharing work.

Cells that compress the same prompt in `full` prefill mode (same task sample, context length and
question placement) share one forward over it: the prompt runs once, gathering every policy's
attention statistics, and each cell starts from a copy of that cache. Only `chunked` cells, whose
compression happens during the prompt, run it themselves.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.config.cells import Cell, cell_task, sharable
from kvbench.config.schema import SweepConfig
from kvbench.engine.instruments import memory_pressure, tracing
from kvbench.engine.models import LoadedModel, load_model
from kvbench.engine.sharing import SharedPrefill, shared_prefill, wanted_compressions
from kvbench.errors import KvbenchError
from kvbench.runs.batching import batching, prompt_sizes, row_batches, sample_batches
from kvbench.runs.load_cell import run_load
from kvbench.runs.outcomes import FolderOutcomes, Outcomes, Progress
from kvbench.runs.run_folder import RunFolder, now
from kvbench.runs.runner import compressed_prompt, evaluate, evaluate_rows, repeat_timed
from kvbench.tasks import Sample, Task


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


class ModelLoader:
    """The grid's models, one in memory at a time: loading another frees the one held first, so a sweep over a
    7B and a 13B model never holds both."""

    def __init__(self, config: SweepConfig) -> None:
        self._configs = {(model.id, model.dtype): model for model in config.model_grid()}
        self._seed = config.seed
        self._compile = config.compile
        self.batch_size = config.batch_size
        self._held: tuple[tuple[str, str], LoadedModel] | None = None

    def load(self, model: tuple[str, str]) -> LoadedModel:
        """The (model id, dtype) of a cell, loaded once for as long as it stays held."""
        if self._held is None or self._held[0] != model:
            self.free()
            spec = self._configs[model]
            self._held = model, load_model(spec.id, dtype=spec.dtype, device=spec.device,
                                           device_map=spec.device_map, seed=self._seed, compile=self._compile)
        return self._held[1]

    @property
    def held(self) -> LoadedModel:
        """The model in memory now (one was loaded first); keep no reference to it, so `free` can release it."""
        assert self._held is not None, "no model loaded"
        return self._held[1]

    def free(self) -> None:
        """Drop the held model and give its memory back (the caller holds no reference of its own)."""
        if self._held is None:
            return
        on_cuda = self._held[1].device.type == "cuda"
        self._held = None
        gc.collect()  # the model's modules reference each other: reference counting alone frees nothing
        if on_cuda:
            torch.cuda.empty_cache()


def manifest(config: SweepConfig, cells: list[Cell], model: dict[str, Any], machine: dict[str, Any],
             shard_spec: str | None, executor: dict[str, Any]) -> dict[str, Any]:
    """The run's provenance: `model` is the first model loaded, described (`run_sweep` adds every other to
    `models`), `machine` the `environment()` it loaded on and `executor` what ran the cells (local, or a Ray
    cluster's nodes and GPUs)."""
    return {
        "name": config.name,
        "config": config.model_dump(),
        "config_hash": config.result_hash(),
        "shard": shard_spec,
        "cells": [cell.id for cell in cells],
        "cell_descriptions": {cell.id: cell.description for cell in cells},
        # `model` as before when the grid has one; `models` lists every one that ran
        **({"model": model} if len(config.model_grid()) == 1 else {}),
        "models": [model],
        "environment": machine,
        "executor": executor,
        # how many samples ran together, and the cells that ran fewer (one line each)
        "batching": batching(cells, config.batch_size),
        "seed": config.seed,
        "started": now(),
    }


def finished_cells(folder: RunFolder, retry_failed: bool) -> set[str]:
    """Cells a rerun skips: those with a final status (ok, or failed unless retrying them)."""
    return {cid for cid, status in folder.cells().items() if status["status"] == "ok" or not retry_failed}


def resume_point(folder: RunFolder, cells: list[Cell], progress: Progress,
                 retry_failed: bool) -> tuple[set[tuple[str, str]], list[Cell]]:
    """The (cell, sample) pairs already recorded and the cells still to run; counts what is done on `progress`."""
    done = folder.done()
    finished = finished_cells(folder, retry_failed)
    pending = [cell for cell in cells if cell.id not in finished]
    progress.cells_done = len(cells) - len(pending)
    progress.samples_done = sum(1 for cell_id, _ in done if cell_id in {c.id for c in cells})
    progress.update(progress)
    return done, pending


def run_sweep(models: ModelLoader, folder: RunFolder, cells: list[Cell], progress: Progress, share: bool = True,
              retry_failed: bool = False, trace: bool = False) -> bool:
    """Run every unfinished (cell, sample) into `folder`, one model at a time: each (model, dtype) with cells left
    loads once, runs them and is freed before the next loads. True if it completed, False if interrupted."""
    done, pending = resume_point(folder, cells, progress, retry_failed)
    outcomes = FolderOutcomes(folder, progress)
    by_model: dict[tuple[str, str], list[Cell]] = {}
    for cell in pending:
        by_model.setdefault(cell.model, []).append(cell)
    several = len({cell.model for cell in cells}) > 1
    with Interrupt() as interrupt:
        for model, model_cells in by_model.items():
            progress.model = " ".join(model) if several else ""
            completed = _run_model(models, model_cells, done, outcomes, share, trace, lambda: interrupt.requested,
                                   models.batch_size)
            models.free()
            if not completed:
                return False
    return True


def _run_model(models: ModelLoader, cells: list[Cell], done: set[tuple[str, str]], outcomes: Outcomes,
               share: bool, trace: bool, stop: Callable[[], bool], batch_size: int = 1) -> bool:
    """One model's cells, sample group by sample group."""
    lm = load_or_fail(models, cells, outcomes)
    if lm is None:
        return True
    groups: dict[tuple, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.group, []).append(cell)
    # stops at the first group an interrupt cut short
    return all(run_group(lm, group, done, outcomes, share, trace, stop, batch_size) for group in groups.values())


def load_or_fail(models: ModelLoader, cells: list[Cell], outcomes: Outcomes) -> LoadedModel | None:
    """The model of `cells` (all of one model); one that fails to load fails each of them, and the other models
    still run."""
    failed: dict[str, dict[str, Any]] = {}
    try:
        lm = models.load(cells[0].model)
    except Exception as exc:  # a missing model, or one too large for the device
        for cell in cells:
            _fail(outcomes, failed, cell, exc)
    if failed:
        _release_cached_memory()  # after the failed load's tensors went with its traceback
        return None
    outcomes.model_loaded(lm.describe())
    return lm


def run_group(lm: LoadedModel, cells: list[Cell], done: set[tuple[str, str]], outcomes: Outcomes, share: bool,
              trace: bool, stop: Callable[[], bool], batch_size: int = 1) -> bool:
    """Run the unrecorded samples of a sample group's cells (or of any subset of one) on `lm`, sending each record
    and final cell status to `outcomes`; False if `stop()` cut it short between two runs. Samples go `batch_size`
    at a time (`sample_batches`): one shared prompt forward for the batch, then each cell runs its rows of it
    together where it can (`row_batches`), one at a time where it cannot."""
    first = cells[0].description
    try:
        task = cell_task(cells[0])
        samples = task.samples(lm.tokenizer, first["context_length"], first["samples"], first["seed"])
    except KvbenchError as exc:  # e.g. a context length too short for the task: every cell of the group fails
        for index, cell in enumerate(cells):
            outcomes.cell(_failure(cell, exc), str(exc) if index == 0 else None)  # told once for the group
        return True
    for cell in [c for c in cells if "load" in c.description]:
        if stop():
            return False
        _run_load(lm, task, cell, samples, outcomes)
    cells = [c for c in cells if "load" not in c.description]
    started = {cell.id: time.perf_counter() for cell in cells}
    group = _GroupRun(lm, task, cells, done, outcomes, share, trace, stop)
    for batch in sample_batches(samples, batch_size):
        if not group.batch(batch):
            return False
    for cell in cells:
        if cell.id not in group.failed:
            outcomes.cell({"cell_id": cell.id, "cell": cell.description, "status": "ok", "samples": len(samples),
                           "seconds": round(time.perf_counter() - started[cell.id], 3), "finished": now()}, None)
    return True


def _run_load(lm: LoadedModel, task: Task, cell: Cell, samples: list[Sample], outcomes: Outcomes) -> None:
    """A load cell, whole: its records, then its status with what the service measured, both marked with this
    attempt. A cell cut short runs again whole (its service's times depend on every request), and only the attempt
    its status names counts (`RunFolder.records`)."""
    started, attempt = time.perf_counter(), uuid.uuid4().hex[:12]
    try:
        records, measured = run_load(lm, task, cell, samples, lambda told: outcomes.running(f"{cell.label} {told}"))
    except Exception as exc:  # one failing cell never stops the sweep
        _fail(outcomes, {}, cell, exc)
        _release_cached_memory()
        return
    for row in records:
        outcomes.record({"cell_id": cell.id, "cell": cell.description, **row,
                         "dtype": str(lm.dtype).removeprefix("torch."), "attempt": attempt}, None)
    outcomes.cell({"cell_id": cell.id, "cell": cell.description, "status": "ok", "samples": len(records),
                   "seconds": round(time.perf_counter() - started, 3), "finished": now(), "attempt": attempt,
                   **measured}, None)


@dataclass
class _GroupRun:
    """A sample group's cells running on `lm` one batch of samples at a time, and the cells failed so far (a failed
    cell runs no further batch)."""

    lm: LoadedModel
    task: Task
    cells: list[Cell]
    done: set[tuple[str, str]]
    outcomes: Outcomes
    share: bool
    trace: bool
    stop: Callable[[], bool]
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def batch(self, batch: list[Sample]) -> bool:
        """One shared prompt forward for the batch, then each cell's rows of it; False if `stop()` cut it short. The
        batch's prefill is freed on return, before the next batch's forward."""
        cells = self.cells
        todo = {c.id: [s for s in batch if (c.id, s.id) not in self.done] for c in cells if c.id not in self.failed}
        sizes = prompt_sizes(self.lm, batch) if len(batch) > 1 else {}  # tokenized once for every cell
        runs = {c.id: row_batches(c, todo[c.id], sizes, self.lm.num_layers) for c in cells if todo.get(c.id)}
        prefills = self._prefill(runs, batch) if self.share and self.task.shares_prefill else None
        for cell in cells:
            for rows in runs.get(cell.id, []) if cell.id not in self.failed else []:
                if self.stop():
                    return False
                if not self._run(cell, rows, prefills):
                    break
        return True

    def _prefill(self, runs: dict[str, list[list[Sample]]], batch: list[Sample]) -> _BatchPrefill | None:
        """The batch's shared prompt forward for the cells that run rows of it; where it fails, each cell it served
        fails."""
        prefills = None
        try:
            prefills = _BatchPrefill.of(self.lm, [c for c in self.cells if c.id in runs], runs, batch,
                                        self.cells[0].description["question"])
        except Exception as exc:  # the prompts' forward failed (out of memory)
            for cell in [c for c in self.cells if c.id in runs and sharable(c)]:
                _fail(self.outcomes, self.failed, cell, exc)
        if self.failed:
            _release_cached_memory()  # after the failed forward's tensors went with its traceback
        return prefills

    def _run(self, cell: Cell, rows: list[Sample], prefills: _BatchPrefill | None) -> bool:
        """Run `cell` on `rows` (together, or one alone: `_run_rows`) and send their records; False if the cell
        failed."""
        self.outcomes.running(f"{cell.label} {rows[0].id}" + (f" (+{len(rows) - 1})" if len(rows) > 1 else ""))
        try:
            shared = prefills.rows(rows) if prefills is not None and sharable(cell) else None
            records = _run_rows(self.lm, self.task, cell, rows, shared, self.trace)
        except Exception as exc:  # one failing cell never stops the sweep
            _fail(self.outcomes, self.failed, cell, exc)
        finally:
            shared = None  # this reference too: a part no other cell runs is freed now
            if prefills is not None and sharable(cell):
                prefills.served(cell, rows)
        if cell.id in self.failed:
            _release_cached_memory()  # now that the failed cell's tensors went with its traceback
            return False
        for record, traces in records:
            # the dtype the weights ran in (`auto` resolved), beside the record's `model`
            self.outcomes.record({"cell_id": cell.id, "cell": cell.description, **record,
                                  "dtype": str(self.lm.dtype).removeprefix("torch.")}, traces if self.trace else None)
        return True


def _run_rows(lm: LoadedModel, task: Task, cell: Cell, rows: list[Sample], shared: SharedPrefill | None,
              trace: bool) -> list[tuple[dict[str, Any], list[dict[str, Any]] | None]]:
    """The records of `cell` on `rows` run together (one alone: its memory condition, its timing repeats), each
    with the memory time series when tracing. A batch that does not fit runs its rows one at a time."""
    d = cell.description
    if len(rows) > 1:
        try:
            with tracing() if trace else contextlib.nullcontext() as traces:
                records = evaluate_rows(lm, task, cell.policy(), rows, cell.settings(), d["context_length"],
                                        d["seed"], shared=shared)
            return [(record, traces) for record in records]
        except torch.OutOfMemoryError:
            _release_cached_memory()
        return [result for index, sample in enumerate(rows)
                for result in _run_rows(lm, task, cell, [sample], None if shared is None else shared.select([index]),
                                        trace)]
    with tracing() if trace else contextlib.nullcontext() as traces, \
            memory_pressure(lm.devices, **d["memory"]) if "memory" in d else contextlib.nullcontext() as kv_limit:
        run = functools.partial(evaluate, lm, task, cell.policy(), rows[0], cell.settings(kv_limit),
                                d["context_length"], d["seed"], shared=shared)
        timing = d.get("timing")
        return [(repeat_timed(run, **timing) if timing else run(), traces)]


class _BatchPrefill:
    """A batch's one shared prompt forward (over the samples its sharing cells run), and the parts of it that
    cells running only some of those rows together start from (`SharedPrefill.select`)."""

    def __init__(self, whole: SharedPrefill, samples: list[Sample], users: dict[tuple[str, ...], list[Cell]]) -> None:
        self.whole, self.samples, self.users = whole, samples, users
        self.parts: dict[tuple[str, ...], SharedPrefill] = {}
        self.waiting = {key: len(cells) for key, cells in users.items()}  # cells yet to run each part

    @classmethod
    def of(cls, lm: LoadedModel, cells: list[Cell], runs: dict[str, list[list[Sample]]], batch: list[Sample],
           question: str) -> _BatchPrefill | None:
        sharing = [cell for cell in cells if sharable(cell)]
        wanted = {s.id for cell in sharing for rows in runs[cell.id] for s in rows}
        samples = [sample for sample in batch if sample.id in wanted]
        if not samples:
            return None
        users: dict[tuple[str, ...], list[Cell]] = {}
        for cell in sharing:
            for rows in runs[cell.id]:
                users.setdefault(tuple(s.id for s in rows), []).append(cell)
        prompts = [compressed_prompt(lm, sample, question) for sample in samples]
        whole = shared_prefill(lm, prompts[0] if len(prompts) == 1 else prompts, [cell.policy() for cell in sharing])
        key = tuple(s.id for s in samples)
        whole.wanted = wanted_compressions([(c.policy(), c.settings()) for c in users.get(key, [])], len(prompts[0]))
        return cls(whole, samples, users)

    def rows(self, rows: list[Sample]) -> SharedPrefill:
        """The shared prefill of `rows` (run together, in this order)."""
        key = tuple(s.id for s in rows)
        if key == tuple(s.id for s in self.samples):
            return self.whole
        if key not in self.parts:
            ids = [s.id for s in self.samples]
            self.parts[key] = self.whole.select([ids.index(s.id) for s in rows],
                                                [(c.policy(), c.settings()) for c in self.users.get(key, [])])
        return self.parts[key]

    def served(self, cell: Cell, rows: list[Sample]) -> None:
        """`cell` ran `rows`: a part no other cell will run is freed (a copy of some rows' prompt cache)."""
        key = tuple(s.id for s in rows)
        self.waiting[key] = self.waiting.get(key, 1) - 1
        if self.waiting[key] <= 0:
            self.parts.pop(key, None)


def _fail(outcomes: Outcomes, failed: dict[str, dict[str, Any]], cell: Cell, exc: Exception) -> None:
    failed[cell.id] = _failure(cell, exc)
    outcomes.cell(failed[cell.id], f"{failed[cell.id]['status']}: {failed[cell.id]['message']}")


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
