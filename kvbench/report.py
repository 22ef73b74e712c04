"""What a run means: the sweet spot per task and length (`recommend`), LaTeX tables, and one
self-contained HTML report with the figures embedded."""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.columns import Display, view
from kvbench.estimate import human_bytes
from kvbench.results import RunFolder
from kvbench.summary import MODEL_AXES, model_facets, summarize

GROUP = [*MODEL_AXES, "task", "context_length", "question", "prefill"]


def recommend(frame: pd.DataFrame, max_drop: float, max_kl: float | None = None) -> pd.DataFrame:
    """Per group, the cell with the smallest cache ratio whose paired change vs `full` stays within
    `max_drop` points even at the low end of its 95% CI (and, with `max_kl`, whose mean KL from the full cache
    stays within it: only cells that measured fidelity qualify); what it saves and what it costs in speed."""
    rows = []
    for key, group in frame.groupby(GROUP, sort=False):
        full = group[group["policy"] == "full"]
        row: dict[str, Any] = dict(zip(GROUP, key, strict=True))
        if full.empty:
            rows.append({**row, "policy": None, "note": "no full cell to compare with"})
            continue
        higher = bool(group["higher_is_better"].all())
        worst = worst_change(group, full.iloc[0]["score"])
        ok = group[(group["policy"] != "full") & (worst >= -max_drop)]
        if max_kl is not None:
            ok = ok[ok["kl_mean"] <= max_kl] if "kl_mean" in ok else ok.iloc[0:0]
        if ok.empty:
            within = tolerance(max_drop, higher) + ("" if max_kl is None else f" and KL {max_kl:g}")
            rows.append({**row, "policy": None, "note": f"none within {within}"})
            continue
        best = ok.sort_values(["cache_ratio", "score"], ascending=[True, not higher]).iloc[0]
        base = full.iloc[0]
        # a batch's tokens/s and times measure the batch: compared only between cells of one batch size
        alike = _batch(best) == _batch(base)
        rows.append({
            **row, "policy": best["policy"], "params": best["params"], "budget": best["budget"],
            "cache_ratio": best["cache_ratio"], "score": best["score"], "full_score": base["score"],
            "delta_ci_low": best["delta_ci_low"], "kv_saved_bytes": base["kv_bytes_live"] - best["kv_bytes_live"],
            "decode_speed_vs_full": best["decode_tok_s"] / base["decode_tok_s"] if alike and base["decode_tok_s"]
            else None,
            "delta_vs_full": best["delta_vs_full"], "delta_ci_high": best["delta_ci_high"],
            "tpot_s": best["tpot_s"], "full_tpot_s": base["tpot_s"] if alike else None, "higher_is_better": higher,
            "batch_size": _batch(best),
            "note": "" if alike else f"speed not compared: batch size {_batch(best)}, full's {_batch(base)}",
        })
    return pd.DataFrame(rows)


def _batch(row: pd.Series) -> int:
    """A summary row's batch size (one for runs from before batching)."""
    size = row.get("batch_size")
    return 1 if size is None or pd.isna(size) else int(size)


def tolerance(max_drop: float, higher_is_better: bool) -> str:
    """`--max-drop` in the unit `worst_change` measures it in: points of a score, or percent of full's value where
    lower is better (perplexity)."""
    return f"{max_drop:g} points" if higher_is_better else f"{max_drop:g}% of full's value"


def worst_change(cells: pd.DataFrame, full_score: float) -> pd.Series:
    """Each cell's paired change against `full` at the worst end of its 95% CI, in points of improvement (a
    fraction's points, or percent of full's perplexity where lower is better; see gate.improvement)."""
    higher = cells["higher_is_better"].astype(bool)
    return (cells["delta_ci_low"] * 100).where(higher, -cells["delta_ci_high"] / full_score * 100)


SETTING = ["policy", "params", "budget"]


