"""Commands that read run folders: `summarize`, `plot`, `report`, `recommend`, `baseline`, `gate`."""

from __future__ import annotations

from pathlib import Path

import typer

from kvbench.cli.app import app, parse_fraction, run_folder, stderr, stdout, user_errors
from kvbench.errors import KvbenchError


@app.command()
@user_errors
def summarize(
    run: str = typer.Argument(..., help="Run folder."),
    latex: bool = typer.Option(False, "--latex", help="Also write summary.tex (booktabs, best per column in bold)."),
) -> None:
    """Rewrite a run folder's summary from its records.

    The summary: summary.csv and summary.md (and summary.tex with --latex)."""
    from kvbench.analysis.latex import latex as latex_tables
    from kvbench.analysis.summary import summarize as write_summary

    folder = run_folder(run)
    frame = write_summary(folder)
    if latex:
        (folder / "summary.tex").write_text(latex_tables(frame))
    stdout.print(f"{run}: {len(frame)} cells summarized into summary.csv, summary.md"
                 f"{', summary.tex' if latex else ''}", highlight=False)


@app.command()
@user_errors
def plot(
    run: str = typer.Argument(..., help="Run folder, or a folder of run folders (each drawn, and compared)."),
    out: str | None = typer.Option(None, "--out", help="Folder for the figures (default RUN/figures; for a folder "
                                   "of runs, OUT/<run> and the comparisons in OUT, default FOLDER/figures)."),
    fmt: str = typer.Option("png", "--format", help="png, pdf or svg."),
    style: str = typer.Option("default", "--style", help="default, or paper: two-column sizes, fonts that embed."),
    log_x: bool = typer.Option(False, "--log-x", help="Logarithmic cache-ratio / bytes axis."),
    x: str = typer.Option("stored", "--x", help="The curves' x axis: stored (cache ratio, KV bytes held) or read "
                          "(read ratio, K/V bytes read per decode step)."),
) -> None:
    """Draw a run's figures, or compare a folder of runs.

    Score vs cache ratio and bytes, needle heatmaps, memory, speed and the Pareto front; for a folder of runs, each
    run's figures and compare_<task> figures of the runs that share a task and model."""
    from kvbench.analysis.plot import plot_folder, plot_run

    if _is_run(run):
        paths = plot_run(run, out, fmt, style, log_x, x)
        stdout.print(f"{len(paths)} figures in {paths[0].parent}: " + ", ".join(p.name for p in paths),
                     highlight=False)
        return
    paths = plot_folder(run, out, fmt, style, log_x, x)
    compared = [p for p in paths if p.name.startswith("compare_")]
    stdout.print(f"{len(paths) - len(compared)} figures in the runs' folders, {len(compared)} comparisons"
                 + (f" in {compared[0].parent}: " + ", ".join(p.name for p in compared) if compared else ""),
                 highlight=False)


@app.command()
@user_errors
def report(
    run: str = typer.Argument(..., help="Run folder, or a folder of run folders (each reported, and indexed)."),
    max_drop: float = typer.Option(2.0, "--max-drop", min=0, help="Allowed drop (points) for the recommendation."),
) -> None:
    """Write one offline HTML report of a run or a folder of runs.

    RUN/report.html opens with the recommendation, then figures, tables and a failure gallery; for a folder of runs,
    each run's report and FOLDER/report.html indexing and comparing them."""
    from kvbench.analysis.report import html_report, report_folder

    if _is_run(run):
        stdout.print(f"report: {html_report(run, max_drop)}", highlight=False)
        return
    *reports, index = report_folder(run, max_drop)
    stdout.print(f"report: {index}, the index of " + ", ".join(str(p) for p in reports), highlight=False)


def _is_run(path: str) -> bool:
    """A run folder (manifest.json) is drawn and reported as one run; anything else must be a folder of runs."""
    from kvbench.runs.run_folder import MANIFEST

    return (Path(path) / MANIFEST).is_file()


