"""`kvbench sweep --executor ray`: a sweep's work units on a Ray cluster's workers, into the same run folder.

A worker is a long-lived actor (one per GPU, or `--workers` of them on CPUs) that loads a model once and runs unit
after unit (`kvbench.runs.work.work_units`: a sample group's cells that share its prompt forward, or one cell) with the
local sweep's own `run_group`, collecting what it produces instead of writing it. The driver is the only writer of
the run folder: it replays each unit's outcomes into it as the unit comes back, so the folder, its resume and every
command downstream are those of a local sweep. A kill of the driver loses the units in flight; a worker that dies
has its unit run again by another worker, at most twice, before the unit's cells are recorded as errors.

Imported only for `--executor ray`: kvbench itself does not need Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from kvbench.config.cells import Cell
from kvbench.config.schema import SweepConfig
from kvbench.errors import KvbenchError
from kvbench.registry import load_plugins
from kvbench.runs.outcomes import CollectedOutcomes, FolderOutcomes, Progress
from kvbench.runs.run_folder import RunFolder, environment, now
from kvbench.runs.sweep import Interrupt, ModelLoader, load_or_fail, resume_point, run_group
from kvbench.runs.work import work_units

ATTEMPTS = 3  # a unit whose worker died runs on another at most twice more


class SweepWorker:
    """A Ray actor's body: the held model stays loaded from one unit to the next."""

    def __init__(self, config: SweepConfig, plugins: list[str], threads: int) -> None:
        for folder in plugins:  # the policies and tasks the driver registered, registered here too
            load_plugins(folder)
        torch.set_num_threads(threads)
        self.models = ModelLoader(config)

    def where(self) -> str:
        """Where it runs: node, GPUs and process id (what `--verbose` names it by)."""
        gpus = ",".join(str(gpu) for gpu in ray.get_gpu_ids())
        return f"{ray.util.get_node_ip_address()}{f' GPU {gpus}' if gpus else ''} pid {os.getpid()}"

    def describe(self, model: tuple[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load `model` (kept for the units to come) and describe it and the machine, for the manifest."""
        lm = self.models.load(model)
        return lm.describe(), environment(lm.device)

    def run(self, cells: list[Cell], done: set[tuple[str, str]], share: bool, trace: bool) -> CollectedOutcomes:
        """One unit's unrecorded samples, and what they produced, in order."""
        outcomes = CollectedOutcomes()
        lm = load_or_fail(self.models, cells, outcomes)
        if lm is not None:
            run_group(lm, cells, done, outcomes, share, trace, stop=lambda: False, batch_size=self.models.batch_size)
        return outcomes


@dataclass
class Worker:
    number: int
    actor: Any  # a handle of a SweepWorker actor
    where: str = "starting"


class WorkerPool:
    """The sweep's workers on the cluster `ray.init` connected to; `replace` starts another for one that died."""

    def __init__(self, config: SweepConfig, plugins: list[str], workers: int | None,
                 gpus_per_worker: float | None) -> None:
        resources = ray.cluster_resources()
        gpus, cpus = resources.get("GPU", 0.0), resources.get("CPU", 1.0)
        self.gpus_per_worker = (1.0 if gpus else 0.0) if gpus_per_worker is None else gpus_per_worker
        if self.gpus_per_worker > gpus:
            raise KvbenchError(f"--gpus-per-worker {self.gpus_per_worker:g}: the Ray cluster has {gpus:g} GPUs")
        if workers is None and not self.gpus_per_worker:
            raise KvbenchError("the Ray cluster has no GPUs: give --workers N to run N workers on its CPUs")
        self.size = workers or int(gpus // self.gpus_per_worker)
        # CPU workers split the cluster's cores between them (whole cores, while there are enough); a GPU worker
        # needs one core at most to drive its GPU
        share_of_cpus = cpus // self.size if self.size <= cpus else cpus / self.size
        self.cpus_per_worker = min(1.0, cpus / self.size) if self.gpus_per_worker else share_of_cpus
        self._options = {"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker}
        self._arguments = config, plugins, max(1, int(self.cpus_per_worker))
        self.workers: list[Worker] = []
        for _ in range(self.size):
            self.start()

    def start(self) -> Worker:
        actor = ray.remote(SweepWorker).options(**self._options).remote(*self._arguments)
        self.workers.append(Worker(len(self.workers) + 1, actor))
        return self.workers[-1]

    def describe(self, model: tuple[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The first worker loads the sweep's first model: a bad model spec stops here, before the run folder is
        written, as it does locally."""
        try:
            return ray.get(self.workers[0].actor.describe.remote(model))
        except RayTaskError as exc:
            if isinstance(exc.cause, KvbenchError):
                raise KvbenchError(str(exc.cause)) from None
            raise exc.cause from None
        except RayActorError as exc:
            raise KvbenchError(f"the first Ray worker failed to start: {_first_line(exc)}") from None

    def manifest_entry(self) -> dict[str, Any]:
        """The executor in the manifest: the cluster's nodes (address, CPUs, GPUs and their kind) and the workers."""
        nodes = []
        for node in ray.nodes():
            if node["Alive"]:
                resources = node["Resources"]
                kinds = [key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")]
                nodes.append({"address": node["NodeManagerAddress"], "cpus": resources.get("CPU", 0.0),
                              "gpus": resources.get("GPU", 0.0), "gpu_kind": kinds[0] if kinds else None})
        return {"name": "ray", "address": ray.get_runtime_context().gcs_address, "workers": self.size,
                "gpus_per_worker": self.gpus_per_worker, "cpus_per_worker": self.cpus_per_worker,
                "gpus": sum(node["gpus"] for node in nodes), "nodes": nodes}

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker.actor)


@contextlib.contextmanager
def cluster(address: str | None) -> Iterator[None]:
    """Connected to the Ray cluster at `address` (`auto`: the one `ray start` began on this machine; none: that or a
    new local one) for the block; a connection this process already holds is used as it is."""
    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise KvbenchError(f"--address {address}: no Ray cluster to connect to ({_first_line(exc)})") from None
    try:
        yield
    finally:
        ray.shutdown()


def run_sweep(pool: WorkerPool, folder: RunFolder, cells: list[Cell], progress: Progress, share: bool = True,
              retry_failed: bool = False, trace: bool = False, verbose: bool = False) -> bool:
    """Run every unfinished (cell, sample) on the pool's workers into `folder`, longest unit first, each worker
    taking the next unit as it gets free. The first Ctrl-C hands out no more units and waits for those in flight;
    True if every unit ran."""
    done, pending = resume_point(folder, cells, progress, retry_failed)
    dispatch = _Dispatch(pool, work_units(pending, share), done, FolderOutcomes(folder, progress), share, trace,
                         verbose, several_models=len({cell.model for cell in cells}) > 1)
    with Interrupt() as interrupt:
        while dispatch.queue or dispatch.running:
            dispatch.hand_out(interrupt)
            if not dispatch.running and (interrupt.requested or not dispatch.starting):
                break
            dispatch.wait()
    progress.update(progress)  # shows what was told after the last unit
    if dispatch.queue and not interrupt.requested:
        raise KvbenchError("no Ray worker could start (see above); rerun the same command to resume")
    return not dispatch.queue


class _Dispatch:
    """A sweep's units handed out to the pool's workers: the units left (`queue`), the workers starting, running a
    unit or idle, and how many workers died running each unit."""

    def __init__(self, pool: WorkerPool, units: list[list[Cell]], done: set[tuple[str, str]],
                 outcomes: FolderOutcomes, share: bool, trace: bool, verbose: bool, several_models: bool) -> None:
        self.pool, self.units, self.done, self.outcomes = pool, units, done, outcomes
        self.share, self.trace, self.verbose, self.several_models = share, trace, verbose, several_models
        self.progress = outcomes.progress
        self.queue = deque(range(len(units)))  # indices into `units`, in the order handed out
        self.deaths = [0] * len(units)  # per unit, how many workers died running it
        self.starting = {worker.actor.where.remote(): worker for worker in pool.workers}
        self.running: dict[Any, tuple[Worker, int, float]] = {}  # a unit's result -> its worker, unit and start time
        self.idle: list[Worker] = []

    def tell(self, note: str, always: bool = False) -> None:
        if self.verbose or always:
            self.progress.notes.append(note)

    def hand_out(self, interrupt: Interrupt) -> None:
        """A unit to each idle worker, while units are left and no Ctrl-C came."""
        while self.queue and self.idle and not interrupt.requested:
            worker, index = self.idle.pop(0), self.queue.popleft()
            unit = self.units[index]
            ids = {cell.id for cell in unit}
            unit_done = {key for key in self.done if key[0] in ids}
            result = worker.actor.run.remote(unit, unit_done, self.share, self.trace)
            self.running[result] = worker, index, time.perf_counter()
            self.tell(f"worker {worker.number} ({worker.where}): {_label(unit)}")

    def wait(self) -> None:
        """Take what the next worker to start or finish a unit says, or return after a second (to see a Ctrl-C)."""
        self.progress.current = f"{len(self.running)} of {self.pool.size} workers busy"
        self.progress.update(self.progress)
        ready, _ = ray.wait([*self.starting, *self.running], num_returns=1, timeout=1.0)
        for ref in ready:
            if ref in self.starting:
                self._started(ref)
            else:
                self._finished(ref)

    def _started(self, ref: Any) -> None:
        worker = self.starting.pop(ref)
        try:
            worker.where = ray.get(ref)
        except RayActorError as exc:  # not replaced: what kept it from starting would stop the next
            self.tell(f"worker {worker.number} failed to start: {_first_line(exc)}", always=True)
            return
        self.idle.append(worker)

    def _finished(self, ref: Any) -> None:
        worker, index, started = self.running.pop(ref)
        unit = self.units[index]
        self.progress.model = " ".join(unit[0].model) if self.several_models else ""
        try:
            collected = ray.get(ref)
        except RayActorError as exc:  # the worker's process died, or its machine was lost
            self._died(worker, index, exc)
            return
        collected.replay(self.outcomes)
        self.idle.append(worker)
        self.tell(f"worker {worker.number}: {_label(unit)} done in {time.perf_counter() - started:.1f} s")

    def _died(self, worker: Worker, index: int, exc: RayActorError) -> None:
        """The unit runs again, first, on another worker, or fails its cells after `ATTEMPTS` deaths."""
        unit = self.units[index]
        self.deaths[index] += 1
        if self.deaths[index] < ATTEMPTS:
            self.queue.appendleft(index)  # first: the longest left, and it has waited
            self.tell(f"worker {worker.number} ({worker.where}) died running {_label(unit)}; it runs again "
                      f"(attempt {self.deaths[index] + 1} of {ATTEMPTS})", always=True)
        else:
            _fail_unit(self.outcomes, unit, f"the Ray worker running it died {ATTEMPTS} times (last: "
                                            f"{worker.where}: {_first_line(exc)})")
        if self.queue:  # a worker in its place, while there is work for it
            replacement = self.pool.start()
            self.starting[replacement.actor.where.remote()] = replacement
            self.tell(f"worker {replacement.number} starts in place of worker {worker.number}")


def _fail_unit(outcomes: FolderOutcomes, unit: list[Cell], message: str) -> None:
    for cell in unit:
        outcomes.cell({"cell_id": cell.id, "cell": cell.description, "status": "error", "message": message,
                       "finished": now()}, f"error: {message}")


def _label(unit: list[Cell]) -> str:
    if len(unit) == 1:
        return unit[0].label
    d = unit[0].description
    return f"{d['task']['name']} L={d['context_length']} {d['question']}, {len(unit)} cells"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