def scenario_advice(frame: pd.DataFrame, max_drop: float) -> pd.DataFrame:
    """Per scenario (the workload its tasks stand for, see Task.scenario): the policy setting (policy, params,
    budget) with the smallest mean cache ratio whose paired change against `full` stays within `max_drop` points
    at the low end of its 95% CI on *every* task, length and question placement of the scenario; what it scores
    there against full, its worst change, and the bytes it keeps. Settings that failed anywhere do not qualify."""
    if "scenario" not in frame:
        return pd.DataFrame()
    rows = []
    for scenario, part in frame[frame["scenario"].notna()].groupby("scenario", sort=False):
        row: dict[str, Any] = {"scenario": scenario, "tasks": ", ".join(sorted(part["task"].unique()))}
        fulls = part[(part["policy"] == "full") & part["score"].notna()]
        groups = {key: full for key, full in fulls.groupby(GROUP, sort=False)}
        if not groups:
            rows.append({**row, "policy": None, "note": "no full cell to compare with"})
            continue
        candidates = []
        for setting, cells in part[part["policy"] != "full"].groupby(SETTING, sort=False, dropna=False):
            cells = cells.set_index(GROUP)
            if not all(key in cells.index and pd.notna(cells.loc[[key]]["score"]).all() for key in groups):
                continue
            worst = min(float(worst_change(cells.loc[[key]], groups[key].iloc[0]["score"]).min()) for key in groups)
            candidates.append((setting, worst, cells.loc[list(groups)]))
        passing = [c for c in candidates if c[1] >= -max_drop]
        if not passing:
            best = max(candidates, key=lambda c: c[1], default=None)
            note = f"none within {max_drop:g} points" + (
                "" if best is None else f"; closest: {_setting(best[0])} ({best[1]:+.1f})")
            rows.append({**row, "policy": None, "note": note})
            continue
        setting, worst, cells = min(passing, key=lambda c: (c[2]["cache_ratio"].mean(), -c[1]))
        rows.append({**row, **dict(zip(SETTING, setting, strict=True)), "cache_ratio": cells["cache_ratio"].mean(),
                     "score": cells["score"].mean(), "full_score": fulls["score"].mean(), "worst_change": worst,
                     "note": ""})
    return pd.DataFrame(rows)


def advice_lines(advice: pd.DataFrame, max_drop: float) -> list[str]:
    """The per-scenario recommendation as sentences (the report opens with them)."""
    lines = []
    for row in advice.to_dict("records"):
        head = f"{row['scenario']} ({row['tasks']})"
        if row.get("policy") is None or pd.isna(row.get("policy")):
            lines.append(f"{head}: {row['note']}; keep the full cache.")
            continue
        lines.append(f"{head}: {_setting((row['policy'], row['params'], row['budget']))} scores {row['score']:.3g} "
                     f"where full scores {row['full_score']:.3g} (worst paired change {row['worst_change']:+.1f} "
                     f"points at the CI's low end, within {max_drop:g}) in {row['cache_ratio']:.2f} of the KV bytes.")
    return lines


def _setting(setting: tuple[str, str, str]) -> str:
    """`snapkv(window=32) at 0.25` (summary rows hold params as text and budget as text, "-" for none)."""
    policy, params, budget = setting
    return f"{policy}{f'({params})' if params else ''}{'' if budget == '-' else f' at {budget}'}"


def latex(frame: pd.DataFrame) -> str:
    """booktabs tables, one per group; the best value of each column in bold."""
    columns = [(c.name, d, max if c.better == "higher" else min) for c, d in view("latex")]
    out = []
    for key, group in frame.groupby(GROUP, sort=False):
        flip = {max: min} if not group["higher_is_better"].all() else {}  # perplexity: lower wins
        best = {c: flip.get(pick, pick)(group[c].dropna()) for c, _, pick in columns if group[c].notna().any()}
        lines = [r"\begin{table}[t]", r"\centering", r"\small",
                 r"\begin{tabular}{ll" + "r" * len(columns) + "}", r"\toprule",
                 "policy & budget & " + " & ".join(d.heading for _, d, _ in columns) + r" \\", r"\midrule"]
        for _, row in group.iterrows():
            cells = []
            for column, display, _ in columns:
                value = row[column]
                text = "--" if pd.isna(value) else display.text(value)
                cells.append(rf"\textbf{{{text}}}" if column in best and value == best[column] else text)
            name = _tex(row["policy"] + (f" ({row['params']})" if row["params"] else ""))
            lines.append(f"{name} & {_tex(row['budget'])} & " + " & ".join(cells) + r" \\")
        model, dtype, task, length, question, prefill = key
        several = frame[MODEL_AXES].drop_duplicates().shape[0] > 1  # name the model only when the run has several
        where = f"{_tex(model)} ({dtype}), " if several else ""
        lines += [r"\bottomrule", r"\end{tabular}",
                  rf"\caption{{{where}{_tex(task)}, {length} tokens, question {question}, prefill {prefill}.}}",
                  r"\end{table}", ""]
        out.append("\n".join(lines))
    return "\n".join(out)


