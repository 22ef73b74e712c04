"""Threshold budgets: keep every entry whose normalised score reaches a value, however many that is.

A token count (`128`) or a ratio (`0.25`) fixes how many entries each layer and KV head keeps; a threshold
(`{threshold: 0.01}` in a config, `threshold=0.01` on the command line) fixes how important an entry must be, and
each sample, layer and head keeps its own count (DMS, KVzap). What "important" means is each policy's
`threshold_score` (its `threshold_scale` says it in words: docs/running.md has the table). Cells and records
describe one as the mapping `{"threshold": t}`; summaries and figures write it `threshold=t`.

No torch here: the summary, the figures and the gate read budgets too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvbench.errors import KvbenchError

THRESHOLD = "threshold"


@dataclass(frozen=True)
class Threshold:
    """A threshold budget: the entries whose normalised score is at least `value` stay (protected ones always)."""

    value: float

    def __post_init__(self) -> None:
        # every normalised score is an attention weight or a share of a head's total: at most 1
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not 0 < self.value < 1 \
                or not math.isfinite(self.value):
            raise KvbenchError(f"threshold must be a number in (0, 1) (a normalised score), got {self.value!r}")

    def describe(self) -> dict[str, float]:
        """How cells and records write it."""
        return {THRESHOLD: float(self.value)}

    def __str__(self) -> str:
        return f"{THRESHOLD}={self.value:g}"


def threshold_from(spec: Any) -> Threshold | None:
    """The threshold of a budget as a cell describes it (`{"threshold": t}`) or as settings hold it; None for a
    token count, a ratio or no budget. A mapping with other keys is an error that names them."""
    if isinstance(spec, Threshold):
        return spec
    if not isinstance(spec, dict):
        return None
    if set(spec) != {THRESHOLD}:
        raise KvbenchError(f"a budget mapping takes one key, '{THRESHOLD}' (e.g. {{threshold: 0.01}}), got "
                           f"{sorted(spec)}")
    return Threshold(spec[THRESHOLD])


def budget_value(spec: Any) -> Any:
    """A budget as settings take it: a cell's `{"threshold": t}` becomes a `Threshold`, anything else is as is."""
    threshold = threshold_from(spec)
    return spec if threshold is None else threshold


def budget_description(budget: Any) -> Any:
    """A budget as cells and records write it (JSON): a `Threshold` becomes `{"threshold": t}`."""
    return budget.describe() if isinstance(budget, Threshold) else budget


def budget_text(budget: Any) -> str:
    """A cell's budget as summaries, tables and figures show it: `-` (none), `128`, `0.25` or `threshold=0.01`."""
    if budget is None:
        return "-"
    threshold = threshold_from(budget)
    return str(budget) if threshold is None else str(threshold)


def budget_suffix(budget: Any) -> str:
    """A label's budget part: ` b=0.25`, ` b=threshold=0.01`, or nothing without a budget."""
    return "" if budget is None else f" b={budget_text(budget)}"


def budget_order(text: str) -> tuple[int, float]:
    """Sorts budgets as `budget_text` writes them: none, ratios, token counts, then thresholds (each ascending)."""
    if text == "-":
        return (0, 0.0)
    if text.startswith(f"{THRESHOLD}="):
        return (3, float(text.removeprefix(f"{THRESHOLD}=")))
    return (1, float(text)) if "." in text else (2, float(text))
