"""Figures of a run folder: score vs cache ratio and vs kv bytes, needle heatmaps, memory vs context,
speed vs budget, and the accuracy/memory Pareto front. Every figure is built from summary rows (or,
for heatmaps, from the records), so what is drawn is what summary.csv says.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from kvbench.analysis.columns import column as declared
from kvbench.analysis.columns import spread
from kvbench.analysis.serving_report import load_figures
from kvbench.analysis.summary import model_facets, param_text, summarize, task_key, task_labels
from kvbench.errors import KvbenchError
from kvbench.policies.budgets import budget_order, budget_suffix, budget_text
from kvbench.runs.run_folder import MANIFEST, RunFolder

# Okabe-Ito, then Paul Tol's muted set: distinguishable with every common colour-vision deficiency. A policy
# declares its own (`Policy.colour`, in its file); a plugin's is picked from them by its name
OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442", "#999999"]
TOL_MUTED = ["#882255", "#332288", "#44AA99", "#117733", "#AA4499", "#DDCC77", "#88CCEE", "#661100"]
# built-in policies whose files do not declare their `colour` yet: one line each there, then gone from here
# variants of one policy (other parameters, a storage) share its colour and differ in marker and line
VARIANT_STYLES = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", "--")]
# `full` is a horizontal reference line, dashed; several of them (one per run compared) differ in their dashes
FULL_LINES = ["--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
STYLES: dict[str, dict[str, Any]] = {
    "default": {"figure.dpi": 110, "font.size": 9},
    # two-column paper: 3.4 in wide columns, fonts that embed as TrueType in PDF
    "paper": {"figure.dpi": 300, "font.size": 7, "axes.titlesize": 7, "axes.labelsize": 7, "legend.fontsize": 6,
              "xtick.labelsize": 6, "ytick.labelsize": 6, "pdf.fonttype": 42, "ps.fonttype": 42,
              "font.family": "DejaVu Sans", "lines.linewidth": 1.0, "lines.markersize": 3},
}
PANEL_SIZE = {"default": (4.2, 3.2), "paper": (3.4, 2.4)}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvbenchError("plotting needs matplotlib: pip install -e '.[plot]' in the kvbench checkout") from None
    return plt


def policy_colour(policy: str) -> str:
    """The same colour for a policy in every figure of every run."""
    from kvbench.policies import POLICIES

    # the class's own: a subclass is another policy (pyramidkv is not snapkv)
    declared = vars(POLICIES.get(policy)).get("colour") if policy in POLICIES.names() else None
    palette = OKABE_ITO + TOL_MUTED
    return declared or palette[zlib.crc32(policy.encode()) % len(palette)]


class XAxis(NamedTuple):
    """What the score curves and the Pareto front put on their x axis: a ratio to full's and its bytes column."""

    ratio: str
    ratio_label: str
    bytes: str
    bytes_label: str
    name: str  # in the figures' names: score_vs_<name>_<task>


# the bytes a cache stores (the default), or the K/V bytes a decode step reads (a sparse policy stores full's)
def _axis(ratio: str, bytes_: str, name: str) -> XAxis:
    return XAxis(ratio, declared(ratio).axis, bytes_, declared(bytes_).axis, name)


X_AXES = {"stored": _axis("cache_ratio", "kv_bytes_live", "ratio"),
          "read": _axis("read_ratio", "kv_bytes_read", "read")}


def x_axis(x: str) -> XAxis:
    if x not in X_AXES:
        raise KvbenchError(f"unknown x axis '{x}' (use {', '.join(X_AXES)})")
    return X_AXES[x]


def _series_label(row: pd.Series) -> str:
    label = f"{row['policy']} ({row['params']})" if row["params"] else row["policy"]
    # threshold cells are a curve of their own: their x is what each threshold achieved, not a budget asked for
    return f"{label} [threshold]" if pd.notna(row.get("threshold", np.nan)) else label