def _tex(text: str) -> str:
    return str(text).replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")


def failure_gallery(run: str | Path, limit: int = 40) -> list[dict[str, Any]]:
    """Samples where a policy lost points that `full` kept on the same sample: prediction beside reference."""
    records = RunFolder(run).records()
    keep = ("model", "task", "context_length", "question", "prefill", "samples", "seed")
    full = {(repr([r["cell"][k] for k in keep]), r["sample_id"]): r for r in records
            if r["cell"]["policy"]["name"] == "full"}
    lost = []
    for record in records:
        reference = full.get((repr([record["cell"][k] for k in keep]), record["sample_id"]))
        sign = 1 if record.get("higher_is_better", True) else -1
        if reference and record["cell"]["policy"]["name"] != "full" and \
                sign * record["scores"]["score"] < sign * reference["scores"]["score"]:
            lost.append({"policy": record["cell"]["policy"]["name"], "budget": record["cell"]["budget"],
                         "context_length": record["cell"]["context_length"], "sample": record["sample_id"],
                         "prediction": _mark_departure(record["prediction"], reference["prediction"]),
                         "full_prediction": reference["prediction"], "references": record["references"],
                         "context": _context_span(record.get("meta", {})),
                         **({"first_divergence": record["first_divergence"]} if "first_divergence" in record
                            else {})})
    return lost[:limit]


def _context_span(meta: dict[str, Any]) -> str | None:
    """The part of the prompt that holds the answer, where a record keeps it: a needle task's needle sentence, a
    dialogue's stated facts (records keep no whole prompt)."""
    if meta.get("needle"):
        return str(meta["needle"])
    facts = [fact["statement"] for fact in meta.get("facts", []) if isinstance(fact, dict) and "statement" in fact]
    return " ".join(facts) or None


def _mark_departure(prediction: str, full: str) -> str:
    """The prediction with `⟦` where it leaves the full cache's (nothing if it never does)."""
    at = next((i for i, (a, b) in enumerate(zip(prediction, full, strict=False)) if a != b),
              None if len(prediction) == len(full) else min(len(prediction), len(full)))
    return prediction if at is None else f"{prediction[:at]}⟦{prediction[at:]}"


# the figures that answer "what does compression cost", in this order, open; the rest collapsed below the tables
KEY_FIGURES = ["score_vs_ratio", "score_vs_bytes", "needle_heatmaps", "pareto", "kl_vs_ratio"]
FIGURE_ORDER = [*KEY_FIGURES, "recall_vs_ratio", "nll_vs_position", "kl_vs_position", "recall_by_layer",
                "memory_vs_context", "speed_vs_budget"]
PARAMS_SHOWN = 24  # characters of a policy's parameters shown in a table; the rest on hover

