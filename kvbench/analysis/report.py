"""One self-contained HTML report per run, the figures embedded, that opens with what to run; and for a folder of
runs, an index that compares them."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.analysis.columns import Display, view
from kvbench.analysis.gallery import _mark_departure, failure_gallery, gallery_columns, highlight
from kvbench.analysis.html_page import (
    PARAMS_SHOWN,
    SORT_SCRIPT,
    STYLE,
    Column,
    details,
    duration,
    embed,
    figure,
    formatted,
    missing,
    page,
    raw,
    short,
    table,
    text,
    with_ci,
)
from kvbench.analysis.html_page import short as _short
from kvbench.analysis.latex import latex
from kvbench.analysis.recommend import GROUP, SETTING, advice_lines, recommend, scenario_advice, tolerance, worst_change
from kvbench.analysis.summary import model_facets, summarize
from kvbench.engine.estimate import human_bytes
from kvbench.runs.run_folder import RunFolder

# plugins and tests import the names of the recommendation, the gallery, LaTeX and the page's parts from here too
__all__ = [
    "FIGURE_ORDER", "GROUP", "KEY_FIGURES", "PARAMS_SHOWN", "SETTING", "SORT_SCRIPT", "STYLE", "Column",
    "_mark_departure", "_short", "advice_lines", "failure_gallery", "highlight", "html_report", "latex", "recommend",
    "report_folder", "scenario_advice", "tolerance", "worst_change",
]

# the figures that answer "what does compression cost", in this order, open; the rest collapsed below the tables
KEY_FIGURES = ["score_vs_ratio", "score_vs_bytes", "needle_heatmaps", "pareto", "kl_vs_ratio"]
FIGURE_ORDER = [*KEY_FIGURES, "load_vs_rate", "load_timeline",
                "recall_vs_ratio", "nll_vs_position", "kl_vs_position", "recall_by_layer",
                "memory_vs_context", "speed_vs_budget"]


def html_report(run: str | Path, max_drop: float = 2.0) -> Path:
    """RUN/report.html, one offline file that opens with the answer: per task and context length the
    recommendation in a sentence beside the first score-vs-ratio figure, the advice per scenario, then the key
    figures; below them, collapsed, sortable tables (recommendations, every cell, the run), the other figures and
    the failure gallery with the answer highlighted."""
    from kvbench.analysis.plot import figures

    run = Path(run)
    frame = summarize(run)
    manifest = RunFolder(run).manifest() or {}
    images = sorted(embed(figures(run)), key=lambda image: _figure_rank(image[0]))
    lead = next((image for image in images if image[0].startswith("score_vs_ratio")), None)
    rest = [image for image in images if image is not lead]
    key = [image for image in rest if _figure_rank(image[0])[0] < len(KEY_FIGURES)]
    more = "".join(figure(*image) for image in rest if _figure_rank(image[0])[0] >= len(KEY_FIGURES))
    gallery = failure_gallery(run)
    title = f"kvbench report: {manifest.get('name', run.name)}"
    body = [
        f"<h1>{html.escape(title)}</h1>", f"<p class='facts'>{html.escape(_run_line(frame, manifest))}</p>",
        "<section class='answer' id='answer'><div>",
        f"<h2>What to run (the smallest cache within {max_drop:g} points of full at the 95% CI's low end)</h2>",
        *_answer(frame, max_drop), *_advice_section(frame, max_drop), *_load_section(frame), "</div>",
        *([figure(*lead)] if lead else []), "</section>",
        "<h2>Figures</h2>", "<div class='figures'>", *(figure(*image) for image in key), "</div>",
        "<h2>Tables</h2>",
        details(f"Recommendation per task and context length ({len(frame.groupby(GROUP))} groups)",
                table(recommend(frame, max_drop).to_dict("records"), _recommend_columns())),
        details(f"Summary: {len(frame)} cells", table(frame.to_dict("records"), _summary_columns(frame))),
        details("Run", _facts_table(manifest)),
        *([details(f"More figures ({len(rest) - len(key)})", f"<div class='figures'>{more}</div>")] if more else []),
        details(f"Failure gallery: {len(gallery)} samples the full cache got right and a policy lost",
                "<p class='note'>Records keep no whole prompt: the context column shows the part of it that holds "
                "the answer where the task records it (a needle sentence, a dialogue's facts); the reference answer "
                "is <mark>highlighted</mark> there and in both predictions, and <span class='departure'>⟦</span> "
                "marks where the policy's prediction leaves full's.</p>" + table(gallery, gallery_columns())),
    ]
    path = run / "report.html"
    path.write_text(page(title, body), encoding="utf-8")
    return path


def report_folder(folder: str | Path, max_drop: float = 2.0) -> list[Path]:
    """Each run of a folder of runs gets its report (`html_report`), and FOLDER/report.html indexes them: a row per
    run linking its report, each run's recommendations, and the runs compared (`plot.compare_figures`)."""
    from kvbench.analysis.plot import compare_figures, runs_inside

    folder = Path(folder)
    runs = runs_inside(folder)
    comparisons = embed(compare_figures(runs))  # first: a run without records stops all before anything is written
    reports = [html_report(run, max_drop) for run in runs]
    rows, answers = [], []
    for run, report in zip(runs, reports, strict=True):
        frame, manifest = summarize(run, write=False), RunFolder(run).manifest() or {}
        link = f"<a href='{html.escape(report.relative_to(folder).as_posix())}'>{html.escape(run.name)}</a>"
        rows.append({"run": link, "model": ", ".join(label or str(part["model"].iloc[0])
                                                     for label, part in model_facets(frame)),
                     "tasks": ", ".join(frame["task"].unique()), "lengths": ", ".join(
                         str(length) for length in sorted(frame["context_length"].unique())),
                     "cells": len(frame), "not ok": int((frame["status"] != "ok").sum()),
                     "finished": manifest.get("finished") or ""})
        answers.append(details(f"{run.name}: what to run", "".join(_answer(frame, max_drop)), open_=True))
    title = f"kvbench runs in {folder.name or folder}"
    columns = [Column("run", "", lambda r: r["run"]),
               *(Column(name, "", text(name)) for name in ("model", "tasks", "lengths")),
               *(Column(name, "", text(name), raw(name), text=False) for name in ("cells", "not ok")),
               Column("finished", "", text("finished"))]
    body = [f"<h1>{html.escape(title)}</h1>", table(rows, columns),
            "<h2>Runs compared (tasks two or more runs share on one model)</h2>",
            "<div class='figures'>", *(figure(*image) for image in comparisons), "</div>",
            *([] if comparisons else ["<p class='note'>(no task is shared by two runs)</p>"]),
            f"<h2>What to run, per run (within {max_drop:g} points of full)</h2>", *answers]
    index = folder / "report.html"
    index.write_text(page(title, body), encoding="utf-8")
    return [*reports, index]


