"""A sweep's work as its time estimate and its executors see it: what each cell costs (`CellWork`), and the units an
executor hands a worker at a time."""

from __future__ import annotations

import math
from typing import Any

from kvbench.config.cells import Cell, cell_task, sharable
from kvbench.engine.estimate import CellWork
from kvbench.runs.batching import may_batch


def cell_work(cells: list[Cell], share: bool, batch_size: int = 1) -> list[CellWork]:
    """What each cell costs, as a time estimate counts it: its sample group's first cell runs the shared prompt
    forwards, the others start from them."""
    prompts_run: set[tuple[tuple[str, str], str, int, str]] = set()
    work = []
    for cell in cells:
        d = cell.description
        task = cell_task(cell)
        samples = served_requests(d["load"]) if "load" in d else task.sample_count(d["samples"])
        prompt, decoded = task.work(d["context_length"], d["max_new_tokens"])
        shared = share and task.shares_prefill and sharable(cell) and cell.group in prompts_run
        prompts_run.add(cell.group)
        rows = min(batch_size, samples) if batch_size > 1 and may_batch(cell) else 1
        work.append(CellWork(0 if shared else samples, prompt, decoded * -(-samples // rows), rows))
    return work


def served_requests(load: dict[str, Any]) -> int:
    """Requests a load cell serves at most: its own, once per rate a search tries (its doublings from `start` within
    `limit`, then `refine` halvings)."""
    if load.get("rate") != "auto":
        return int(load["requests"])
    search = load["search"]
    return load["requests"] * (int(math.log2(search["limit"] / search["start"]) + 1e-9) + 1 + search["refine"])


def token_work(cells: list[Cell], share: bool, batch_size: int = 1) -> float:
    """How long `cells` take relative to others, without the model's shape (to order work units)."""
    return sum(work.relative_cost for work in cell_work(cells, share, batch_size))


def work_units(cells: list[Cell], share: bool) -> list[list[Cell]]:
    """What an executor hands a worker at a time, longest first within each model (models in grid order, so a
    worker loads each model once), so that the sweep's tail is short: a sample group's cells that share its prompt
    forward, together; every other cell alone (its own prompt, or `--no-share`)."""
    units: dict[tuple, list[Cell]] = {}
    for cell in cells:
        together = share and cell_task(cell).shares_prefill and sharable(cell)
        units.setdefault(cell.group if together else (cell.group, cell.id), []).append(cell)
    models = list(dict.fromkeys(cell.model for cell in cells))
    return sorted(units.values(), key=lambda unit: (models.index(unit[0].model), -token_work(unit, share)))