STYLE = """
body{font-family:system-ui,sans-serif;margin:1em auto;padding:0 1em;max-width:1360px;color:#222;line-height:1.4}
h1{font-size:1.5em;margin:0.2em 0}h2{font-size:1.2em;margin:0.8em 0 0.4em}h3{font-size:1em;margin:0.6em 0 0.2em}
.facts{color:#555;margin:0 0 0.6em}.note{color:#555;font-size:13px}
.answer{display:grid;grid-template-columns:minmax(0,5fr) minmax(0,6fr);gap:1.5em;align-items:start}
.answer ul{margin:0.2em 0;padding-left:1.2em}.answer li{margin:0.25em 0}
@media (max-width:900px){.answer{grid-template-columns:minmax(0,1fr)}}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em}
figure{margin:0}figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:12px;color:#555}
details{margin:0.4em 0;border:1px solid #ddd;border-radius:4px;padding:0.3em 0.6em}
summary{cursor:pointer;font-weight:600}details[open] summary{margin-bottom:0.4em}
table{border-collapse:collapse;font-size:13px;margin:0.4em 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right;vertical-align:top}
td.text,th.text{text-align:left}th{background:#f3f3f3;cursor:pointer;user-select:none;white-space:nowrap}
th[data-order=asc]::after{content:" \\25B2"}th[data-order=desc]::after{content:" \\25BC"}
tbody tr:nth-child(even){background:#fafafa}mark{background:#ffe066;padding:0 1px}
.departure{color:#D55E00;font-weight:700}span[title]{text-decoration:underline dotted}
"""
# click a heading to sort by it (again: the other way); numbers by data-sort, text as text, blanks last
SORT_SCRIPT = """
for (const table of document.querySelectorAll("table.sortable")) {
  for (const heading of table.tHead.rows[0].cells) {
    heading.addEventListener("click", () => {
      const ascending = heading.dataset.order !== "asc", column = heading.cellIndex;
      for (const other of heading.parentNode.cells) delete other.dataset.order;
      heading.dataset.order = ascending ? "asc" : "desc";
      const key = row => row.cells[column].dataset.sort ?? row.cells[column].textContent.trim();
      const rows = [...table.tBodies[0].rows].sort((a, b) => {
        const x = key(a), y = key(b);
        if (x === "" || y === "") return (x === "") - (y === "");
        const order = isNaN(x) || isNaN(y) ? x.localeCompare(y, undefined, {numeric: true}) : x - y;
        return ascending ? order : -order;
      });
      table.tBodies[0].append(...rows);
    });
  }
}
"""


def html_report(run: str | Path, max_drop: float = 2.0) -> Path:
    """RUN/report.html, one offline file that opens with the answer: per task and context length the
    recommendation in a sentence beside the first score-vs-ratio figure, the advice per scenario, then the key
    figures; below them, collapsed, sortable tables (recommendations, every cell, the run), the other figures and
    the failure gallery with the answer highlighted."""
    from kvbench.plot import figures

    run = Path(run)
    frame = summarize(run)
    manifest = RunFolder(run).manifest() or {}
    images = sorted(_embed(figures(run)), key=lambda image: _figure_rank(image[0]))
    lead = next((image for image in images if image[0].startswith("score_vs_ratio")), None)
    rest = [image for image in images if image is not lead]
    key = [image for image in rest if _figure_rank(image[0])[0] < len(KEY_FIGURES)]
    more = "".join(_figure(*image) for image in rest if _figure_rank(image[0])[0] >= len(KEY_FIGURES))
    gallery = failure_gallery(run)
    title = f"kvbench report: {manifest.get('name', run.name)}"
    body = [
        f"<h1>{html.escape(title)}</h1>", f"<p class='facts'>{html.escape(_run_line(frame, manifest))}</p>",
        "<section class='answer' id='answer'><div>",
        f"<h2>What to run (the smallest cache within {max_drop:g} points of full at the 95% CI's low end)</h2>",
        *_answer(frame, max_drop), *_advice_section(frame, max_drop), "</div>",
        *([_figure(*lead)] if lead else []), "</section>",
        "<h2>Figures</h2>", "<div class='figures'>", *(_figure(*image) for image in key), "</div>",
        "<h2>Tables</h2>",
        _details(f"Recommendation per task and context length ({len(frame.groupby(GROUP))} groups)",
                 _table(recommend(frame, max_drop).to_dict("records"), _recommend_columns())),
        _details(f"Summary: {len(frame)} cells", _table(frame.to_dict("records"), _summary_columns(frame))),
        _details("Run", _facts_table(manifest)),
        *([_details(f"More figures ({len(rest) - len(key)})", f"<div class='figures'>{more}</div>")] if more else []),
        _details(f"Failure gallery: {len(gallery)} samples the full cache got right and a policy lost",
                 "<p class='note'>Records keep no whole prompt: the context column shows the part of it that holds "
                 "the answer where the task records it (a needle sentence, a dialogue's facts); the reference answer "
                 "is <mark>highlighted</mark> there and in both predictions, and <span class='departure'>⟦</span> "
                 "marks where the policy's prediction leaves full's.</p>" + _table(gallery, _gallery_columns())),
    ]
    path = run / "report.html"
    path.write_text(_page(title, body), encoding="utf-8")
    return path


