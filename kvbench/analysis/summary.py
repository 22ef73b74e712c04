"""Per-cell summaries of a run folder: mean score with a 95% bootstrap CI, the paired change
against `full` on the same samples, and the speed and memory columns. Deterministic given the
records (fixed bootstrap seed)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis import columns
from kvbench.analysis.columns import Column, Display, spread, view
from kvbench.config.schema import DEFAULT_ATTAINMENT
from kvbench.engine.estimate import human_bytes
from kvbench.policies.budgets import budget_order, budget_text, threshold_from
from kvbench.runs.run_folder import RunFolder

BOOTSTRAP_RESAMPLES = 2000
# cells that share these see the same samples, so their scores pair up by sample id
PAIRING = ["model", "task", "context_length", "question", "prefill", "samples", "seed"]
# the robustness axes (`models:`, `dtypes:`): a run with several splits its tables, figures and recommendations
MODEL_AXES = ["model", "dtype"]
# an answer at least this many times as long as full's on the same prompt counts as much longer (at most SHORTER:
# much shorter): a mean length ratio near 1 can hide a fifth of the answers running 1.5x long ("Rethinking KV cache
# compression", MLSys 2025)
LONGER, SHORTER = 1.5, 0.67


def _model_axes(cell: dict[str, Any]) -> tuple[str, str]:
    """A cell description's (model id, dtype); "" where a hand-made description leaves one out."""
    model = cell.get("model") or {}
    return (model.get("id", ""), model.get("dtype", "")) if isinstance(model, dict) else (str(model), "")


def _model_label(model: str, dtype: str) -> str:
    return f"{model} ({dtype})" if dtype else model


