"""Terminal tables (rich) of records, summaries, recommendations, gate checks and estimates: what the CLI
prints, rendered here beside the summary code so commands stay short."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich.table import Table

from kvbench.analysis.columns import Display, view
from kvbench.engine.estimate import human_bytes
from kvbench.policies.budgets import budget_text


def summary_table(records: list[dict[str, Any]], model: dict[str, Any]) -> Table:
    """Mean over samples per (context, policy, budget): what `kvbench run` prints."""
    from kvbench.analysis.summary import param_text

    frame = pd.json_normalize(records)
    frame["budget"] = [budget_text(r["budget"]) for r in records]
    frame["label"] = [r["policy"]["name"] + (f"+{param_text(r['policy']['storage'])}" if "storage" in r["policy"]
                                             else "") for r in records]
    groups = frame.groupby(["context_length", "label", "budget"], sort=False)
    table = Table(title=f"{model['spec']} ({model['layers']} layers, {model['kv_heads']} KV heads, "
                  f"{model['dtype']}, {model['device']})")
    shown = view("terminal")
    for column in ("context", "policy", "budget", "n", "score", *(d.heading for _, d in shown)):
        table.add_column(column, justify="left" if column in ("policy", "budget") else "right", no_wrap=True)
    for (length, name, budget), rows in groups:
        mean = rows.mean(numeric_only=True)
        table.add_row(str(length), name, budget, str(len(rows)), f"{mean['scores.score']:.2f}",
                      *(_number(mean, c.name, d) for c, d in shown))
    if not all(r.get("higher_is_better", True) for r in records):
        table.caption = "score: perplexity, lower is better"
    return table


def _number(row: Any, key: str, display: Display, blank: str = "-") -> str:
    """A mean that some tasks do not measure (perplexity has no time to first token): `blank` then."""
    value = row.get(key)
    return blank if value is None or pd.isna(value) else display.text(value)


def sweep_table(frame, title: str) -> Table:
    """The summary of a sweep, one row per cell (summary.md has the same, grouped)."""
    varying = [column for column in ("task", "question", "prefill") if frame[column].nunique() > 1]
    table = Table(title=f"{title}: score = mean [95% bootstrap CI]; delta = paired change vs full")
    shown = view("sweep")
    headings = [d.heading for _, d in shown]
    for column in (*varying, "context", "policy", "budget", "n", "score", "delta", *headings, "status"):
        table.add_column(column, no_wrap=column != "policy", justify="right" if column in (
            "context", "n", *headings) else "left")
    for _, r in frame.iterrows():
        score = "" if pd.isna(r["score"]) else f"{r['score']:.2f} [{r['score_ci_low']:.2f},{r['score_ci_high']:.2f}]"
        delta = "" if pd.isna(r["delta_vs_full"]) else f"{r['delta_vs_full']:+.2f}"
        policy = f"{r['policy']} ({r['params']})" if r["params"] else r["policy"]
        table.add_row(*(str(r[c]) for c in varying), str(r["context_length"]), policy, r["budget"], str(r["n"]),
                      score, delta, *(_number(r, c.name, d, "") for c, d in shown), r["status"])
    return table


def recommend_table(choices, max_drop: float, facet: str = "") -> Table:
    """`kvbench recommend`: the smallest cache within `max_drop` points of full, per task and context (for the
    model and dtype `facet` names, in a run of several)."""
    title = f"smallest cache within {max_drop:g} points of full (95% CI low end)"
    table = Table(title=f"{facet}: {title}" if facet else title)
    for column in ("task", "context", "question", "policy", "budget", "cache ratio", "score (full)", "kv saved",
                   "decode speed vs full", "beneath the mean", "note"):
        table.add_column(column)
    for _, r in choices.iterrows():
        found = r["policy"] is not None and not pd.isna(r["policy"])
        policy = (f"{r['policy']} ({r['params']})" if r.get("params") else r["policy"]) if found else "-"
        table.add_row(
            r["task"], str(r["context_length"]), r["question"], policy, r.get("budget", "") if found else "",
            f"{r['cache_ratio']:.3f}" if found else "", f"{r['score']:.2f} ({r['full_score']:.2f})" if found else "",
            human_bytes(r["kv_saved_bytes"]) if found else "",
            f"{r['decode_speed_vs_full']:.2f}x" if found and not pd.isna(r["decode_speed_vs_full"]) else "",
            r["hidden"] if found else "", r["note"])
    return table


def gate_table(checks: list, title: str) -> Table:
    """`kvbench gate`: one row per cell with its verdict and why."""
    table = Table(title=title)
    from kvbench.analysis.gate import memory_heading

    for column in ("cell", "verdict", "score", "change [95% CI]", memory_heading(), "why"):
        table.add_column(column)
    colour = {"pass": "green", "fail": "bold red", "missing": "yellow", "new": "yellow"}
    for c in checks:
        table.add_row(
            c.label, f"[{colour[c.verdict]}]{c.verdict}[/]",
            "" if c.score is None else f"{c.score[0]:.2f} -> {c.score[1]:.2f}",
            "" if c.delta is None else f"{c.delta[0]:+.1f} [{c.delta[1]:+.1f}, {c.delta[2]:+.1f}]",
            "" if c.memory is None else f"{c.memory[1] / c.memory[0] - 1:+.1%}", "; ".join(c.reasons + c.notes))
    return table


def estimate_table(model: str, shape, rows: list[dict[str, Any]]) -> Table:
    """`kvbench estimate`: KV-cache bytes per setting, with weights and whether it fits."""
    table = Table(title=f"{model}: {shape.layers} layers x {shape.kv_heads} KV heads x head_dim {shape.head_dim}"
                  + ("" if shape.parameters is None else f", {shape.parameters / 1e9:.2f}B parameters"))
    for column in ("context", "batch", "dtype", "budget", "per token", "KV cache", "+ weights", "fits"):
        table.add_column(column, justify="left" if column in ("dtype", "budget") else "right")
    for r in rows:
        total = "?" if r["total_bytes"] is None else human_bytes(r["total_bytes"])
        fits = "" if r["fits"] is None else ("yes" if r["fits"] else "NO")
        table.add_row(str(r["context"]), str(r["batch"]), r["dtype"], "full" if r["budget"] is None else
                      str(r["budget"]), human_bytes(r["bytes_per_token"]), human_bytes(r["cache_bytes"]), total, fits)
    return table


def listing(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A plain table of strings (`kvbench policies`, `kvbench tasks`)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table