def report_folder(folder: str | Path, max_drop: float = 2.0) -> list[Path]:
    """Each run of a folder of runs gets its report (`html_report`), and FOLDER/report.html indexes them: a row per
    run linking its report, each run's recommendations, and the runs compared (`plot.compare_figures`)."""
    from kvbench.plot import compare_figures, runs_inside

    folder = Path(folder)
    runs = runs_inside(folder)
    comparisons = _embed(compare_figures(runs))  # first: a run without records stops all before anything is written
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
        answers.append(_details(f"{run.name}: what to run", "".join(_answer(frame, max_drop)), open_=True))
    title = f"kvbench runs in {folder.name or folder}"
    columns = [Column("run", "", lambda r: r["run"]),
               *(Column(name, "", _text(name)) for name in ("model", "tasks", "lengths")),
               *(Column(name, "", _text(name), _raw(name), text=False) for name in ("cells", "not ok")),
               Column("finished", "", _text("finished"))]
    body = [f"<h1>{html.escape(title)}</h1>", _table(rows, columns),
            "<h2>Runs compared (tasks two or more runs share on one model)</h2>",
            "<div class='figures'>", *(_figure(*image) for image in comparisons), "</div>",
            *([] if comparisons else ["<p class='note'>(no task is shared by two runs)</p>"]),
            f"<h2>What to run, per run (within {max_drop:g} points of full)</h2>", *answers]
    index = folder / "report.html"
    index.write_text(_page(title, body), encoding="utf-8")
    return [*reports, index]