def model_facets(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The summary's rows per (model, dtype), each with its label (`random:tiny-llama (bfloat16)`): what tables,
    figures and recommendations split by. One part labelled "" when the run has one, so its output reads as before."""
    if len(frame[MODEL_AXES].drop_duplicates()) <= 1:
        return [("", frame)]
    return [(_model_label(*axes), rows) for axes, rows in frame.groupby(MODEL_AXES, sort=False)]


def task_labels(tasks: list[dict[str, Any]]) -> dict[str, str]:
    """A name for each task spec of a run: its name, plus the parameters that tell apart specs that share
    it (`perplexity (mode=exact)` beside `perplexity (chunk=64, mode=chunked)`). Keys: `task_key(spec)`."""
    by_name: dict[str, dict[str, dict[str, Any]]] = {}
    for task in tasks:
        by_name.setdefault(task["name"], {})[task_key(task)] = task["params"]
    labels = {}
    for name, variants in by_name.items():
        keys = {k for params in variants.values() for k in params}
        differing = sorted(k for k in keys if len({repr(p.get(k)) for p in variants.values()}) > 1)
        for key, params in variants.items():
            shown = ", ".join(f"{k}={params[k]}" for k in differing if k in params)
            labels[key] = f"{name} ({shown})" if len(variants) > 1 else name
    return labels


def task_key(task: dict[str, Any]) -> str:
    return json.dumps(task, sort_keys=True, default=str)


def bootstrap_ci(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean."""
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (BOOTSTRAP_RESAMPLES, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(run: str | Path, write: bool = True) -> pd.DataFrame:
    """One row per cell of the run's grid; writes summary.csv (+ .parquet with pyarrow) and summary.md."""
    folder = RunFolder(run)
    manifest = folder.manifest() or {}
    grid = manifest.get("cells")
    records = [r for r in folder.records() if grid is None or r["cell_id"] in grid]
    statuses = folder.cells()
    rows = [_row(cell_id, cell_records, statuses.get(cell_id)) for cell_id, cell_records in _by_cell(records).items()]
    for cell_id, status in statuses.items():  # cells that failed before any sample
        if (grid is None or cell_id in grid) and not any(r["cell_id"] == cell_id for r in rows):
            rows.append(_row(cell_id, [], status))
    described = manifest.get("cell_descriptions", {})
    for cell_id in grid or []:  # cells of the grid that never ran (yet, or in another shard)
        if cell_id in described and not any(r["cell_id"] == cell_id for r in rows):
            rows.append(_row(cell_id, [], {"cell": described[cell_id], "status": "missing"}))
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    labels = task_labels([json.loads(key) for key in frame["_task"]])
    frame["task"] = frame.pop("_task").map(labels)
    _paired_deltas(frame, records)
    order = [*MODEL_AXES, "task", "context_length", "question", "prefill", "policy", "budget_order", "params", "memory",
             "load"]
    frame = frame.sort_values(order, kind="stable").drop(columns=["budget_order"]).reset_index(drop=True)
    if write:
        path = Path(run)
        frame.drop(columns=["_scores"]).to_csv(path / "summary.csv", index=False)
        with contextlib.suppress(ImportError):  # parquet when pyarrow is installed
            frame.drop(columns=["_scores"]).to_parquet(path / "summary.parquet", index=False)
        (path / "summary.md").write_text(markdown(frame, manifest))
        for cell_id, results in lm_eval_results(records).items():  # lm-eval's own results format, per cell
            (path / "lm_eval").mkdir(exist_ok=True)
            (path / "lm_eval" / f"{cell_id}.json").write_text(json.dumps(results, indent=2, default=str))
    return frame.drop(columns=["_scores"])


def lm_eval_results(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cell of `lm_eval` records, lm-eval's results JSON: each task's metrics (mean over its docs, as lm-eval
    aggregates acc and exact_match), the model arguments (the cell's policy and budget) and versions."""
    out: dict[str, dict[str, Any]] = {}
    for cell_id, cell_records in _by_cell([r for r in records if "lm_eval" in r]).items():
        metrics: dict[str, dict[str, list[float]]] = {}
        for record in cell_records:
            for metric, value in record["lm_eval"]["metrics"].items():
                if isinstance(value, (int, float)):
                    metrics.setdefault(record["lm_eval"]["task"], {}).setdefault(metric, []).append(value)
        first = cell_records[0]
        out[cell_id] = {
            "results": {task: {"alias": task, **{f"{m},none": float(np.mean(v)) for m, v in values.items()}}
                        for task, values in metrics.items()},
            "n-samples": {task: {"effective": len(next(iter(values.values())))} for task, values in metrics.items()},
            "config": {"model": "kvbench", "model_args": {"pretrained": first["model"], "policy": first["policy"],
                                                          "budget": first["budget"]},
                       "num_fewshot": first["task"].get("num_fewshot")},
            "versions": first.get("versions", {}),
        }
    return out


def _by_cell(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    cells: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        cells.setdefault(record["cell_id"], []).append(record)
    return cells


def _row(cell_id: str, records: list[dict[str, Any]], status: dict[str, Any] | None) -> dict[str, Any]:
    cell = records[0]["cell"] if records else (status or {})["cell"]
    scores = {r["sample_id"]: r["scores"]["score"] for r in records}
    values = np.array(list(scores.values()), dtype=float)
    low, high = bootstrap_ci(values)
    budget = cell["budget"]
    model, dtype = _model_axes(cell)
    row = {
        "cell_id": cell_id,
        "model": model,
        "dtype": dtype,
        "_task": task_key(cell["task"]),
        "context_length": cell["context_length"],
        "question": cell["question"],
        "prefill": cell["prefill"]["mode"],
        "policy": cell["policy"]["name"],
        # eviction, compression, hybrid (eviction with a storage) or none (full)
        "family": records[0].get("family", "") if records else "",
        "params": ", ".join(f"{k}={param_text(v)}" for k, v in cell["policy"]["params"].items()),
        "budget": budget_text(budget),
        # a threshold cell's threshold (NaN for other budgets): its cache_ratio is what the threshold achieved
        "threshold": threshold.value if (threshold := threshold_from(budget)) else float("nan"),
        "memory": _memory_label(cell.get("memory")),
        "load": load_label(cell.get("load")),
        "load_rate": _load_rate(cell, status),
        "rate_searched": (cell.get("load") or {}).get("rate") == "auto",
        # the share of requests within the SLO at which a rate holds (the report's "sustained")
        "load_attainment": (cell.get("load") or {}).get("attainment", DEFAULT_ATTAINMENT) if cell.get("load")
        else float("nan"),
        "budget_order": budget_order(budget_text(budget)),
        "status": status["status"] if status else "partial",
        # perplexity: lower is better; every other task's score: a fraction where higher is better
        "higher_is_better": records[0].get("higher_is_better", True) if records else True,
        "scenario": records[0].get("scenario") if records else None,  # the workload, for the report's advice
        "n": len(values),
        "score": values.mean() if len(values) else float("nan"),
        "score_ci_low": low,
        "score_ci_high": high,
        "_scores": scores,
        "_pairing": tuple(repr(cell[key]) for key in PAIRING),
    }
    for key in sorted({k for r in records for k in r["scores"]} - {"score"}):
        row[f"score_{key}"] = float(np.mean([r["scores"][key] for r in records if key in r["scores"]]))
    row["_lengths"] = {r["sample_id"]: r["generated_tokens"] for r in records if r.get("generated_tokens")}
    for column in aggregated_columns():
        row.update(AGGREGATORS[str(column.aggregate)](column, records))
    service = (status or {}).get("load", {})
    for column in columns.aggregated("service"):
        value = service.get(column.record_key)
        row[column.name] = float("nan") if value is None else value
    if status and status.get("message"):
        row["message"] = status["message"]
    return row


def aggregated_columns() -> list[Column]:
    """The columns the summary aggregates from records, in summary.csv's order."""
    return [c for c in columns.COLUMNS if c.aggregate in AGGREGATORS]


def _mean(column: Column, records: list[dict[str, Any]]) -> dict[str, float]:
    present = [r[column.record_key] for r in records if r.get(column.record_key) is not None]
    return {column.name: float(np.mean(present)) if present else float("nan")}


def _mean_ci(column: Column, records: list[dict[str, Any]]) -> dict[str, float]:
    """The mean with its bootstrap CI, where any record measured it (fidelity, asked for by a sweep)."""
    key = column.record_key
    if not any(key in r for r in records):
        return {}
    present = np.array([r[key] for r in records if r.get(key) is not None], dtype=float)
    low, high = bootstrap_ci(present)
    name = column.name
    return {name: float(present.mean()) if len(present) else float("nan"), f"{name}_ci_low": low,
            f"{name}_ci_high": high}


Aggregate = Callable[[Column, list[dict[str, Any]]], dict[str, Any]]


def _extreme(pick: Callable[[list[Any]], Any]) -> Aggregate:
    """The smallest or largest value over the records (a record without it counts as the column's `missing`)."""
    def aggregate(column: Column, records: list[dict[str, Any]]) -> dict[str, Any]:
        key = column.record_key
        values = [r.get(key) or column.missing for r in records] if column.missing is not None else \
            [r[key] for r in records if r.get(key) is not None]
        return {column.name: pick(values) if values else np.nan}
    return aggregate


AGGREGATORS: dict[str, Aggregate] = {"mean": _mean, "mean_ci": _mean_ci, "min": _extreme(min), "max": _extreme(max)}


def param_text(value: Any) -> str:
    """A parameter as text; a `{name: {params}}` mapping (a storage, a stage) as `name(k=v, ...)`."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), dict | None):
        (name, params), = value.items()
        return f"{name}({', '.join(f'{k}={param_text(v)}' for k, v in (params or {}).items())})"
    return str(value)


def _memory_label(memory: dict[str, Any] | None) -> str:
    if memory is None:
        return "-"
    if "pressure" in memory:
        return f"{memory['pressure']:.0%} taken"
    return f"limit {human_bytes(memory['limit_bytes'])}"



def _load_rate(cell: dict[str, Any], status: dict[str, Any] | None) -> float:
    """A load cell's Poisson arrivals, requests/s: a search's, the rate it found (its lowest where none held; NaN
    before it ran); NaN for any other cell."""
    given = (cell.get("load") or {}).get("rate")
    found = ((status or {}).get("load") or {}).get("rate")
    rate = found if given == "auto" else given
    return float("nan") if rate is None else float(rate)


def load_label(load: dict[str, Any] | None) -> str:
    """A load cell's arrivals and pool: `2 req/s, pool 350 KiB`; `-` for any other cell."""
    if load is None:
        return "-"
    arrivals = f"the rate sustained by {load['attainment']:.0%}" if load.get("rate") == "auto" else \
        f"{load['rate']:g} req/s" if "rate" in load else f"{load['users']} users" if "users" in load \
        else f"trace {Path(load['trace']).name}"
    pool = f"pool {load['kv_pool']}" if load["kv_pool"] else f"pool {load['pressure']:.0%} free" \
        if load["pressure"] else "no pool"
    return f"{arrivals}, {pool}"


def _paired_deltas(frame: pd.DataFrame, records: list[dict[str, Any]]) -> None:
    """Score minus `full`'s score on the same samples, with a bootstrap CI of the paired differences; and where
    the cells generate, how long their answers run against `full`'s (`_length_changes`)."""
    reference = {row["_pairing"]: row["_scores"] for _, row in frame.iterrows() if row["policy"] == "full"}
    _length_changes(frame)
    deltas, lows, highs = [], [], []
    for _, row in frame.iterrows():
        base = reference.get(row["_pairing"])
        shared = sorted(set(row["_scores"]) & set(base)) if base else []
        if base is None or not shared or row["policy"] == "full":
            deltas.append(float("nan"))
            lows.append(float("nan"))
            highs.append(float("nan"))
            continue
        diff = np.array([row["_scores"][s] - base[s] for s in shared], dtype=np.float64)
        low, high = bootstrap_ci(diff)
        deltas.append(float(diff.mean()))
        lows.append(low)
        highs.append(high)
    frame["delta_vs_full"], frame["delta_ci_low"], frame["delta_ci_high"] = deltas, lows, highs
    del frame["_pairing"]


def _length_changes(frame: pd.DataFrame) -> None:
    """Where the cells generate, each sample's generated tokens over `full`'s on the same sample (a compressed cache
    can change how long an answer runs, and so its end-to-end latency): their mean `length_ratio`, and the shares of
    samples at least LONGER times as long (`length_longer`) and at most SHORTER times (`length_shorter`)."""
    lengths = {row["_pairing"]: row["_lengths"] for _, row in frame.iterrows() if row["policy"] == "full"}
    ratios = []
    for _, row in frame.iterrows():
        full = lengths.get(row["_pairing"]) or {}
        ratios.append(np.array([tokens / full[s] for s, tokens in row["_lengths"].items() if full.get(s)]))
    del frame["_lengths"]
    if not any(len(r) for r in ratios):
        return
    for name, of in (("length_ratio", np.mean), ("length_longer", lambda r: np.mean(r >= LONGER)),
                     ("length_shorter", lambda r: np.mean(r <= SHORTER))):
        frame[name] = [float(of(r)) if len(r) else float("nan") for r in ratios]


def markdown(frame: pd.DataFrame, manifest: dict[str, Any]) -> str:
    """Readable tables, one per (task, context length, question placement, prefill mode), and per model and dtype
    when the run has several."""
    env = manifest.get("environment", {})
    facets = model_facets(frame)
    if len(facets) > 1:
        models = f"models {', '.join(f'`{label}`' for label, _ in facets)}"
    else:  # the records' model: a one-item `models:` leaves the config's `model` at its default
        models = f"model `{frame['model'].iloc[0] or manifest.get('config', {}).get('model', {}).get('id', '?')}`"
    lines = [f"# {manifest.get('name', 'run')}", "",
             f"{models} on {env.get('device', '?')} "
             f"({env.get('device_name', '')}), kvbench {env.get('kvbench', '?')}, torch {env.get('torch', '?')}, "
             f"transformers {env.get('transformers', '?')}; score = mean over samples [95% bootstrap CI]; "
             "delta = paired change vs `full` on the same samples.", ""]
    for facet, rows in facets:
        lines += _markdown_tables(rows, f"{facet}: " if facet else "")
    return "\n".join(lines)


def _markdown_tables(frame: pd.DataFrame, heading: str) -> list[str]:
    lines = []
    for (task, length, question, prefill), group in frame.groupby(
            ["task", "context_length", "question", "prefill"], sort=False):
        direction = "" if group["higher_is_better"].all() else " (score: lower is better)"
        pressure = (group["memory"] != "-").any()  # memory-pressure cells: say under which condition
        loaded = (group["load"] != "-").any()
        shown = [(c, d) for c, d in view("markdown") if c.name in group
                 and (d.when_above is None or (group[c.name] > d.when_above).any())]
        lines += [f"## {heading}{task}, {length} tokens, question {question}, prefill {prefill}{direction}", "",
                  "| policy | params | budget |" + (" memory |" if pressure else "") + (" load |" if loaded else "")
                  + " n | score | delta vs full | " + "".join(f"{d.heading} | " for _, d in shown).rstrip()
                  + " status |",
                  "|---|---|---|" + ("---|" if pressure else "") + ("---|" if loaded else "") + "---:|---:|---:|"
                  + "---:|" * len(shown) + "---|"]
        for _, r in group.iterrows():
            delta = "" if pd.isna(r["delta_vs_full"]) else \
                f"{r['delta_vs_full']:+.2f} [{r['delta_ci_low']:+.2f}, {r['delta_ci_high']:+.2f}]"
            score = "" if pd.isna(r["score"]) else \
                f"{r['score']:.2f} [{r['score_ci_low']:.2f}, {r['score_ci_high']:.2f}]"
            lines.append(
                f"| {r['policy']} | {r['params']} | {r['budget']} |" + (f" {r['memory']} |" if pressure else "")
                + (f" {r['load']} |" if loaded else "")
                + f" {r['n']} | {score} | {delta} | " + "".join(f"{_cell_text(r, c.name, d)} | " for c, d in shown)
                .rstrip() + f" {r['status']} |")
        if loaded:
            lines += ["", "Under load (kvbench/serving/): ttft and tpot are each request's from its arrival; goodput "
                          "counts the requests per second that met the SLO; n counts the finished requests."]
        if "batch_size" in {c.name for c, _ in shown}:
            lines += ["", "ttft and tpot are each batch's (every sample of a batch waits them); speeds of cells of "
                          "different batch sizes do not compare."]
        lines.append("")
    return lines


def _cell_text(row: pd.Series, name: str, display: Display) -> str:
    """A value as the markdown table shows it; a threshold cell's with its range over the samples, where the
    summary keeps one (each sample keeps its own share)."""
    value = row[name]
    if pd.isna(value):
        return ""
    bounds = spread(name)
    if bounds is None or pd.isna(row["threshold"]):
        return display.text(value)
    return f"{display.text(value)} ({display.text(row[bounds[0]])}-{display.text(row[bounds[1]])})"


def _num(value: float, spec: str) -> str:
    return "" if pd.isna(value) else format(value, spec)