@app.command()
@user_errors
def recommend(
    run: str = typer.Argument(..., help="Run folder."),
    max_drop: float = typer.Option(2.0, "--max-drop", min=0, help="Allowed score drop vs full, in points; the "
                                   "low end of the paired 95% CI must stay within it."),
    max_kl: float | None = typer.Option(None, "--max-kl", min=0, help="Also require a mean KL from the full cache "
                                        "within this (nats per step; cells of a sweep with diagnostics: [fidelity])."),
) -> None:
    """The smallest cache within the allowed drop of full.

    One answer per task and context length (and per model and dtype when the run has several)."""
    from kvbench.analysis.recommend import recommend as pick
    from kvbench.analysis.summary import model_facets
    from kvbench.analysis.summary import summarize as read_summary
    from kvbench.analysis.tables import recommend_table

    # each model and dtype answers for itself: its cells are compared with its own full cache
    for facet, rows in model_facets(read_summary(run_folder(run), write=False)):
        stdout.print(recommend_table(pick(rows, max_drop, max_kl), max_drop, facet))


@app.command()
@user_errors
def baseline(
    run: str = typer.Argument(..., help="Run folder to freeze."),
    out: str = typer.Option(..., "--out", help="Baseline file to write, e.g. baselines/smoke.json."),
) -> None:
    """Freeze a run's per-cell metrics as a baseline for `gate`.

    The metrics: scores per sample, kv peak, speed ratios."""
    from kvbench.analysis.gate import make_baseline

    made = make_baseline(run, out)
    stdout.print(f"{out}: baseline of {len(made['cells'])} cells from {run}", highlight=False)


@app.command(name="gate")
@user_errors
def gate_command(
    run: str = typer.Argument(..., help="Run folder to check."),
    baseline_path: str = typer.Option(..., "--baseline", help="Baseline from `kvbench baseline`."),
    max_drop: float = typer.Option(1.0, "--max-drop", min=0, help="Allowed score drop in points (score x 100); a "
                                   "cell fails only if the 95% CI of its paired change lies wholly below -max-drop."),
    max_mem_increase: str = typer.Option("5%", "--max-mem-increase", help="Allowed growth of kv peak bytes."),
    max_slowdown: str | None = typer.Option(None, "--max-slowdown", help="Allowed fall of decode/prefill tokens/s "
                                            "relative to full in the same run, e.g. 20%; unchecked if not given."),
    strict: bool = typer.Option(False, "--strict", help="Fail on cells missing from the run or the baseline."),
    strict_predictions: bool = typer.Option(False, "--strict-predictions", help="Fail when any prediction changed "
                                            "(deterministic CI on one machine type)."),
    max_kl_increase: float | None = typer.Option(None, "--max-kl-increase", min=0, help="Fail a cell whose mean "
                                                 "KL from the full cache rose by more (nats per step; cells swept "
                                                 "with diagnostics: [fidelity])."),
    require_power: bool = typer.Option(False, "--require-power", help="Exit 2 when a cell's samples cannot detect "
                                       "a drop of --max-drop (pooled checks aside)."),
    junit_path: str | None = typer.Option(None, "--junit", help="Write JUnit XML here."),
    markdown_path: str | None = typer.Option(None, "--markdown", help="Write a Markdown report here."),
) -> None:
    """Check a run against a baseline for regressions.

    Exit 1 on a regression, 2 on bad input, 0 otherwise."""
    from kvbench.analysis.gate import Limits, gate, junit, load_baseline, markdown
    from kvbench.analysis.tables import gate_table

    limits = Limits(max_drop=max_drop, max_mem_increase=parse_fraction(max_mem_increase, "--max-mem-increase"),
                    max_slowdown=None if max_slowdown is None else parse_fraction(max_slowdown, "--max-slowdown"),
                    strict=strict, strict_predictions=strict_predictions, max_kl_increase=max_kl_increase)
    checks = gate(run, load_baseline(baseline_path), limits)
    stdout.print(gate_table(checks, f"kvbench gate: {run} against {baseline_path}"))
    if junit_path:
        Path(junit_path).write_text(junit(checks))
    if markdown_path:
        Path(markdown_path).write_text(markdown(checks))
    failed = [c for c in checks if c.failed]
    stdout.print(f"{len(failed)} of {len(checks)} checks failed" if failed else f"all {len(checks)} checks passed",
                 highlight=False)
    weak = [c for c in checks if c.underpowered]
    if weak:
        message = (f"{len(weak)} of {len(checks)} cells cannot detect a drop of {max_drop:g} points with their "
                   "samples (see 'detects' in the notes; the pooled checks have more power)")
        if require_power:
            raise KvbenchError(message)
        stderr.print(f"warning: {message}", highlight=False)
    if failed:
        raise typer.Exit(1)