def _embed(drawn: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, base64 PNG) per figure, each closed once drawn: the page carries its images as data: URIs."""
    from kvbench.plot import _pyplot

    plt = _pyplot()
    images = []
    for name, figure in drawn.items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        plt.close(figure)
        images.append((name, base64.b64encode(buffer.getvalue()).decode()))
    return images


def _figure_rank(name: str) -> tuple[int, str]:
    return next((i for i, prefix in enumerate(FIGURE_ORDER) if name.startswith(prefix)), len(FIGURE_ORDER)), name


def _figure(name: str, data: str) -> str:
    label = html.escape(name)
    return f"<figure><img alt='{label}' src='data:image/png;base64,{data}'><figcaption>{label}</figcaption></figure>"


def _page(title: str, body: list[str]) -> str:
    return "\n".join(["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
                      f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>", *body,
                      f"<script>{SORT_SCRIPT}</script></body></html>"])


def _details(summary: str, content: str, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{html.escape(summary)}</summary>{content}</details>"


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
    params = f" {_short(row['params'], '({})')}" if row["params"] else ""
    budget = "" if row["budget"] == "-" else f" at {html.escape(str(row['budget']))}"
    batch = "" if row.get("batch_size", 1) in (1, None) else f" in batches of {row['batch_size']}"
    speed = "" if pd.isna(row["tpot_s"]) else (
        f" at {_duration(row['tpot_s'])} per token{batch}" + ("" if _missing(row.get("full_tpot_s")) else
                                                             f" (full: {_duration(row['full_tpot_s'])})"))
    lower = "" if row["higher_is_better"] else ", lower is better"
    change = "" if pd.isna(row["delta_vs_full"]) else (
        f" (change {row['delta_vs_full']:+.2f}, 95% CI [{row['delta_ci_low']:+.2f}, {row['delta_ci_high']:+.2f}])")
    return (f"{head}: <b>{html.escape(row['policy'])}</b>{params}{budget} keeps {row['cache_ratio']:.2g}× of full's "
            f"KV bytes ({human_bytes(row['kv_saved_bytes'])} saved){speed}; score {row['score']:.3g} where full "
            f"scores {row['full_score']:.3g}{lower}{change}.")


def _advice_section(frame: pd.DataFrame, max_drop: float) -> list[str]:
    lines = [f"{label}: {line}" if label else line for label, part in model_facets(frame)
             for line in advice_lines(scenario_advice(part, max_drop), max_drop)]
    if not lines:
        return []
    return [f"<h3>What to run, by scenario (max drop {max_drop:g} points on every task of the scenario)</h3><ul>",
            *(f"<li>{html.escape(line)}</li>" for line in lines), "</ul>"]


@dataclass(frozen=True)
class Column:
    """A table column: its heading, the summary.csv column it comes from (the heading's hover text), the cell's
    HTML from a row, the value it sorts by (None: the cell's text), and whether it reads as text (left-aligned)."""

    title: str
    source: str
    show: Callable[[dict[str, Any]], str]
    sort: Callable[[dict[str, Any]], Any] | None = None
    text: bool = True


def _table(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    """A sortable table (see SORT_SCRIPT); "(none)" for no rows."""
    if not rows:
        return "<p>(none)</p>"

    def align(column: Column) -> str:
        return " class='text'" if column.text else ""

    head = "".join(f"<th{align(c)}{_title(c.source)}>{html.escape(c.title)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for column in columns:
            sort = "" if column.sort is None else f" data-sort='{_sort_value(column.sort(row))}'"
            cells.append(f"<td{align(column)}{sort}>{column.show(row)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class='sortable'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _title(source: str) -> str:
    return f" title='summary.csv: {html.escape(source)}'" if source else ""


def _sort_value(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and pd.isna(value)) else html.escape(str(value))


def _missing(value: Any) -> bool:
    return value is None or (not isinstance(value, (list, dict, str)) and pd.isna(value))


def _text(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: "" if _missing(row.get(key)) else html.escape(str(row[key]))


def _raw(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: row.get(key)


def _formatted(key: str, form: Callable[[Any], str]) -> Callable[[dict[str, Any]], str]:
    return lambda row: "" if _missing(row.get(key)) else html.escape(form(row[key]))


def _short(text: str, frame: str = "{}") -> str:
    """Parameters cut to PARAMS_SHOWN characters, all of them on hover."""
    shown = text if len(text) <= PARAMS_SHOWN else text[:PARAMS_SHOWN - 1] + "…"
    hover = f" title='{html.escape(text)}'" if shown != text else ""
    return f"<span{hover}>{html.escape(frame.format(shown))}</span>"


def _duration(seconds: float) -> str:
    """`57.7 ms`, `4.73 s`"""
    return Display("", "duration").text(seconds)


def _with_ci(key: str, low: str, high: str, spec: str) -> Callable[[dict[str, Any]], str]:
    """`0.33 [0.00, 0.67]`"""
    def show(row: dict[str, Any]) -> str:
        if _missing(row.get(key)):
            return ""
        return f"{row[key]:{spec}} [{row[low]:{spec}}, {row[high]:{spec}}]"
    return show


def _status(row: dict[str, Any]) -> str:
    message = row.get("message")
    hover = "" if _missing(message) else f" title='{html.escape(str(message))}'"
    return f"<span{hover}>{html.escape(str(row['status']))}</span>"


def _summary_columns(frame: pd.DataFrame) -> list[Column]:
    several = len(model_facets(frame)) > 1
    columns = [
        *([Column("model", "model", lambda r: html.escape(f"{r['model']} ({r['dtype']})"))] if several else []),
        Column("task", "task", _text("task")), Column("length", "context_length", _text("context_length"),
                                                      _raw("context_length"), text=False),
        Column("question", "question", _text("question")), Column("policy", "policy", _text("policy")),
        Column("params", "params", lambda r: _short(r["params"]) if r["params"] else ""),
        Column("budget", "budget", _text("budget")), Column("n", "n", _text("n"), _raw("n"), text=False),
        Column("score [95% CI]", "score", _with_ci("score", "score_ci_low", "score_ci_high", ".2f"), _raw("score"),
               text=False),
        Column("change vs full [95% CI]", "delta_vs_full", _with_ci("delta_vs_full", "delta_ci_low", "delta_ci_high",
                                                                    "+.2f"), _raw("delta_vs_full"), text=False),
    ]
    # a column the run measured (fidelity only where a sweep asked for it; batch only where one batched)
    columns += [_measure(c.name, d) for c, d in view("html")
                if c.name in frame and (d.when_above is None or (frame[c.name] > d.when_above).any())]
    return [*columns, Column("status", "status", _status)]


def _measure(key: str, display: Display) -> Column:
    return Column(display.heading, key, _formatted(key, display.text), _raw(key), text=False)


def _recommend_columns() -> list[Column]:
    return [
        Column("task", "task", _text("task")), Column("length", "context_length", _text("context_length"),
                                                      _raw("context_length"), text=False),
        Column("question", "question", _text("question")), Column("prefill", "prefill", _text("prefill")),
        Column("policy", "policy", lambda r: "-" if _missing(r.get("policy")) else html.escape(r["policy"])),
        Column("params", "params", lambda r: _short(r["params"]) if isinstance(r.get("params"), str) and r["params"]
               else ""),
        Column("budget", "budget", _text("budget")),
        *(_measure(c.name, d) for c, d in view("html") if c.name == "cache_ratio"),
        Column("score (full)", "score", lambda r: "" if _missing(r.get("score")) else
               f"{r['score']:.3g} ({r['full_score']:.3g})", _raw("score"), text=False),
        Column("change, CI low end", "delta_ci_low", _formatted("delta_ci_low", lambda v: f"{v:+.2f}"),
               _raw("delta_ci_low"), text=False),
        Column("KV saved", "kv_bytes_live", _formatted("kv_saved_bytes", human_bytes), _raw("kv_saved_bytes"),
               text=False),
        Column("decode speed vs full", "decode_tok_s", _formatted("decode_speed_vs_full", lambda v: f"{v:.2f}×"),
               _raw("decode_speed_vs_full"), text=False),
        Column("note", "", _text("note")),
    ]


def _gallery_columns() -> list[Column]:
    def marked(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda row: "" if _missing(row.get(key)) else highlight(str(row[key]), row["references"])

    return [Column("policy", "", _text("policy")), Column("budget", "", _text("budget")),
            Column("length", "", _text("context_length"), _raw("context_length"), text=False),
            Column("sample", "", _text("sample")),
            Column("answer", "", lambda r: html.escape(" | ".join(map(str, r["references"])))),
            Column("context (where the answer sits)", "", marked("context")),
            Column("prediction", "", marked("prediction")), Column("full's prediction", "", marked("full_prediction"))]


def highlight(text: str, answers: list[str]) -> str:
    """`text` as HTML with each occurrence of a reference answer in <mark> (case-insensitive), and the gallery's
    departure marker `⟦` (see _mark_departure) set off."""
    found = sorted({str(a) for a in answers if str(a).strip()}, key=len, reverse=True)  # the longest match first
    pattern = re.compile("|".join(map(re.escape, found)), re.IGNORECASE) if found else None
    out = []
    for index, piece in enumerate(text.split("⟦")):
        if index:
            out.append("<span class='departure' title='leaves the full cache&#39;s prediction here'>⟦</span>")
        at = 0
        for match in pattern.finditer(piece) if pattern else ():
            out.append(html.escape(piece[at:match.start()]) + f"<mark>{html.escape(match.group())}</mark>")
            at = match.end()
        out.append(html.escape(piece[at:]))
    return "".join(out)


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
    return _table([{"fact": key, "value": value} for key, value in facts.items()],
                  [Column("fact", "", _text("fact")), Column("value", "", _text("value"))])