def _figure_rank(name: str) -> tuple[int, str]:
    return next((i for i, prefix in enumerate(FIGURE_ORDER) if name.startswith(prefix)), len(FIGURE_ORDER)), name


def _run_line(frame: pd.DataFrame, manifest: dict[str, Any]) -> str:
    """`model m on cpu (x86_64), finished 2026-11-29T10:00:00; 13 cells: 12 ok, 1 oom`"""
    env = manifest.get("environment", {})
    models = ", ".join(label or str(part["model"].iloc[0] or manifest.get("model", {}).get("spec", "?"))
                       for label, part in model_facets(frame))
    device = f" on {env.get('device')} ({env.get('device_name')})" if env.get("device") else ""
    when = manifest.get("finished") or manifest.get("started")
    statuses = ", ".join(f"{count} {status}" for status, count in frame["status"].value_counts().items())
    return f"model {models}{device}{f', finished {when}' if when else ''}; {len(frame)} cells: {statuses}"


def _answer(frame: pd.DataFrame, max_drop: float) -> list[str]:
    """The recommendation per task and context length, a sentence each (under a heading per model and dtype in a
    run of several); the question placement and prefill mode are named only where the run varies them."""
    varies = [axis for axis in ("question", "prefill") if frame[axis].nunique() > 1]
    out = []
    for label, part in model_facets(frame):
        if label:
            out.append(f"<h3>{html.escape(label)}</h3>")
        out.append("<ul class='advice'>")
        out += [f"<li>{_sentence(row, varies)}</li>" for row in recommend(part, max_drop).to_dict("records")]
        out.append("</ul>")
    return out


