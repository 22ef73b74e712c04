"""Which samples run together: a sample group's samples `batch_size` at a time, and how each cell runs the rows of
a batch (together as far as they evict as each would alone, else one at a time)."""

from __future__ import annotations

import json
from typing import Any

from kvbench.config.cells import Cell, cell_task
from kvbench.engine.models import LoadedModel
from kvbench.engine.settings import compression_plan
from kvbench.errors import KvbenchError
from kvbench.policies.base import batch_limit
from kvbench.policies.budgets import threshold_from
from kvbench.tasks import Sample
from kvbench.tasks.base import encode_prompt


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
    if len(samples) < 2 or not may_batch(cell):
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
    return f"{cell.policy_label} {how}: {limit.reason}"


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


def may_batch(cell: Cell) -> bool:
    """Whether `cell` may run several samples together (some, where its policy needs rows of one length)."""
    limit = batch_limit(cell.policy())
    return _alone(cell) is None and (limit is None or limit.rows != "alone")


def batching(cells: list[Cell], batch_size: int) -> dict[str, Any]:
    """The manifest's `batching`: the batch size and one line for each kind of cell that batches less."""
    return {"batch_size": batch_size,
            "fallback": sorted({note for cell in cells if (note := batching_note(cell))} if batch_size > 1 else ())}