def figures(run: str | Path, style: str = "default", log_x: bool = False, x: str = "stored") -> dict[str, Any]:
    """Name -> matplotlib Figure for every plot the run's data supports; a run over several models or dtypes
    gets each figure once per (model, dtype), named `<figure> <model> (<dtype>)` and titled so. `x`: the curves'
    x axis, the bytes stored (`stored`) or read per decode step (`read`)."""
    axis = x_axis(x)
    plt = _pyplot()
    if style not in STYLES:
        raise KvbenchError(f"unknown style '{style}' (use {', '.join(STYLES)})")
    frame = summarize(run, write=False)
    if frame.empty:
        raise KvbenchError(f"{run}: no records to plot")
    folder = RunFolder(run)
    records, statuses = folder.records(), folder.cells()
    labels = task_labels([r["cell"]["task"] for r in records])
    for record in records:
        record["task_label"] = labels[task_key(record["cell"]["task"])]
    # every figure is handed back open (a set per model and dtype of a grid): matplotlib's count warning is moot
    with plt.rc_context({**STYLES[style], "figure.max_open_warning": 0}):
        facets = model_facets(frame)
        if len(facets) == 1:  # one model: the figures as they always were
            return _figures(plt, frame, records, style, log_x, axis, statuses)
        out: dict[str, Any] = {}
        for facet, rows in facets:
            cells = set(rows["cell_id"])
            for name, figure in _figures(plt, rows, [r for r in records if r["cell_id"] in cells], style,
                                         log_x, axis, statuses).items():
                figure.suptitle(facet, y=1.02)
                out[f"{name} {facet}"] = figure
        return out


def _figures(plt, frame: pd.DataFrame, records: list[dict[str, Any]], style: str, log_x: bool,
             x: XAxis = X_AXES["stored"], statuses: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The figures of one model's summary rows and records (and its cells' `statuses`), the curves against `x`."""
    statuses = statuses or {}
    out: dict[str, Any] = {}
    suffix = "" if x.name == "ratio" else "_read"  # score_vs_ratio / score_vs_read, score_vs_bytes / _read_bytes
    for task, rows in frame.groupby("task", sort=False):
        out[f"score_vs_{x.name}_{task}"] = _score_curves(plt, rows, x.ratio, x.ratio_label, style, log_x)
        out[f"score_vs{suffix}_bytes_{task}"] = _score_curves(plt, rows, x.bytes, x.bytes_label, style, log_x,
                                                              scale=2**-20)
        depth_records = [r for r in records if r["task_label"] == task and "depth" in r.get("meta", {})]
        if depth_records:
            out[f"needle_heatmaps_{task}"] = _needle_heatmaps(plt, depth_records, style)
        nll_records = [r for r in records if r["task_label"] == task and r.get("nll_by_position")]
        if nll_records:
            out[f"nll_vs_position_{task}"] = _nll_curves(plt, nll_records, style)
        if "kl_mean" in rows and rows["kl_mean"].notna().any():  # fidelity to the full cache
            out[f"kl_vs_{x.name}_{task}"] = _score_curves(plt, rows, x.ratio, x.ratio_label, style, log_x,
                                                          y="kl_mean", ylabel=declared("kl_mean").axis)
            out[f"recall_vs_{x.name}_{task}"] = _score_curves(plt, rows, x.ratio, x.ratio_label, style, log_x,
                                                              y="attn_recall", ylabel=declared("attn_recall").axis)
            fidelity = [r for r in records if r["task_label"] == task and r.get("kl_by_position")]
            out[f"kl_vs_position_{task}"] = _nll_curves(plt, fidelity, style, "kl_by_position",
                                                        "KL(full || policy), smoothed", "generated token")
            out[f"recall_by_layer_{task}"] = _recall_by_layer(plt, fidelity, style)
    out.update(load_figures(plt, frame, statuses, lambda count, rows: _panels(plt, count, style, rows),
                            policy_colour, _series_label))
    out["memory_vs_context"] = _memory(plt, frame, style)
    out["speed_vs_budget"] = _speed(plt, frame, style)
    out["pareto" + suffix] = _pareto(plt, frame, style, x)
    return out


def plot_run(run: str | Path, out: str | Path | None = None, fmt: str = "png", style: str = "default",
             log_x: bool = False, x: str = "stored") -> list[Path]:
    """Write every figure of `run` into `out` (default RUN/figures) as `fmt`; returns the paths."""
    if fmt not in ("png", "pdf", "svg"):
        raise KvbenchError(f"unknown format '{fmt}' (use png, pdf or svg)")
    return _save(figures(run, style, log_x, x), Path(out) if out else Path(run) / "figures", fmt, style)


def _file_name(name: str) -> str:
    """`score_vs_ratio_perplexity (mode=exact)` -> `score_vs_ratio_perplexity_mode_exact`"""
    return re.sub(r"[^\w.-]+", "_", name).strip("_")


def runs_inside(folder: str | Path) -> list[Path]:
    """The run folders (those with a manifest.json) directly inside a folder of runs such as `results/`, by name."""
    path = Path(folder)
    runs = sorted(child for child in path.iterdir() if (child / MANIFEST).is_file()) if path.is_dir() else []
    if not runs:
        raise KvbenchError(f"{folder}: not a run folder (no manifest.json) and no run folders inside")
    return runs


def compare_figures(runs: list[Path], style: str = "default", log_x: bool = False, x: str = "stored") -> dict[str, Any]:
    """Score vs cache ratio of every task that two or more of `runs` share on one model and dtype: a curve per
    run and policy, the run named in the legend. Named `compare_<task>` (`compare_<task> <model> (<dtype>)` when
    the runs hold several models). Reads every run's summary first, so a run without records fails them all."""
    axis = x_axis(x)
    plt = _pyplot()
    if style not in STYLES:
        raise KvbenchError(f"unknown style '{style}' (use {', '.join(STYLES)})")
    frames = []
    for run in runs:
        frame = summarize(run, write=False)
        if frame.empty:
            raise KvbenchError(f"{run}: no records to plot")
        frames.append(frame.assign(run=run.name))  # the folder's name: unique, where shards share a config name
    rows = pd.concat(frames, ignore_index=True)
    out: dict[str, Any] = {}
    with plt.rc_context({**STYLES[style], "figure.max_open_warning": 0}):
        for facet, part in model_facets(rows):
            for task, shared in part.groupby("task", sort=False):
                if shared["run"].nunique() < 2:
                    continue
                figure = _score_curves(plt, shared, axis.ratio, axis.ratio_label, style, log_x,
                                       series=_run_series_label)
                figure.suptitle(f"{task}{f', {facet}' if facet else ''}: runs {', '.join(shared['run'].unique())}",
                                y=1.02)
                out[f"compare_{task}{f' {facet}' if facet else ''}"] = figure
    return out


