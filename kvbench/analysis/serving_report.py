"""What a report shows of load cells: goodput and p99 time to first token against the arrival rate, a line per policy
and budget; each rate's timeline of what the service held (running requests, KV pool use, queue); and the rate each
setting sustains at the SLO, in a sentence."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.columns import column as declared


def load_figures(plt, frame: pd.DataFrame, statuses: dict[str, dict[str, Any]], panels, colour, label
                 ) -> dict[str, Any]:
    """Name -> figure for the load cells of `frame` (none without them). `statuses`: the cells' final status lines
    (their timelines); `panels(count, rows)` makes a figure's axes, `colour(policy)` and `label(row)` as the other
    figures'."""
    loaded = frame[frame["load_rate"].notna()]
    if loaded.empty:
        return {}
    out: dict[str, Any] = {}
    for task, rows in loaded.groupby("task", sort=False):
        figure, axes = panels(2, 1)
        for axis, measure in ((axes[0], "goodput"), (axes[1], "ttft_p99")):
            spans = []
            for (name, budget), series in rows.groupby([rows.apply(label, axis=1), "budget"], sort=False):
                rates, values = _against_rate(series, statuses, measure)
                spans += rates
                axis.plot(rates, values, marker="o", alpha=0.8, color=colour(series["policy"].iloc[0]),
                          label=name if budget == "-" else f"{name} b={budget}")
            if spans and max(spans) >= 8 * min(spans):  # a search's doublings
                axis.set_xscale("log", base=2)
                axis.xaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set(xlabel=declared("load_rate").axis, ylabel=declared(measure).axis)
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize="x-small")
        figure.tight_layout()
        out[f"load_vs_rate_{task}"] = figure
        for rate, at_rate in rows.groupby("load_rate", sort=True):
            out[f"load_timeline_{task}_rate_{rate:g}"] = _timeline(at_rate, statuses, panels, colour, label)
    return out


def _against_rate(series: pd.DataFrame, statuses: dict[str, dict[str, Any]], measure: str
                  ) -> tuple[list[float], list[float]]:
    """`measure` of one setting's load cells against their rates, in rate order: a cell of a given rate is one point,
    a search (`rates: auto`) every rate it tried."""
    points: dict[float, float] = {}
    for _, row in series.iterrows():
        tried = statuses.get(row["cell_id"], {}).get("load", {}).get("tried") if row["rate_searched"] else None
        points.update({t["rate"]: t[measure] for t in tried} if tried else {row["load_rate"]: row[measure]})
    rates = sorted(points)
    return rates, [np.nan if points[rate] is None else points[rate] for rate in rates]


# what a service monitors, a panel each: the timeline's key, its scale and its axis label
MONITORED = (("running", 1.0, "running requests"), ("pool_bytes", 2**-20, "KV pool used (MiB)"),
             ("queued", 1.0, "queued requests"), ("evictions", 1.0, "entries evicted per step"),
             ("kept_mean", 1.0, "entries kept per layer and head\n(mean over running requests)"))


def _timeline(rows: pd.DataFrame, statuses: dict[str, dict[str, Any]], panels, colour, label):
    """What the service held over one rate's time (`MONITORED`), a line per cell."""
    figure, axes = panels(len(MONITORED), 2)
    for _, row in rows.iterrows():
        steps = statuses.get(row["cell_id"], {}).get("timeline") or []
        if not steps:
            continue
        seconds = np.array([step["t_s"] for step in steps])
        name = label(row) if row["budget"] == "-" else f"{label(row)} b={row['budget']}"
        for axis, (key, scale, _) in zip(axes, MONITORED, strict=False):
            axis.step(seconds, np.array([step[key] for step in steps]) * scale, where="post", alpha=0.8,
                      color=colour(row["policy"]), label=name)
    for axis, (_, _, ylabel) in zip(axes, MONITORED, strict=False):
        axis.set(xlabel="service time (s)", ylabel=ylabel)
        axis.grid(alpha=0.3)
    for axis in axes[len(MONITORED):]:
        axis.set_visible(False)
    pool = rows["pool_bytes"].dropna()
    if not pool.empty:
        axes[1].axhline(float(pool.iloc[0]) / 2**20, color="grey", linestyle="--", label="pool")
    axes[0].legend(fontsize="x-small")
    figure.tight_layout()
    return figure


def sustained_lines(frame: pd.DataFrame, label) -> list[str]:
    """Per task and setting (policy, parameters, budget) of the load cells, the highest arrival rate sustained, the
    rate at which at least the cell's attainment of the requests finished within the SLO (a search's own finding, or
    the highest of the rates run), with its goodput, p99 TTFT and mean score there."""
    loaded = frame[frame["load_rate"].notna()]
    lines = []
    for task, rows in loaded.groupby("task", sort=False):
        for (name, budget), series in rows.groupby([rows.apply(label, axis=1), "budget"], sort=False):
            setting = name if budget == "-" else f"{name} at {budget}"
            searched = series[series["rate_searched"]]
            if not searched.empty:
                found = searched.iloc[0]
                held = searched if pd.notna(found["sustained_rate"]) else searched.iloc[:0]
            else:
                held = series[series["slo_attained"] >= series["load_attainment"]].sort_values("load_rate")
            if held.empty:
                lines.append(f"{task}: {setting} sustains none of the rates run at the SLO (lowest: "
                             f"{series['load_rate'].min():g} req/s).")
                continue
            best = held.iloc[-1]
            bound = "" if not best["rate_searched"] else ", the search's limit" if pd.isna(best["missed_rate"]) \
                else f", not {best['missed_rate']:.3g}"
            rows = "" if pd.isna(best.get("pool_rows")) else f"{best['pool_rows']:.0f} rows of the pool, "
            lines.append(f"{task}: {setting} sustains {best['load_rate']:.3g} req/s at the SLO "
                         f"({best['load_attainment']:.0%} within it{bound}; {rows}"
                         f"goodput {best['goodput']:.2f}/s, p99 TTFT {best['ttft_p99']:.2f} s, "
                         f"{best['preemptions']:.0f} preempted, {best['rejected']:.0f} rejected; score "
                         f"{best['score']:.2f}).")
    return lines
