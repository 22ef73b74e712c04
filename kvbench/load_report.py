"""What a report shows of load cells: goodput and p99 time to first token against the arrival rate, a line per policy
and budget; each rate's timeline of what the service held (running requests, KV pool use, queue); and the rate each
setting sustains at the SLO, in a sentence."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvbench.columns import column as declared

# a rate is sustained when at least this share of its offered requests finished within the SLO
SUSTAINED = 0.9


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
            for (name, budget), series in rows.groupby([rows.apply(label, axis=1), "budget"], sort=False):
                series = series.sort_values("load_rate")
                axis.plot(series["load_rate"], series[measure], marker="o", alpha=0.8,
                          color=colour(series["policy"].iloc[0]), label=name if budget == "-" else f"{name} b={budget}")
            axis.set(xlabel=declared("load_rate").axis, ylabel=declared(measure).axis)
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize="x-small")
        figure.tight_layout()
        out[f"load_vs_rate_{task}"] = figure
        for rate, at_rate in rows.groupby("load_rate", sort=True):
            out[f"load_timeline_{task}_rate_{rate:g}"] = _timeline(at_rate, statuses, panels, colour, label)
    return out


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
    """Per task and setting (policy, parameters, budget) of the load cells, the highest arrival rate at which at
    least `SUSTAINED` of the requests finished within the SLO, with its goodput, p99 TTFT and mean score."""
    loaded = frame[frame["load_rate"].notna()]
    lines = []
    for task, rows in loaded.groupby("task", sort=False):
        for (name, budget), series in rows.groupby([rows.apply(label, axis=1), "budget"], sort=False):
            setting = name if budget == "-" else f"{name} at {budget}"
            held = series[series["slo_attained"] >= SUSTAINED].sort_values("load_rate")
            if held.empty:
                lines.append(f"{task}: {setting} sustains none of the rates run at the SLO (lowest: "
                             f"{series['load_rate'].min():g} req/s).")
                continue
            best = held.iloc[-1]
            lines.append(f"{task}: {setting} sustains {best['load_rate']:g} req/s at the SLO (goodput "
                         f"{best['goodput']:.2f}/s, p99 TTFT {best['ttft_p99']:.2f} s, {best['preemptions']:.0f} "
                         f"preempted, {best['rejected']:.0f} rejected; score {best['score']:.2f}).")
    return lines