def _run_series_label(row: pd.Series) -> str:
    return f"{row['run']}: {_series_label(row)}"


def plot_folder(folder: str | Path, out: str | Path | None = None, fmt: str = "png", style: str = "default",
                log_x: bool = False, x: str = "stored") -> list[Path]:
    """Every run of a folder of runs drawn as `plot_run` draws it (into RUN/figures, or OUT/<run> with `out`), and
    the comparisons of the runs (`compare_figures`) into FOLDER/figures (or OUT); returns the paths."""
    runs = runs_inside(folder)
    comparisons = compare_figures(runs, style, log_x, x)  # first: a run that cannot be drawn stops all, nothing written
    written = [path for run in runs for path in plot_run(run, Path(out) / run.name if out else None, fmt, style,
                                                         log_x, x)]
    return written + _save(comparisons, Path(out) if out else Path(folder) / "figures", fmt, style)


def _save(drawn: dict[str, Any], target: Path, fmt: str, style: str) -> list[Path]:
    """Write and close each figure of `drawn` into `target` as `fmt`."""
    plt = _pyplot()
    target.mkdir(parents=True, exist_ok=True)
    written = []
    with plt.rc_context(STYLES.get(style, {})):  # font embedding is read when saving, not when drawing
        for name, figure in drawn.items():
            path = target / f"{_file_name(name)}.{fmt}"
            figure.savefig(path, bbox_inches="tight")
            plt.close(figure)
            written.append(path)
    return written


