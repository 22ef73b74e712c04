"""The grid: a sweep config expanded into cells, each one point with an id that hashes its description, and what a
cell says of itself (its policy, settings, task and sample group)."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from kvbench.config.schema import SweepConfig
from kvbench.engine.estimate import parse_bytes
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import POLICIES, Policy
from kvbench.policies.base import takes_budget
from kvbench.policies.budgets import budget_suffix, budget_value
from kvbench.tasks import TASKS, Task


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
    def policy_label(self) -> str:
        """The policy with its parameters: `snapkv(window=32)`."""
        policy = self.description["policy"]
        params = ",".join(f"{k}={v}" for k, v in policy["params"].items())
        return f"{policy['name']}{f'({params})' if params else ''}"

    @property
    def label(self) -> str:
        d = self.description
        return f"{self.policy_label}{budget_suffix(d['budget'])} L={d['context_length']}"


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
    if config.load:  # one cell per arrival condition
        cells = [Cell({**cell.description, "load": load}) for cell in cells for load in config.load.conditions()]
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


def sample_total(cells: list[Cell]) -> int:
    """Samples the grid scores in all (cells x the samples each cell's task makes)."""
    return sum(cell.description["load"]["requests"] if "load" in cell.description
               else cell_task(cell).sample_count(cell.description["samples"]) for cell in cells)


def cell_task(cell: Cell) -> Task:
    return TASKS.build(cell.description["task"]["name"], cell.description["task"]["params"])


def sharable(cell: Cell) -> bool:
    """Whether the cell may start from the sample's shared prompt forward: not a speed cell (it times its
    own), a memory-pressure one (the prompt's forward is what may not fit) nor a load cell (a service prefills
    each request as it is admitted)."""
    d = cell.description
    return d["prefill"]["mode"] == "full" and "timing" not in d and "memory" not in d and "load" not in d
