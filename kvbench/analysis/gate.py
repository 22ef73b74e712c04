"""Freeze a run's per-cell metrics as a baseline, and gate a later run against it.

A score regression fails only when the paired bootstrap CI of (run - baseline) over the same
samples lies wholly below -max_drop: noise does not fail the gate, a real drop does. A cell of few 0/1
samples can support only a large drop (two samples: both must fall), so each cell says the smallest drop it
could ever detect, and the same test runs pooled over each policy's cells and over the whole run, which have
the power single cells lack. Memory is deterministic and fails beyond a relative increase; with
`strict_predictions` any changed prediction fails (deterministic CI on one machine type). Speed is compared
only as ratios against the `full` cell of the same run at the same batch size (absolute times are never
compared across machines), and never between a run and a baseline that decoded at different batch sizes: the gate
refuses to (a batch's tokens/s measures the batch, not one sequence).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import numpy as np

from kvbench.analysis.columns import Column, gated
from kvbench.analysis.summary import bootstrap_ci, load_label
from kvbench.errors import KvbenchError
from kvbench.policies.budgets import budget_suffix
from kvbench.runs.run_folder import RunFolder, now

FORMAT = "kvbench-baseline/1"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cell_metrics(run: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The run's manifest and, per cell id, what a baseline keeps of it."""
    folder = RunFolder(run)
    manifest = folder.manifest()
    if manifest is None:
        raise KvbenchError(f"not a run folder (no manifest.json): {run}")
    statuses = folder.cells()
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for record in folder.records():
        if record["cell_id"] in manifest["cells"]:
            by_cell.setdefault(record["cell_id"], []).append(record)
    speed = [c.name for c in gated("speed")]  # higher is better; ratios against full in the same run
    full_speed = {}
    for records in by_cell.values():
        cell = records[0]["cell"]
        if cell["policy"]["name"] == "full":  # full at the same batch size: ratios of like with like
            full_speed[_pairing(cell), batch_size(records)] = {key: _mean(records, key) for key in speed}
    cells = {}
    for cell_id in manifest["cells"]:
        records = by_cell.get(cell_id, [])
        status = statuses.get(cell_id, {}).get("status", "missing" if not records else "partial")
        if not records:
            described = statuses.get(cell_id, {}).get("cell")
            cells[cell_id] = {"status": status, **({"label": _label(described)} if described else {})}
            continue
        cell = records[0]["cell"]
        scores = {r["sample_id"]: r["scores"]["score"] for r in records}
        low, high = bootstrap_ci(np.array(list(scores.values()), dtype=float))
        base = full_speed.get((_pairing(cell), batch_size(records)), {})
        cells[cell_id] = {
            "label": _label(cell),
            "policy": _policy_label(cell),
            "status": status,
            "n": len(scores),
            "higher_is_better": records[0].get("higher_is_better", True),
            "score": float(np.mean(list(scores.values()))),
            "score_ci": [low, high],
            "samples": scores,
            "predictions": {r["sample_id"]: _digest(r["prediction"]) for r in records},
            **_fidelity(records),
            **{c.name: _mean(records, c.name) for c in gated("memory") + gated("kept")},
            "speed_vs_full": {key: mean / full for key in speed
                              if (full := base.get(key)) and (mean := _mean(records, key)) is not None},
            "batch_size": batch_size(records),
        }
    return manifest, cells


def _fidelity(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per sample, the fidelity column (KL from the full cache) where the cell measured it: the gate pairs it."""
    out = {}
    for c in gated("fidelity"):
        if any(r.get(c.name) is not None for r in records):
            out["kl"] = {r["sample_id"]: r[c.name] for r in records if r.get(c.name) is not None}
    return out


def batch_size(records: list[dict[str, Any]]) -> int:
    """The most samples a cell's records decoded together (records before batching: one)."""
    return max((r.get("batch_size") or 1 for r in records), default=1)


def improvement(base: float, run: float, higher_is_better: bool) -> float:
    """The change from `base` to `run` in points, positive when better: score x 100 for a fraction, and
    the relative change in percent for a lower-is-better score (perplexity 10 -> 10.5 is -5 points)."""
    return (run - base) * 100 if higher_is_better else (base - run) / base * 100


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(values)) if values else None