def _panels(plt, count: int, style: str, rows: int = 1):
    columns = -(-count // rows)
    width, height = PANEL_SIZE[style]
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    return figure, axes.ravel()


def _threshold_spread(axis, curve: pd.DataFrame, colour: str) -> None:
    """A threshold curve's points sit at their mean achieved cache ratio: a bar spans the samples' range of it, and
    each point names its threshold."""
    low, high = spread("cache_ratio") or ("cache_ratio", "cache_ratio")
    xs = curve["cache_ratio"].to_numpy(dtype=float)
    bars = [xs - curve[low].to_numpy(dtype=float), curve[high].to_numpy(dtype=float) - xs]
    axis.errorbar(xs, curve["score"], xerr=bars, fmt="none", ecolor=colour, elinewidth=0.8, capsize=2)
    for x, y, threshold in zip(xs, curve["score"], curve["threshold"], strict=True):
        axis.annotate(f"t={threshold:g}", (x, y), textcoords="offset points", xytext=(2, 3), fontsize="xx-small",
                      color=colour)


def _failed_note(axis, rows: pd.DataFrame, series: Callable[[pd.Series], str] = _series_label) -> None:
    """Cells without a score (oom, error, not run) leave a gap; say which, in the panel."""
    missing = rows[rows["score"].isna()]
    if len(missing):
        text = "\n".join(f"{r['status']}: {series(r)} b={r['budget']}" for _, r in missing.iterrows())
        axis.text(0.02, 0.02, text, transform=axis.transAxes, fontsize="x-small", color="#D55E00", va="bottom")


def _score_curves(plt, rows: pd.DataFrame, x: str, xlabel: str, style: str, log_x: bool, scale: float = 1.0,
                  y: str = "score", ylabel: str | None = None, series: Callable[[pd.Series], str] = _series_label):
    """`y` (the score, or a fidelity column with its `_ci_low`/`_ci_high`) against `x`, a curve per `series` label
    (a policy and its parameters; in a comparison of runs, the run too)."""
    if y != "score":
        rows = rows.assign(score=rows[y], score_ci_low=rows[f"{y}_ci_low"], score_ci_high=rows[f"{y}_ci_high"])
    lengths = sorted(rows["context_length"].unique())
    figure, axes = _panels(plt, len(lengths), style)
    for axis, length in zip(axes, lengths, strict=True):
        panel = rows[rows["context_length"] == length]
        variants: dict[str, int] = {}
        for label, curve in panel.groupby(panel.apply(series, axis=1), sort=False):
            policy = curve["policy"].iloc[0]
            colour = policy_colour(policy)
            variant = variants.setdefault(policy, 0)
            marker, line = VARIANT_STYLES[variant % len(VARIANT_STYLES)]
            variants[policy] += 1
            if policy == "full":
                full = curve.iloc[0]
                axis.axhline(full["score"], color=colour, linestyle=FULL_LINES[variant % len(FULL_LINES)],
                             label=label)
                axis.axhspan(full["score_ci_low"], full["score_ci_high"], color=colour, alpha=0.08)
                continue
            curve = curve.sort_values(x)
            xs = curve[x].to_numpy(dtype=float) * scale
            axis.plot(xs, curve["score"], marker=marker, linestyle=line, color=colour, label=label)
            axis.fill_between(xs, curve["score_ci_low"], curve["score_ci_high"], color=colour, alpha=0.15)
            if x == "cache_ratio" and curve["threshold"].notna().all():
                _threshold_spread(axis, curve, colour)
        _failed_note(axis, panel, series)
        axis.set(title=f"{panel['task'].iloc[0]}, {length} tokens", xlabel=xlabel,
                 **(_score_axis(panel) if ylabel is None else {"ylabel": ylabel}))
        if log_x:
            axis.set_xscale("log")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(3, len(labels)),
                  fontsize="small", frameon=False)
    return figure


