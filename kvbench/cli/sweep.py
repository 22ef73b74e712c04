"""`kvbench sweep`, `validate` and `merge`: grids into resumable run folders."""

from __future__ import annotations

import typer
from rich.markup import escape

from kvbench.cli.app import PLUGINS, app, progress_bar, stderr, stdout, user_errors


def _default_output(name: str, shard_spec: str | None) -> str:
    suffix = "" if not shard_spec else "-shard{}of{}".format(*shard_spec.split("/"))
    return f"results/{name}{suffix}"


@app.command()
@user_errors
def sweep(
    config: str = typer.Argument(..., help="Sweep config (YAML), e.g. configs/smoke.yaml."),
    overrides: list[str] = typer.Option([], "--set", help="Override a config key: --set budgets=[64,128], "
                                        "--set model.dtype=bfloat16; repeatable."),
    output: str | None = typer.Option(None, "--output", "-o", help="Run folder (default: results/<name>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the grid size and an estimated time; run nothing."),
    force: bool = typer.Option(False, "--force", help="Reuse a folder that holds another config's results "
                               "(cells both configs share are kept)."),
    shard_spec: str | None = typer.Option(None, "--shard", help="Run the i-th of N deterministic slices: 0/4."),
    share: bool = typer.Option(True, "--share/--no-share", help="Share one prompt forward among the cells of a "
                               "sample (default), or run every cell alone."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Run again the cells recorded as error/oom."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar (for CI logs)."),
    trace: bool = typer.Option(False, "--trace", help="Save each sample's memory time series (NVML on a GPU, "
                               "RSS on CPU) in RUN/traces/<cell>.jsonl."),
    plugins: str | None = PLUGINS,
) -> None:
    """Run a grid of policies x budgets x context lengths x tasks into a resumable run folder."""
    from kvbench.config import load_config
    from kvbench.models import count_parameters, resolve_device
    from kvbench.registry import load_plugins
    from kvbench.results import RunFolder
    from kvbench.summary import summarize
    from kvbench.sweep import ModelLoader, estimate_seconds, expand, finished_cells, outcome, shard

    if plugins:
        load_plugins(plugins)
    cfg = load_config(config, overrides)
    cells = shard(expand(cfg), shard_spec)
    folder = RunFolder(output or cfg.output or _default_output(cfg.name, shard_spec))
    if dry_run:
        done = folder.done() if folder.manifest() else set()
        seconds = []
        for model in cfg.model_grid():
            parameters = count_parameters(model.id)
            seconds.append(None if parameters is None else estimate_seconds(
                [c for c in cells if c.description["model"] == model.identity()], parameters,
                resolve_device(model.device), share))
        estimate = "unknown" if None in seconds else f"~{sum(seconds) / 60:.1f} min"
        stdout.print(f"{config}: {len(cells)} cells, {len({c.group for c in cells})} sample groups, "
                     f"{len(done)} samples already in {folder.path}; estimated time {estimate} "
                     "(a rough guess from model size: 2 x parameters FLOPs per token)", highlight=False)
        return
    previous = folder.manifest()
    finished = finished_cells(folder, retry_failed)
    pending = [c for c in cells if c.id not in finished]
    if previous and previous["config_hash"] == cfg.result_hash() and not pending:
        completed = True  # nothing left to run: no need to load a model
    else:
        models = ModelLoader(cfg)
        # the first model to run loads before the run folder is written: a bad model spec stops here, nothing
        # half-written; the sweep reuses it, and loads every other in turn
        models.load((pending or cells)[0].model)
        completed = _run(cfg, cells, models, folder, shard_spec, force, quiet, share, retry_failed, trace)
    frame = summarize(folder.path)
    if not quiet and not frame.empty:
        from kvbench.summary import model_facets
        from kvbench.tables import sweep_table

        for facet, rows in model_facets(frame):  # a table per model and dtype, when the grid has several
            stdout.print(sweep_table(rows, f"{cfg.name}, {facet}" if facet else cfg.name))
    stdout.print(f"run folder: {folder.path} (summary.md, summary.csv, records.jsonl)", highlight=False)
    if not completed:
        stderr.print("interrupted: run the same command again to resume")
        raise typer.Exit(130)
    counts, failed = outcome(folder, cells)
    if failed:  # a CI job around the sweep must not pass
        stderr.print("sweep failed: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
                     + " (a cell in error, or none succeeded; --retry-failed runs them again)", highlight=False)
        raise typer.Exit(1)


def _run(cfg, cells, models, folder, shard_spec, force: bool, quiet: bool, share: bool, retry_failed: bool,
         trace: bool) -> bool:
    """Open the run folder and run the sweep with a progress bar; False if interrupted."""
    from kvbench.results import now
    from kvbench.sweep import Progress, manifest, run_sweep, sample_total

    run_manifest = manifest(cfg, cells, models.held, shard_spec)
    folder.open(run_manifest, force)
    with progress_bar(disable=quiet) as bar:
        cells_bar = bar.add_task("cells", total=len(cells))
        samples_bar = bar.add_task("samples", total=sample_total(cells))

        def update(progress: Progress) -> None:
            bar.update(cells_bar, completed=progress.cells_done, description=progress.model[:28] or "cells")
            bar.update(samples_bar, completed=progress.samples_done, description=progress.current[:28] or "samples")
            while progress.log:
                stderr.print(f"[yellow]cell failed:[/] {escape(progress.log.pop(0))}", highlight=False)

        completed = run_sweep(models, folder, cells, Progress(len(cells), sample_total(cells), update), share=share,
                              retry_failed=retry_failed, trace=trace)
    folder.write_manifest({**(folder.manifest() or run_manifest), "finished": now() if completed else None})
    return completed


@app.command()
@user_errors
def validate(
    config: str = typer.Argument(..., help="Sweep config (YAML)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a config key; repeatable."),
    plugins: str | None = PLUGINS,
) -> None:
    """Check a sweep config without running it."""
    from kvbench.config import load_config
    from kvbench.registry import load_plugins
    from kvbench.sweep import expand

    if plugins:
        load_plugins(plugins)
    cfg = load_config(config, overrides)
    stdout.print(f"{config}: ok, {len(expand(cfg))} cells", highlight=False)


@app.command()
@user_errors
def merge(
    output: str = typer.Argument(..., help="Folder to write the merged run into."),
    shards: list[str] = typer.Argument(..., help="Shard run folders (from `sweep --shard i/N`)."),
) -> None:
    """Combine the run folders of a sharded sweep into one."""
    from kvbench.results import merge_runs
    from kvbench.summary import summarize as write_summary

    merge_runs(output, shards)
    frame = write_summary(output)
    stdout.print(f"{output}: merged {len(shards)} folders, {len(frame)} cells", highlight=False)