def _pairing(cell: dict[str, Any]) -> str:
    keys = ("model", "task", "context_length", "question", "prefill", "samples", "seed")
    return json.dumps({k: cell[k] for k in keys}, sort_keys=True)


def _policy_label(cell: dict[str, Any]) -> str:
    params = ",".join(f"{k}={v}" for k, v in cell["policy"]["params"].items())
    return f"{cell['policy']['name']}{f'({params})' if params else ''}"


def _label(cell: dict[str, Any]) -> str:
    load = f" at {load_label(cell['load'])}" if "load" in cell else ""
    return (f"{cell['task']['name']} L={cell['context_length']} {cell['question']} {_policy_label(cell)}"
            f"{budget_suffix(cell['budget'])}{load}")


@functools.lru_cache(maxsize=256)
def detectable_drop(samples: int, max_drop: float) -> float | None:
    """The smallest mean drop, in points, that `samples` paired 0/1 scores can show as a regression beyond
    `max_drop`: k of them falling from 1 to 0, for the fewest k whose bootstrap CI lies wholly below -max_drop;
    None when not even all of them falling would."""
    for k in range(1, samples + 1):
        if bootstrap_ci(np.array([-100.0] * k + [0.0] * (samples - k)))[1] < -max_drop:
            return 100.0 * k / samples
    return None