def _needle_heatmaps(plt, records: list[dict[str, Any]], style: str):
    """Depth x context length, one panel per policy (row) and budget (column), red-yellow-green 0 to 1."""
    frame = pd.DataFrame({
        "policy": [_series_label(pd.Series({"policy": r["cell"]["policy"]["name"], "params": ", ".join(
            f"{k}={param_text(v)}" for k, v in r["cell"]["policy"]["params"].items())})) for r in records],
        "budget": [budget_text(r["cell"]["budget"]) for r in records],
        "depth": [r["meta"]["depth"] for r in records],
        "length": [r["cell"]["context_length"] for r in records],
        "score": [r["scores"]["score"] for r in records],
    })
    policies = sorted(frame["policy"].unique(), key=lambda p: (p != "full", p))
    budgets = sorted(frame["budget"].unique(), key=budget_order)
    budgets = [b for b in budgets if b != "-"] or ["-"]
    depths, lengths = sorted(frame["depth"].unique()), sorted(frame["length"].unique())
    width, height = PANEL_SIZE[style]
    figure, axes = plt.subplots(len(policies), len(budgets), squeeze=False, layout="constrained",
                                figsize=(0.6 * width * len(budgets) + 1, 0.55 * height * len(policies)))
    keeps_all = set(frame.loc[frame["budget"] == "-", "policy"])  # full, compression: one panel, first column
    image = None
    for row, policy in enumerate(policies):
        labelled = False
        for column, budget in enumerate(budgets):
            axis = axes[row, column]
            wanted = "-" if policy in keeps_all else budget
            cell = frame[(frame["policy"] == policy) & (frame["budget"] == wanted)]
            if cell.empty or (policy in keeps_all and column > 0):
                axis.set_visible(False)
                continue
            grid = cell.pivot_table(index="depth", columns="length", values="score", aggfunc="mean")
            values = grid.reindex(index=depths, columns=lengths).to_numpy(dtype=float)
            image = axis.imshow(values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for (i, j), value in np.ndenumerate(values):
                if not np.isnan(value):
                    axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize="x-small")
            axis.set_xticks(range(len(lengths)), [str(v) for v in lengths], fontsize="x-small")
            axis.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize="x-small")
            heading = "" if wanted == "-" else f"b={budget}, "
            axis.set_title(f"{heading}mean {np.nanmean(values):.2f}", fontsize="small")
            if not labelled:  # the row's first panel (a policy with its own budgets may skip columns)
                axis.set_ylabel(f"{policy}\ndepth", fontsize="small")
                labelled = True
            if row == len(policies) - 1:
                axis.set_xlabel("context length", fontsize="small")
    if image is not None:
        figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="score")
    return figure


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Moving average over `window` positions (shorter at the ends)."""
    kernel = np.ones(window)
    return np.convolve(values, kernel, mode="same") / np.convolve(np.ones_like(values), kernel, mode="same")


def _nll_curves(plt, records: list[dict[str, Any]], style: str, key: str = "nll_by_position",
                ylabel: str = "NLL (nats, smoothed)", xlabel: str = "position (tokens)"):
    """A per-position series (a perplexity task's `nll_by_position`, fidelity's `kl_by_position`) vs position,
    mean over samples and smoothed, one line per policy and budget, one panel per context length."""
    lengths = sorted({r["cell"]["context_length"] for r in records})
    figure, axes = _panels(plt, len(lengths), style)
    for axis, length in zip(axes, lengths, strict=True):
        series: dict[tuple[str, str], list[list[float]]] = {}
        for r in records:
            if r["cell"]["context_length"] == length:
                label = (r["cell"]["policy"]["name"], budget_suffix(r["cell"]["budget"]))
                series.setdefault(label, []).append(r[key])
        for (policy, budget), curves in sorted(series.items(), key=lambda item: (item[0][0] != "full", item[0])):
            width = min(len(c) for c in curves)
            mean = np.mean([c[:width] for c in curves], axis=0)
            axis.plot(np.arange(width), smooth(mean, max(1, width // 50)), color=policy_colour(policy),
                      label=f"{policy}{budget}", linestyle="--" if policy == "full" else "-")
        axis.set(title=f"{length} tokens", xlabel=xlabel, ylabel=ylabel)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="x-small")
    figure.tight_layout()
    return figure


def _recall_by_layer(plt, records: list[dict[str, Any]], style: str):
    """Attention recall per layer (columns) for each policy and budget (rows), mean over samples and lengths."""
    rows: dict[str, list[list[float]]] = {}
    for r in records:
        if r.get("attn_recall_by_layer"):
            rows.setdefault(f"{r['cell']['policy']['name']}{budget_suffix(r['cell']['budget'])}", []).append(
                r["attn_recall_by_layer"])
    labels = sorted(rows, key=lambda label: (not label.startswith("full"), label))
    table = np.array([np.mean(rows[label], axis=0) for label in labels])
    width, height = PANEL_SIZE[style]
    figure, axis = plt.subplots(figsize=(width * 1.5, max(height, 0.35 * len(labels) + 1)))
    image = axis.imshow(table, aspect="auto", cmap="RdYlGn", vmin=0, vmax=1)
    axis.set(yticks=range(len(labels)), yticklabels=labels, xlabel="layer", title="attention recall by layer")
    figure.colorbar(image, ax=axis, label="share of full's attention on kept entries")
    figure.tight_layout()
    return figure


def _memory(plt, frame: pd.DataFrame, style: str):
    figure, axes = _panels(plt, 2, style)
    for axis, name in ((axes[0], "kv_bytes_peak"), (axes[1], "mem_peak_alloc")):
        for key, series in frame.groupby([frame.apply(_series_label, axis=1), "budget"], sort=False):
            series = series.sort_values("context_length")
            label = key[0] if key[1] == "-" else f"{key[0]} b={key[1]}"
            axis.plot(series["context_length"], series[name] / 2**20, marker="o",
                      color=policy_colour(series["policy"].iloc[0]), label=label, alpha=0.8)
        axis.set(xlabel="context length (tokens)", ylabel=declared(name).axis)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="x-small", ncol=2)
    figure.tight_layout()
    return figure


def _speed(plt, frame: pd.DataFrame, style: str):
    budgets = sorted(frame["budget"].unique(), key=budget_order)
    figure, axes = _panels(plt, 2, style)
    for axis, measure in ((axes[0], "decode_tok_s"), (axes[1], "ttft_s")):
        for (name, length), series in frame.groupby([frame.apply(_series_label, axis=1), "context_length"],
                                                    sort=False):
            positions = [budgets.index(b) for b in series["budget"]]
            order = np.argsort(positions)
            axis.plot(np.array(positions)[order], series[measure].to_numpy()[order], marker="o",
                      color=policy_colour(series["policy"].iloc[0]), label=f"{name} L={length}", alpha=0.8)
        axis.set_xticks(range(len(budgets)), budgets)
        axis.set(xlabel="budget (tokens, or ratio of the prompt)", ylabel=declared(measure).axis)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="x-small", ncol=2)
    figure.tight_layout()
    return figure


def pareto_front(points: pd.DataFrame, x: str, y: str, higher_is_better: bool = True) -> pd.DataFrame:
    """Rows not beaten by another row with less (or equal) `x` and a better (or equal) `y`."""
    sign = 1 if higher_is_better else -1
    ordered = points.dropna(subset=[x, y]).sort_values([x, y], ascending=[True, not higher_is_better])
    best, keep = -np.inf, []
    for index, row in ordered.iterrows():
        if sign * row[y] > best:
            keep.append(index)
            best = sign * row[y]
    return ordered.loc[keep]


def _score_axis(rows: pd.DataFrame) -> dict[str, Any]:
    """A fraction's axis is [0, 1]; a lower-is-better score (perplexity) or a count (capacity) gets its own."""
    if not rows["higher_is_better"].all():
        return {"ylabel": "perplexity (lower is better)"}
    if rows["score"].max() <= 1 or rows["score"].isna().all():
        return {"ylabel": "score", "ylim": (-0.05, 1.05)}
    return {"ylabel": "score"}


def _pareto(plt, frame: pd.DataFrame, style: str, x: XAxis = X_AXES["stored"]):
    groups = list(frame.groupby(["task", "context_length"], sort=False))
    figure, axes = _panels(plt, len(groups), style)
    for axis, ((task, length), rows) in zip(axes, groups, strict=True):
        rows = rows.assign(kv_mib=rows[x.bytes] / 2**20)
        for _, row in rows.dropna(subset=["score"]).iterrows():
            axis.scatter(row["kv_mib"], row["score"], color=policy_colour(row["policy"]), s=14)
        front = pareto_front(rows, "kv_mib", "score", bool(rows["higher_is_better"].all()))
        axis.step(front["kv_mib"], front["score"], where="post", color="#555555", linewidth=0.8, label="Pareto front")
        for _, row in front.iterrows():
            axis.annotate(f"{row['policy']} {row['budget']}", (row["kv_mib"], row["score"]), fontsize="xx-small",
                          xytext=(2, 2), textcoords="offset points")
        _failed_note(axis, rows)
        axis.set(title=f"{task}, {length} tokens", xlabel=x.bytes_label, **_score_axis(rows))
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="x-small")
    figure.tight_layout()
    return figure