def _sentence(row: dict[str, Any], varies: list[str]) -> str:
    """`niah, 1024 tokens: snapkv at 256 keeps 0.25× of full's KV bytes (768 KiB saved) at 10 ms per token (full:
    9.1 ms); score 1 where full scores 1 (change +0.00, 95% CI [+0.00, +0.00]).`"""
    where = ", ".join(f"{axis} {row[axis]}" for axis in varies)
    head = f"<b>{html.escape(str(row['task']))}, {row['context_length']} tokens</b>" + (
        f" ({html.escape(where)})" if where else "")
    if row.get("policy") is None or pd.isna(row.get("policy")):
        return f"{head}: keep the full cache ({html.escape(row['note'])})."
    params = f" {short(row['params'], '({})')}" if row["params"] else ""
    budget = "" if row["budget"] == "-" else f" at {html.escape(str(row['budget']))}"
    batch = "" if row.get("batch_size", 1) in (1, None) else f" in batches of {row['batch_size']}"
    speed = "" if pd.isna(row["tpot_s"]) else (
        f" at {duration(row['tpot_s'])} per token{batch}" + ("" if missing(row.get("full_tpot_s")) else
                                                             f" (full: {duration(row['full_tpot_s'])})"))
    lower = "" if row["higher_is_better"] else ", lower is better"
    change = "" if pd.isna(row["delta_vs_full"]) else (
        f" (change {row['delta_vs_full']:+.2f}, 95% CI [{row['delta_ci_low']:+.2f}, {row['delta_ci_high']:+.2f}])")
    hidden = f" Beneath the mean: {html.escape(row['hidden'])}." if row.get("hidden") else ""
    return (f"{head}: <b>{html.escape(row['policy'])}</b>{params}{budget} keeps {row['cache_ratio']:.2g}× of full's "
            f"KV bytes ({human_bytes(row['kv_saved_bytes'])} saved){speed}; score {row['score']:.3g} where full "
            f"scores {row['full_score']:.3g}{lower}{change}.{hidden}")


def _advice_section(frame: pd.DataFrame, max_drop: float) -> list[str]:
    lines = [f"{label}: {line}" if label else line for label, part in model_facets(frame)
             for line in advice_lines(scenario_advice(part, max_drop), max_drop)]
    if not lines:
        return []
    return [f"<h3>What to run, by scenario (max drop {max_drop:g} points on every task of the scenario)</h3><ul>",
            *(f"<li>{html.escape(line)}</li>" for line in lines), "</ul>"]


def _load_section(frame: pd.DataFrame) -> list[str]:
    """Under load: the rate each setting sustains at the SLO (kvbench/analysis/serving_report.py)."""
    from kvbench.analysis.plot import _series_label
    from kvbench.analysis.serving_report import sustained_lines

    lines = sustained_lines(frame, _series_label)
    if not lines:
        return []
    return ["<h3>Under load: the highest rate each setting sustains (its share of requests within the SLO)</h3><ul>",
            *(f"<li>{html.escape(line)}</li>" for line in lines), "</ul>"]


def _status(row: dict[str, Any]) -> str:
    message = row.get("message")
    hover = "" if missing(message) else f" title='{html.escape(str(message))}'"
    return f"<span{hover}>{html.escape(str(row['status']))}</span>"