def make_baseline(run: str | Path, out: str | Path) -> dict[str, Any]:
    manifest, cells = cell_metrics(run)
    baseline = {
        "format": FORMAT,
        "created": now(),
        "source_run": str(run),
        "name": manifest.get("name"),
        "config_hash": manifest["config_hash"],
        "environment": manifest.get("environment", {}),
        "cells": cells,
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_suffix(out.suffix + ".tmp")
    staging.write_text(json.dumps(baseline, indent=1, sort_keys=True))
    staging.replace(out)
    return baseline


def load_baseline(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise KvbenchError(f"baseline not found: {path}")
    try:
        baseline = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise KvbenchError(f"{path}:{exc.lineno}: baseline is not valid JSON") from None
    if not isinstance(baseline, dict) or baseline.get("format") != FORMAT:
        raise KvbenchError(f"{path}: not a kvbench baseline (expected format {FORMAT})")
    return baseline


@dataclass
class Limits:
    max_drop: float = 1.0  # score points (score x 100)
    max_mem_increase: float = 0.05  # fraction
    max_slowdown: float | None = None  # fraction; None: speed is not gated
    strict: bool = False
    strict_predictions: bool = False  # any changed prediction fails
    max_kl_increase: float | None = None  # nats per step; cells that carry fidelity (kl_mean) only


@dataclass
class Check:
    cell_id: str
    label: str
    verdict: str  # pass | fail | missing | new
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    score: tuple[float, float] | None = None  # baseline, run
    delta: tuple[float, float, float] | None = None  # mean, CI low, CI high (points)
    memory: tuple[float, float] | None = None
    detectable: float | None = None  # the smallest drop (points) this check could detect; None: none at all
    underpowered: bool = False  # cannot detect a drop of max_drop

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"


def gate(run: str | Path, baseline: dict[str, Any], limits: Limits) -> list[Check]:
    manifest, current = cell_metrics(run)
    if manifest["config_hash"] != baseline["config_hash"]:
        raise KvbenchError(
            f"the baseline was made from another config (hash {baseline['config_hash']}, this run "
            f"{manifest['config_hash']}): make a new baseline with `kvbench baseline`"
        )
    if limits.max_slowdown is not None:
        _same_batch_sizes(baseline["cells"], current)
    checks = []
    for cell_id in sorted(set(baseline["cells"]) | set(current), key=lambda c: _sort_key(baseline, current, c)):
        base, now_ = baseline["cells"].get(cell_id), current.get(cell_id)
        label = (now_ or {}).get("label") or (base or {}).get("label") or cell_id
        if base is None:
            checks.append(Check(cell_id, label, "fail" if limits.strict else "new", ["not in the baseline"]))
        elif now_ is None or ("samples" not in now_ and now_["status"] not in ("error", "oom")):
            status = (now_ or {}).get("status", "not in the run's grid")
            checks.append(Check(cell_id, label, "fail" if limits.strict else "missing", [f"not run ({status})"]))
        elif "samples" not in now_:
            if "samples" in base:
                checks.append(Check(cell_id, label, "fail", [f"status {now_['status']}"]))
            else:
                checks.append(Check(cell_id, label, "pass", notes=[f"{now_['status']}, as in the baseline"]))
        elif "samples" not in base:
            checks.append(Check(cell_id, label, "pass", notes=[f"was {base['status']} in the baseline"]))
        else:
            checks.append(_compare(cell_id, label, base, now_, limits))
    return checks + _pooled(baseline["cells"], current, limits)


def _same_batch_sizes(baseline: dict[str, Any], current: dict[str, Any]) -> None:
    """Speed is gated only between a run and a baseline that decoded each cell at one batch size."""
    for cell_id, run in sorted(current.items(), key=lambda item: item[1].get("label", item[0])):
        base = baseline.get(cell_id)
        if base is None or "samples" not in base or "samples" not in run:
            continue
        before, now_ = base.get("batch_size", 1), run.get("batch_size", 1)
        if before != now_:
            raise KvbenchError(f"--max-slowdown: {run['label']} decoded at batch size {now_}, the baseline at "
                               f"{before}; their speeds do not compare (sweep at --batch-size {before}, or gate "
                               "without --max-slowdown)")


def _paired(base: dict[str, Any], run: dict[str, Any]) -> np.ndarray:
    """Per sample both ran, the change in points (positive: better)."""
    shared = sorted(set(base["samples"]) & set(run["samples"]))
    return np.array([improvement(base["samples"][s], run["samples"][s], base.get("higher_is_better", True))
                     for s in shared], dtype=float)


def _pooled(baseline: dict[str, Any], current: dict[str, Any], limits: Limits) -> list[Check]:
    """The drop test over every sample of each policy's cells, and over every cell but `full`'s."""
    groups: dict[str, list[np.ndarray]] = {}
    for cell_id, run in current.items():
        base = baseline.get(cell_id)
        if base is None or "samples" not in base or "samples" not in run:
            continue
        diff = _paired(base, run)
        groups.setdefault(f"pooled {run['policy']}", []).append(diff)
        if run["policy"] != "full":
            groups.setdefault("pooled: every policy but full", []).append(diff)
    policies = [label for label in groups if label not in ("pooled full", "pooled: every policy but full")]
    if len(policies) < 2:  # one policy: the whole run is that policy's pool
        groups.pop("pooled: every policy but full", None)
    checks = []
    for label, diffs in groups.items():
        diff = np.concatenate(diffs)
        low, high = bootstrap_ci(diff)
        check = Check(label, f"{label} ({len(diff)} samples)", "pass", delta=(float(diff.mean()), low, high))
        if high < -limits.max_drop:
            check.verdict = "fail"
            check.reasons.append(f"score dropped {-diff.mean():.1f} points over {len(diff)} samples (95% CI "
                                 f"[{low:+.1f}, {high:+.1f}] is below -{limits.max_drop:g})")
        checks.append(check)
    return checks


def _sort_key(baseline: dict[str, Any], current: dict[str, Any], cell_id: str) -> str:
    return (current.get(cell_id) or baseline["cells"].get(cell_id) or {}).get("label", cell_id)


def _compare(cell_id: str, label: str, base: dict[str, Any], run: dict[str, Any], limits: Limits) -> Check:
    check = Check(cell_id, label, "pass", score=(base["score"], run["score"]))
    if base.get("batch_size", 1) != run.get("batch_size", 1):  # scores compare; speeds would not (not gated)
        check.notes.append(f"batch size {run.get('batch_size', 1)}, the baseline's {base.get('batch_size', 1)}")
    if run["status"] != "ok":
        check.reasons.append(f"status {run['status']}")
    shared = sorted(set(base["samples"]) & set(run["samples"]))
    if shared:
        diff = _paired(base, run)
        low, high = bootstrap_ci(diff)
        check.delta = (float(diff.mean()), low, high)
        if high < -limits.max_drop:
            check.reasons.append(f"score dropped {-diff.mean():.1f} points (95% CI of the change "
                                 f"[{low:+.1f}, {high:+.1f}] is below -{limits.max_drop:g})")
        changed = sum(base["predictions"].get(s) != run["predictions"].get(s) for s in shared)
        if changed:
            (check.reasons if limits.strict_predictions else check.notes).append(
                f"{changed}/{len(shared)} predictions changed")
        if base.get("higher_is_better", True):  # 0/1-like fractions: a sample can fall at most 100 points
            check.detectable = detectable_drop(len(shared), limits.max_drop)
            # no drop it could show: not even all samples falling, or more than the baseline has to lose
            detectable = check.detectable
            blind = detectable is None or base["score"] * 100 < detectable
            check.underpowered = blind or (detectable is not None and detectable > limits.max_drop)
            check.notes.append("can detect no drop" if blind else f"detects a drop of >= {detectable:.0f} points")
    if limits.max_kl_increase is not None and base.get("kl") and run.get("kl"):
        paired = sorted(set(base["kl"]) & set(run["kl"]))
        rise = np.array([run["kl"][s] - base["kl"][s] for s in paired], dtype=float)
        low, high = bootstrap_ci(rise)
        if len(rise) and low > limits.max_kl_increase:
            check.reasons.append(f"KL from the full cache rose {rise.mean():+.4f} nats (95% CI [{low:+.4f}, "
                                 f"{high:+.4f}] is above +{limits.max_kl_increase:g})")
    for index, c in enumerate(gated("memory")):
        _memory(check, c, base, run, limits, shown=index == 0)
    if limits.max_slowdown is not None:
        for key, ratio in run.get("speed_vs_full", {}).items():
            before = base.get("speed_vs_full", {}).get(key)
            if before and ratio < before * (1 - limits.max_slowdown):
                check.reasons.append(f"{key} vs full fell from {before:.2f}x to {ratio:.2f}x "
                                     f"(limit -{limits.max_slowdown:.0%})")
    if check.reasons:
        check.verdict = "fail"
    return check


def _memory(check: Check, column: Column, base: dict[str, Any], run: dict[str, Any], limits: Limits,
            shown: bool) -> None:
    """A memory column fails beyond a relative increase; the first one is the gate table's memory column."""
    before, after = base.get(column.name), run.get(column.name)
    if not before or after is None:
        return
    if shown:
        check.memory = (before, after)
    growth = after / before - 1
    if growth > limits.max_mem_increase:
        heading = column.shown["gate"].heading if "gate" in column.shown else column.name
        check.reasons.append(f"{heading} grew {growth:+.1%} (limit {limits.max_mem_increase:.0%})")


def memory_heading() -> str:
    """The gate table's heading for its memory column."""
    first = gated("memory")[0]
    return first.shown["gate"].heading if "gate" in first.shown else first.name


def junit(checks: list[Check]) -> str:
    suite = ElementTree.Element("testsuite", name="kvbench-gate", tests=str(len(checks)),
                                failures=str(sum(c.failed for c in checks)),
                                skipped=str(sum(c.verdict in ("missing", "new") for c in checks)))
    for check in checks:
        case = ElementTree.SubElement(suite, "testcase", classname="kvbench.analysis.gate", name=check.label)
        if check.failed:
            ElementTree.SubElement(case, "failure", message="; ".join(check.reasons)).text = "; ".join(check.reasons)
        elif check.verdict in ("missing", "new"):
            ElementTree.SubElement(case, "skipped", message="; ".join(check.reasons))
    return ElementTree.tostring(suite, encoding="unicode")


def markdown(checks: list[Check]) -> str:
    failed = sum(c.failed for c in checks)
    lines = [f"## kvbench gate: {'FAILED' if failed else 'passed'} ({failed} of {len(checks)} checks failed)", "",
             f"| cell | verdict | score (baseline -> run) | change, points [95% CI] | {memory_heading()} | why |",
             "|---|---|---|---|---|---|"]
    for c in checks:
        score = "" if c.score is None else f"{c.score[0]:.2f} -> {c.score[1]:.2f}"
        delta = "" if c.delta is None else f"{c.delta[0]:+.1f} [{c.delta[1]:+.1f}, {c.delta[2]:+.1f}]"
        memory = "" if c.memory is None else f"{c.memory[1] / c.memory[0] - 1:+.1%}"
        lines.append(f"| {c.label} | {c.verdict} | {score} | {delta} | {memory} | "
                     f"{'; '.join(c.reasons + c.notes)} |")
    return "\n".join(lines) + "\n"
