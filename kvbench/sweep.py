"""Expand a config into cells and run them into a resumable run folder, sharing work.

Cells that compress the same prompt in `full` prefill mode (same task sample, context length and
question placement) share one forward over it: the prompt runs once, gathering every policy's
attention statistics, and each cell starts from a copy of that cache. Only `chunked` cells, whose
compression happens during the prompt, run it themselves.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import heapq
import itertools
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvbench.budgets import budget_suffix, budget_value, threshold_from
from kvbench.config import SweepConfig
from kvbench.errors import KvbenchError
from kvbench.estimate import CellWork, parse_bytes
from kvbench.measure import memory_pressure, tracing
from kvbench.models import LoadedModel, load_model
from kvbench.policies import POLICIES, Policy
from kvbench.policies.base import batch_limit, takes_budget
from kvbench.results import RunFolder, now, union_models
from kvbench.runner import compressed_prompt, evaluate, evaluate_rows, repeat_timed
from kvbench.session import SharedPrefill, shared_prefill, wanted_compressions
from kvbench.settings import RunSettings, compression_plan
from kvbench.tasks import TASKS, Sample, Task
from kvbench.tasks.base import encode_prompt


@dataclass(frozen=True)
class Cell:
    """One point of the grid; its id hashes its canonical description, so YAML order changes no id."""

    description: dict[str, Any]

    @property
    def id(self) -> str:
        canonical = json.dumps(self.description, sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    @property
    def model(self) -> tuple[str, str]:
        """The (model id, dtype) the cell runs on: cells of one share a loaded model."""
        return self.description["model"]["id"], self.description["model"]["dtype"]

    @property
    def group(self) -> tuple[tuple[str, str], str, int, str]:
        """Cells of one group see the same samples (tokenized by the same model), so they can share the prompt's
        forward."""
        d = self.description
        return self.model, json.dumps(d["task"], sort_keys=True), d["context_length"], d["question"]

    def policy(self) -> Policy:
        return POLICIES.build(self.description["policy"]["name"], self.description["policy"]["params"])

    def settings(self, kv_limit_bytes: int | None = None) -> RunSettings:
        d = self.description
        return RunSettings(budget=budget_value(d["budget"]), prefill=d["prefill"]["mode"],
                           prefill_chunk=d["prefill"]["chunk"] or 1, question=d["question"],
                           evict_every=d["evict_every"], max_new_tokens=d["max_new_tokens"],
                           kv_limit_bytes=kv_limit_bytes, fidelity="fidelity" in d.get("diagnostics", ()))

    @property
    def label(self) -> str:
        d = self.description
        params = ",".join(f"{k}={v}" for k, v in d["policy"]["params"].items())
        policy = f"{d['policy']['name']}{f'({params})' if params else ''}"
        return f"{policy}{budget_suffix(d['budget'])} L={d['context_length']}"


def expand(config: SweepConfig) -> list[Cell]:
    """The grid: models x dtypes x tasks x context lengths x question placements x policies x budgets (once for a
    policy that keeps every token)."""
    cells = []
    for model, task in itertools.product(config.model_grid(), config.tasks):
        for length in config.context_lengths:
            for question in config.question:
                for policy in config.policies:
                    # full, or a compression that drops nothing: no budget
                    keeps_all = not takes_budget(POLICIES.get(policy.name))
                    for budget in [None] if keeps_all else policy.budgets or config.budgets:
                        cells.append(Cell({
                            "model": model.identity(),
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
    model: str = ""  # the model and dtype running, when the grid has several
    log: list[str] = field(default_factory=list)  # cells that failed, to tell the user
    notes: list[str] = field(default_factory=list)  # what an executor tells as it goes (Ray's workers)

    def log_failure(self, cell: Cell, message: str) -> None:
        self.log.append(f"{self.model}: {cell.label}: {message}" if self.model else f"{cell.label}: {message}")


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
        self.batch_size = config.batch_size
        self._held: tuple[tuple[str, str], LoadedModel] | None = None

    def load(self, model: tuple[str, str]) -> LoadedModel:
        """The (model id, dtype) of a cell, loaded once for as long as it stays held."""
        if self._held is None or self._held[0] != model:
            self.free()
            spec = self._configs[model]
            self._held = model, load_model(spec.id, dtype=spec.dtype, device=spec.device,
                                           device_map=spec.device_map, seed=self._seed)
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


def sample_total(cells: list[Cell]) -> int:
    """Samples the grid scores in all (cells x the samples each cell's task makes)."""
    return sum(cell_task(cell).sample_count(cell.description["samples"]) for cell in cells)


def cell_task(cell: Cell) -> Task:
    return TASKS.build(cell.description["task"]["name"], cell.description["task"]["params"])


def finished_cells(folder: RunFolder, retry_failed: bool) -> set[str]:
    """Cells a rerun skips: those with a final status (ok, or failed unless retrying them)."""
    return {cid for cid, status in folder.cells().items() if status["status"] == "ok" or not retry_failed}


class Outcomes(Protocol):
    """Where running cells sends what it produces, in the order it happens. A local sweep's is the run folder
    (`FolderOutcomes`); a Ray worker's collects them (`CollectedOutcomes`) for the driver to replay into its own."""

    def model_loaded(self, described: dict[str, Any]) -> None:
        """A model loaded to run cells: `LoadedModel.describe()`."""

    def running(self, label: str) -> None:
        """The (cell, sample) starting now."""

    def record(self, record: dict[str, Any], traces: list[dict[str, Any]] | None) -> None:
        """A scored sample, with its memory time series when tracing."""

    def cell(self, status: dict[str, Any], failure: str | None) -> None:
        """A cell's final status line; `failure` is what to tell the user when it failed."""


class FolderOutcomes:
    """Outcomes written into the run folder as they come, and counted on the progress display."""

    def __init__(self, folder: RunFolder, progress: Progress) -> None:
        self.folder = folder
        self.progress = progress

    def model_loaded(self, described: dict[str, Any]) -> None:
        current = self.folder.manifest() or {}
        models = union_models(current.get("models", []), [described])
        if models != current.get("models"):
            self.folder.write_manifest({**current, "models": models})

    def running(self, label: str) -> None:
        self.progress.current = label
        self.progress.update(self.progress)

    def record(self, record: dict[str, Any], traces: list[dict[str, Any]] | None) -> None:
        self.folder.add_record(record)
        if traces is not None:
            self.folder.add_trace(record["cell_id"], record["sample_id"], traces)
        self.progress.samples_done += 1
        self.progress.update(self.progress)

    def cell(self, status: dict[str, Any], failure: str | None) -> None:
        self.folder.add_cell(status)
        self.progress.cells_done += 1
        if failure:
            self.progress.log_failure(Cell(status["cell"]), failure)
        self.progress.update(self.progress)


class CollectedOutcomes:
    """Outcomes kept in order, to be replayed into another sink: what a Ray worker returns for a group."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[Any, ...]]] = []

    def model_loaded(self, described: dict[str, Any]) -> None:
        self.events.append(("model_loaded", (described,)))

    def running(self, label: str) -> None:
        """Not kept: once the group is back it has finished, and the driver shows its own progress."""

    def record(self, record: dict[str, Any], traces: list[dict[str, Any]] | None) -> None:
        self.events.append(("record", (record, traces)))

    def cell(self, status: dict[str, Any], failure: str | None) -> None:
        self.events.append(("cell", (status, failure)))

    def replay(self, outcomes: Outcomes) -> None:
        for method, arguments in self.events:
            getattr(outcomes, method)(*arguments)


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
    failed: dict[str, dict[str, Any]] = {}
    try:
        task = cell_task(cells[0])
        samples = task.samples(lm.tokenizer, first["context_length"], first["samples"], first["seed"])
    except KvbenchError as exc:  # e.g. a context length too short for the task: every cell of the group fails
        for index, cell in enumerate(cells):
            outcomes.cell(_failure(cell, exc), str(exc) if index == 0 else None)  # told once for the group
        return True
    started = {cell.id: time.perf_counter() for cell in cells}
    for batch in sample_batches(samples, batch_size):
        todo = {c.id: [s for s in batch if (c.id, s.id) not in done] for c in cells if c.id not in failed}
        sizes = prompt_sizes(lm, batch) if len(batch) > 1 else {}  # tokenized once for every cell
        runs = {c.id: row_batches(c, todo[c.id], sizes, lm.num_layers) for c in cells if todo.get(c.id)}
        prefills = None
        if share and task.shares_prefill:
            try:
                prefills = _BatchPrefill.of(lm, [c for c in cells if c.id in runs], runs, batch, first["question"])
            except Exception as exc:  # the prompts' forward failed (out of memory): each cell it served fails
                for cell in [c for c in cells if c.id in runs and _sharable(c)]:
                    _fail(outcomes, failed, cell, exc)
            if failed:
                _release_cached_memory()  # after the failed forward's tensors went with its traceback
        for cell in cells:
            for rows in runs.get(cell.id, []) if cell.id not in failed else []:
                if stop():
                    return False
                outcomes.running(f"{cell.label} {rows[0].id}" + (f" (+{len(rows) - 1})" if len(rows) > 1 else ""))
                try:
                    shared = prefills.rows(rows) if prefills is not None and _sharable(cell) else None
                    records = _run_rows(lm, task, cell, rows, shared, trace)
                except Exception as exc:  # one failing cell never stops the sweep
                    _fail(outcomes, failed, cell, exc)
                finally:
                    shared = None  # this loop's reference too: a part no other cell runs is freed now
                    if prefills is not None and _sharable(cell):
                        prefills.served(cell, rows)
                if cell.id in failed:
                    _release_cached_memory()  # now that the failed cell's tensors went with its traceback
                    break
                for record, traces in records:
                    # the dtype the weights ran in (`auto` resolved), beside the record's `model`
                    outcomes.record({"cell_id": cell.id, "cell": cell.description, **record,
                                     "dtype": str(lm.dtype).removeprefix("torch.")}, traces if trace else None)
        del prefills
    for cell in cells:
        if cell.id not in failed:
            outcomes.cell({"cell_id": cell.id, "cell": cell.description, "status": "ok", "samples": len(samples),
                           "seconds": round(time.perf_counter() - started[cell.id], 3), "finished": now()}, None)
    return True


def sample_batches(samples: list[Sample], batch_size: int) -> list[list[Sample]]:
    """A sample group's samples `batch_size` at a time, in their order: a cell that fails at a sample has then
    recorded the samples before it, as at batch 1."""
    return [samples[start : start + batch_size] for start in range(0, len(samples), batch_size)]


def prompt_sizes(lm: LoadedModel, samples: list[Sample]) -> dict[str, tuple[int, int]]:
    """Each sample's (context, question) length in tokens, by sample id."""
    encoded = {sample.id: encode_prompt(lm.tokenizer, sample) for sample in samples}
    return {sample_id: (len(context), len(question)) for sample_id, (context, question) in encoded.items()}


def row_batches(cell: Cell, samples: list[Sample], sizes: dict[str, tuple[int, int]],
                num_layers: int) -> list[list[Sample]]:
    """How `cell` runs these samples of a batch (`sizes`: their `prompt_sizes`): together, as far as its rows can
    evict as each would alone. Rows run together when they resolve the budget alike (`compression_plan`: a ratio
    of prompts of different lengths does not) and append questions of one length after compression (`question:
    agnostic`); a chunked prefill, or a policy limited to rows of one length (`batch_limit`), needs rows of one
    prompt and answer length. A task, cell or policy that cannot batch at all (`batching_note`) runs each sample
    alone."""
    if len(samples) < 2 or not _batches(cell):
        return [[sample] for sample in samples]
    policy, settings = cell.policy(), cell.settings()
    limit = batch_limit(policy)
    chunked, agnostic = settings.prefill == "chunked", settings.question == "agnostic"
    together: dict[str, list[Sample]] = {}
    for sample in samples:
        context, question = sizes[sample.id]
        try:
            plan = compression_plan(policy, settings, context + question, chunked, num_layers)
        except KvbenchError:  # a sample this cell cannot run: one at a time, so it fails the cell where alone would
            return [[sample] for sample in samples]
        key: list[Any] = [plan, question if agnostic else None]
        if chunked or limit is not None:  # no padding: rows alike in every length
            key += [context, question, settings.max_new_tokens or sample.max_new_tokens]
        together.setdefault(json.dumps(key), []).append(sample)
    return list(together.values())


def batching_note(cell: Cell) -> str | None:
    """Why `cell` runs its samples one at a time whatever the batch size, or batches only samples of one length
    (one line); None: its samples batch."""
    alone = _alone(cell)
    if alone is not None:
        return alone
    limit = batch_limit(cell.policy())
    if limit is None:
        return None
    how = "runs each sample alone" if limit.rows == "alone" else "batches only samples of one prompt length"
    return f"{_policy_label(cell)} {how}: {limit.reason}"


def _alone(cell: Cell) -> str | None:
    """Why `cell` runs each sample alone whatever its policy, or None."""
    d = cell.description
    task = cell_task(cell)
    if not task.batches:
        return f"task '{task.name}' runs each sample its own way, one at a time"
    if "timing" in d:
        return "speed cells (timing:) time each sample alone"
    if "memory" in d:
        return "memory-pressure cells run each sample alone under their memory condition"
    if "fidelity" in d.get("diagnostics", ()):
        return "fidelity diagnostics follow each sample's full cache alone"
    if threshold_from(d["budget"]) is not None:
        return "threshold budgets keep each sample's own count, so run each sample alone"
    return None


def _batches(cell: Cell) -> bool:
    """Whether `cell` may run several samples together (some, where its policy needs rows of one length)."""
    limit = batch_limit(cell.policy())
    return _alone(cell) is None and (limit is None or limit.rows != "alone")


def batching(cells: list[Cell], batch_size: int) -> dict[str, Any]:
    """The manifest's `batching`: the batch size and one line for each kind of cell that batches less."""
    return {"batch_size": batch_size,
            "fallback": sorted({note for cell in cells if (note := batching_note(cell))} if batch_size > 1 else ())}


def _policy_label(cell: Cell) -> str:
    policy = cell.description["policy"]
    params = ",".join(f"{k}={v}" for k, v in policy["params"].items())
    return f"{policy['name']}{f'({params})' if params else ''}"


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


def _sharable(cell: Cell) -> bool:
    """Whether the cell may start from the sample's shared prompt forward: not a speed cell (it times its
    own) nor a memory-pressure one (the prompt's forward is what may not fit)."""
    d = cell.description
    return d["prefill"]["mode"] == "full" and "timing" not in d and "memory" not in d


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
        sharing = [cell for cell in cells if _sharable(cell)]
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


def cell_work(cells: list[Cell], share: bool, batch_size: int = 1) -> list[CellWork]:
    """What each cell costs, as a time estimate counts it: its sample group's first cell runs the shared prompt
    forwards, the others start from them."""
    prompts_run: set[tuple[tuple[str, str], str, int, str]] = set()
    work = []
    for cell in cells:
        d = cell.description
        task = cell_task(cell)
        samples = task.sample_count(d["samples"])
        prompt, decoded = task.work(d["context_length"], d["max_new_tokens"])
        shared = share and task.shares_prefill and _sharable(cell) and cell.group in prompts_run
        prompts_run.add(cell.group)
        rows = min(batch_size, samples) if batch_size > 1 and _batches(cell) else 1
        work.append(CellWork(0 if shared else samples, prompt, decoded * -(-samples // rows), rows))
    return work


def token_work(cells: list[Cell], share: bool, batch_size: int = 1) -> float:
    """How long `cells` take relative to others, without the model's shape (to order work units)."""
    return sum(work.relative_cost for work in cell_work(cells, share, batch_size))


def work_units(cells: list[Cell], share: bool) -> list[list[Cell]]:
    """What an executor hands a worker at a time, longest first within each model (models in grid order, so a
    worker loads each model once), so that the sweep's tail is short: a sample group's cells that share its prompt
    forward, together; every other cell alone (its own prompt, or `--no-share`)."""
    units: dict[tuple, list[Cell]] = {}
    for cell in cells:
        together = share and cell_task(cell).shares_prefill and _sharable(cell)
        units.setdefault(cell.group if together else (cell.group, cell.id), []).append(cell)
    models = list(dict.fromkeys(cell.model for cell in cells))
    return sorted(units.values(), key=lambda unit: (models.index(unit[0].model), -token_work(unit, share)))


def wall_seconds(unit_seconds: list[float], workers: int) -> float:
    """The sweep's wall time when `workers` take the units in this order, each the next one as it gets free."""
    free_at = [0.0] * workers
    for seconds in unit_seconds:
        heapq.heapreplace(free_at, free_at[0] + seconds)
    return max(free_at)