def _summary_columns(frame: pd.DataFrame) -> list[Column]:
    several = len(model_facets(frame)) > 1
    columns = [
        *([Column("model", "model", lambda r: html.escape(f"{r['model']} ({r['dtype']})"))] if several else []),
        Column("task", "task", text("task")), Column("length", "context_length", text("context_length"),
                                                     raw("context_length"), text=False),
        Column("question", "question", text("question")), Column("policy", "policy", text("policy")),
        Column("params", "params", lambda r: short(r["params"]) if r["params"] else ""),
        Column("budget", "budget", text("budget")), Column("n", "n", text("n"), raw("n"), text=False),
        Column("score [95% CI]", "score", with_ci("score", "score_ci_low", "score_ci_high", ".2f"), raw("score"),
               text=False),
        Column("change vs full [95% CI]", "delta_vs_full", with_ci("delta_vs_full", "delta_ci_low", "delta_ci_high",
                                                                   "+.2f"), raw("delta_vs_full"), text=False),
    ]
    # a column the run measured (fidelity only where a sweep asked for it; batch only where one batched)
    columns += [_measure(c.name, d) for c, d in view("html")
                if c.name in frame and (d.when_above is None or (frame[c.name] > d.when_above).any())]
    return [*columns, Column("status", "status", _status)]


def _measure(key: str, display: Display) -> Column:
    return Column(display.heading, key, formatted(key, display.text), raw(key), text=False)


def _recommend_columns() -> list[Column]:
    return [
        Column("task", "task", text("task")), Column("length", "context_length", text("context_length"),
                                                     raw("context_length"), text=False),
        Column("question", "question", text("question")), Column("prefill", "prefill", text("prefill")),
        Column("policy", "policy", lambda r: "-" if missing(r.get("policy")) else html.escape(r["policy"])),
        Column("params", "params", lambda r: short(r["params"]) if isinstance(r.get("params"), str) and r["params"]
               else ""),
        Column("budget", "budget", text("budget")),
        *(_measure(c.name, d) for c, d in view("html") if c.name == "cache_ratio"),
        Column("score (full)", "score", lambda r: "" if missing(r.get("score")) else
               f"{r['score']:.3g} ({r['full_score']:.3g})", raw("score"), text=False),
        Column("change, CI low end", "delta_ci_low", formatted("delta_ci_low", lambda v: f"{v:+.2f}"),
               raw("delta_ci_low"), text=False),
        Column("KV saved", "kv_bytes_live", formatted("kv_saved_bytes", human_bytes), raw("kv_saved_bytes"),
               text=False),
        Column("decode speed vs full", "decode_tok_s", formatted("decode_speed_vs_full", lambda v: f"{v:.2f}×"),
               raw("decode_speed_vs_full"), text=False),
        Column("beneath the mean", "", text("hidden")),
        Column("note", "", text("note")),
    ]


def _facts_table(manifest: dict[str, Any]) -> str:
    env, models = manifest.get("environment", {}), manifest.get("models") or [manifest.get("model", {})]
    model = models[0]
    facts = {"run": manifest.get("name"), "model": ", ".join(str(m.get("spec")) for m in models),
             "architecture": model.get("architecture"),
             "layers / KV heads / head dim": "{} / {} / {}".format(*(model.get(k) for k in ("layers", "kv_heads",
                                                                                         "head_dim"))),
             "dtype": model.get("dtype"), "device": f"{env.get('device')} ({env.get('device_name')})",
             "kvbench": env.get("kvbench"), "git commit": env.get("git_commit"), "torch": env.get("torch"),
             "transformers": env.get("transformers"), "python": env.get("python"),
             "started": manifest.get("started"), "finished": manifest.get("finished")}
    return table([{"fact": key, "value": value} for key, value in facts.items()],
                 [Column("fact", "", text("fact")), Column("value", "", text("value"))])
