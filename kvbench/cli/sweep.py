"""`kvbench sweep`, `validate` and `merge`: grids into resumable run folders."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from kvbench.cli.app import PLUGINS, app, progress_bar, stderr, stdout, user_errors
from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    import torch

    from kvbench.config.cells import Cell
    from kvbench.config.schema import SweepConfig
    from kvbench.runs.outcomes import Progress
    from kvbench.runs.run_folder import RunFolder


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
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the grid size and an estimated time (with "
                                 "--executor ray, for --workers N workers); run nothing."),
    force: bool = typer.Option(False, "--force", help="Reuse a folder that holds another config's results "
                               "(cells both configs share are kept)."),
    shard_spec: str | None = typer.Option(None, "--shard", help="Run the i-th of N deterministic slices: 0/4."),
    share: bool = typer.Option(True, "--share/--no-share", help="Share one prompt forward among the cells of a "
                               "sample (default), or run every cell alone."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Samples of a cell decoded together, "
                                          "left-padded (default: the config's batch_size, 1); records are the same, "
                                          "only faster."),
    compile_steps: bool = typer.Option(False, "--compile", help="Compile each static decode step into one graph "
                                       "(torch.compile; CUDA graphs on a GPU), as the config's `compile: true`: "
                                       "faster steps, the same records (docs/running.md)."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Run again the cells recorded as error/oom."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar (for CI logs)."),
    trace: bool = typer.Option(False, "--trace", help="Save each sample's memory time series (NVML on a GPU, "
                               "RSS on CPU) in RUN/traces/<cell>.jsonl."),
    executor: str = typer.Option("local", "--executor", help="local: this process; ray: the workers of a Ray "
                                 "cluster (pip install 'kvbench[ray]'), into the same run folder."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster: auto (the one `ray start` began "
                                       "here) or ray://host:port (default: that, else a new local one)."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Ray workers (default: one per "
                                       "--gpus-per-worker GPUs of the cluster; needed on a cluster without GPUs)."),
    gpus_per_worker: float | None = typer.Option(None, "--gpus-per-worker", min=0, help="GPUs each Ray worker "
                                                 "holds (default 1, or 0 on a cluster without GPUs)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="A line per Ray worker as it starts and ends each "
                                 "unit of work."),
    plugins: str | None = PLUGINS,
) -> None:
    """Run a config's grid into a resumable run folder.

    The grid: policies x budgets x context lengths x tasks (and models, dtypes, question placements)."""
    from kvbench.config.cells import expand, shard
    from kvbench.config.schema import load_config
    from kvbench.registry import load_plugins
    from kvbench.runs.run_folder import RunFolder
    from kvbench.runs.sweep import finished_cells

    on_ray = _check_executor(executor, address=address, workers=workers, gpus_per_worker=gpus_per_worker,
                             verbose=verbose)
    if plugins:
        load_plugins(plugins)
    cfg = _with_batch_size(load_config(config, overrides), batch_size)
    if compile_steps:
        cfg = cfg.model_copy(update={"compile": True})
    cells = shard(expand(cfg), shard_spec)
    folder = RunFolder(output or cfg.output or _default_output(cfg.name, shard_spec))
    if dry_run:
        _dry_run(config, cfg, cells, folder, share, workers if on_ray else None)
        return
    try:
        if folder.path.is_dir():  # a sweep already writing it stops this one before a model loads
            folder.lock()  # (a new folder is locked as it is made, once the model loaded: nothing half-written)
        previous = folder.manifest()
        finished = finished_cells(folder, retry_failed)
        pending = [c for c in cells if c.id not in finished]
        if previous and previous["config_hash"] == cfg.result_hash() and not pending:
            completed = True  # nothing left to run: no need to load a model
        elif on_ray:
            completed = _run_on_ray(cfg, cells, (pending or cells)[0].model, folder, shard_spec, force, quiet, share,
                                    retry_failed, trace, [*([plugins] if plugins else []), *cfg.plugins], address,
                                    workers, gpus_per_worker, verbose)
        else:
            completed = _run_locally(cfg, cells, (pending or cells)[0].model, folder, shard_spec, force, quiet, share,
                                     retry_failed, trace)
        _report(cfg, cells, folder, completed, quiet)
    finally:
        folder.release()  # the run folder's write lock, for the next sweep (in this process too)


def _with_batch_size(cfg: SweepConfig, batch_size: int | None) -> SweepConfig:
    """The config with `--batch-size` in place of its own, when given."""
    if batch_size is None:
        return cfg
    if batch_size < 1:
        raise KvbenchError(f"--batch-size {batch_size}: a batch holds at least 1 sample")
    return cfg.model_copy(update={"batch_size": batch_size})


def _report(cfg: SweepConfig, cells: list[Cell], folder: RunFolder, completed: bool, quiet: bool) -> None:
    """The summary's tables (unless quiet) and where the run folder is; exit 130 if the sweep was interrupted, 1 if it
    failed."""
    from kvbench.analysis.summary import summarize
    from kvbench.runs.sweep import outcome

    frame = summarize(folder.path)
    if not quiet and not frame.empty:
        from kvbench.analysis.summary import model_facets
        from kvbench.analysis.tables import sweep_table

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


def _check_executor(executor: str, **ray_options: object) -> bool:
    """Whether the sweep runs on Ray; an unknown executor, or a Ray option without it, is a one-line error."""
    if executor not in ("local", "ray"):
        raise KvbenchError(f"--executor '{executor}': choose local or ray")
    given = [name for name, value in ray_options.items() if value is not None and value is not False]
    if executor == "local" and given:
        raise KvbenchError(f"--{given[0].replace('_', '-')} is an option of --executor ray")
    if executor == "ray":
        try:
            import ray  # noqa: F401  (here only to say clearly, before any work, that it is missing)
        except ImportError:
            raise KvbenchError("--executor ray needs Ray: pip install 'kvbench[ray]'") from None
    return executor == "ray"


def _dry_run(path: str, cfg, cells, folder, share: bool, workers: int | None) -> None:
    """The grid's size and a rough time: summed, or on `workers` Ray workers taking the longest unit first. Runs
    nothing and needs neither the model's device nor the network: a model's size comes from its local config or a
    built-in shape, and what cannot be known is said."""
    from kvbench.engine.estimate import DTYPE_BYTES, SPEEDS, estimate_seconds, offline_shape, wall_seconds
    from kvbench.engine.models import resolve_dtype
    from kvbench.runs.work import cell_work, work_units

    done = folder.done() if folder.manifest() else set()
    plans, unknown = {}, []
    for model in cfg.model_grid():
        shape = offline_shape(model.id)
        if shape is None or shape.parameters is None:
            unknown.append(model.id)
            continue
        device = planned_device(model.device)
        dtype_bytes = DTYPE_BYTES[str(resolve_dtype(model.dtype, device)).removeprefix("torch.")]
        plans[model.id, model.dtype] = shape, dtype_bytes, SPEEDS[device.type]
    units = work_units(cells, share)
    if unknown:
        estimate = f"unknown: no local config or built-in shape for {', '.join(unknown)}"
    else:
        seconds = [estimate_seconds(cell_work(unit, share, cfg.batch_size), *plans[unit[0].model]) for unit in units]
        total = sum(seconds) if workers is None else wall_seconds(seconds, workers)
        estimate = f"~{total / 60:.1f} min" + ("" if workers is None else f" on {workers} Ray workers")
    speeds = {planned_device(model.device).type for model in cfg.model_grid()}
    assumed = ", ".join(f"{SPEEDS[kind].flops:.1e} FLOP/s and {SPEEDS[kind].bandwidth:.1e} B/s on {kind}"
                        for kind in sorted(speeds))
    units_note = "" if workers is None else f" in {len(units)} units of work"
    work = cell_work(cells, share, cfg.batch_size)
    prompts, tokens = sum(w.prompts for w in work), sum(w.prompts * w.prompt_tokens for w in work)
    steps = sum(w.steps for w in work)
    stdout.print(f"{path}: {len(cells)} cells, {len({c.group for c in cells})} sample groups{units_note}, {len(done)} "
                 f"samples already in {folder.path}; {prompts:,} prompt forwards ({tokens:,} tokens) and "
                 f"{steps:,} decode steps; estimated time {estimate} (a floor from the model's shape: each prompt's "
                 f"FLOPs, each decode step's FLOPs or its reads of the weights and full caches, at {assumed})",
                 highlight=False)
    for line in pool_lines([cell for cell in cells if "load" in cell.description], plans):
        stdout.print(line, highlight=False)


def pool_lines(cells: list[Cell], plans: dict[tuple[str, str], tuple[Any, float, Any]]) -> list[str]:
    """Per load condition, how many requests each policy's cache lets the pool hold at once, from the model's shape
    (its full-attention layers: a sliding window's cap is not counted)."""
    from kvbench.analysis.summary import load_label
    from kvbench.config.cells import cell_task
    from kvbench.engine.estimate import human_bytes
    from kvbench.engine.pool import pool_blocker
    from kvbench.serving import need_tokens, pool_spec

    lines: dict[str, list[str]] = {}
    for cell in cells:
        d = cell.description
        if cell.model not in plans:
            continue
        shape, dtype_bytes, _ = plans[cell.model]
        per_token = shape.bytes_per_token(dtype_bytes)
        prompt, output = cell_task(cell).work(d["context_length"], d["max_new_tokens"])
        need = need_tokens(cell.policy(), cell.settings(), prompt, output, shape.layers)
        where = f"under load, {' '.join(cell.model)}, {prompt}-token prompts, {load_label(d['load'])}"
        if d["load"]["kv_pool"] is None:
            admitted = "its pool is known when it runs"
        else:
            count, unit = pool_spec(d["load"]["kv_pool"])
            pool = count if unit == "bytes" else count * per_token
            largest, held = max(need) * per_token, need.held * per_token
            if pool_blocker(cell.policy()) is None:  # a row each, its prompt prefilled beside the pool
                admitted = f"{int(pool // held)} at once (a row of {human_bytes(held)} each; pool {human_bytes(pool)})"
            else:  # stepping jointly: while one request's prompt is compressed, the others hold what they keep
                fits = 0 if largest > pool else 1 + int((pool - largest) // held)
                admitted = f"{fits} at once ({human_bytes(held)} each, {human_bytes(need.peak * per_token)} while " \
                           f"compressing its prompt; pool {human_bytes(pool)})"
        budget = "" if d["budget"] is None else f" at {d['budget']}"
        lines.setdefault(where, []).append(f"{cell.policy_label}{budget} {admitted}")
    return [f"{where}: " + "; ".join(dict.fromkeys(counts)) for where, counts in lines.items()]


def planned_device(device: str) -> torch.device:
    """The device a config plans for, whether or not this machine has it (a dry run plans, it does not run)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise KvbenchError(f"unknown device '{device}' (use auto, cpu, cuda or cuda:N)") from None


def _run_locally(cfg, cells, first_model, folder, shard_spec, force: bool, quiet: bool, share: bool,
                 retry_failed: bool, trace: bool) -> bool:
    from kvbench.runs.run_folder import environment
    from kvbench.runs.sweep import ModelLoader, manifest, run_sweep

    models = ModelLoader(cfg)
    # the first model to run loads before the run folder is written: a bad model spec stops here, nothing
    # half-written; the sweep reuses it, and loads every other in turn
    lm = models.load(first_model)
    run_manifest = manifest(cfg, cells, lm.describe(), environment(lm.device), shard_spec, {"name": "local"})
    del lm  # the loader holds the only reference, so it can free the model
    return _run(cells, folder, run_manifest, force, quiet, lambda progress: run_sweep(
        models, folder, cells, progress, share=share, retry_failed=retry_failed, trace=trace))


def _run_on_ray(cfg, cells, first_model, folder, shard_spec, force: bool, quiet: bool, share: bool,
                retry_failed: bool, trace: bool, plugin_folders: list[str], address: str | None,
                workers: int | None, gpus_per_worker: float | None, verbose: bool) -> bool:
    from pathlib import Path

    from kvbench.runs import ray_executor
    from kvbench.runs.sweep import manifest

    # the workers import the same plugin folders, wherever their working directory is
    folders = [str(Path(folder_path).resolve()) for folder_path in plugin_folders]
    with ray_executor.cluster(address):
        pool = ray_executor.WorkerPool(cfg, folders, workers, gpus_per_worker)
        try:
            model, machine = pool.describe(first_model)
            run_manifest = manifest(cfg, cells, model, machine, shard_spec, pool.manifest_entry())
            return _run(cells, folder, run_manifest, force, quiet, lambda progress: ray_executor.run_sweep(
                pool, folder, cells, progress, share=share, retry_failed=retry_failed, trace=trace, verbose=verbose))
        finally:
            pool.close()


def _run(cells, folder, run_manifest, force: bool, quiet: bool, run_sweep: Callable[[Progress], bool]) -> bool:
    """Open the run folder and run the sweep with a progress bar; False if interrupted."""
    from kvbench.config.cells import sample_total
    from kvbench.runs.outcomes import Progress
    from kvbench.runs.run_folder import now

    folder.open(run_manifest, force)
    with progress_bar(disable=quiet) as bar:
        cells_bar = bar.add_task("cells", total=len(cells))
        samples_bar = bar.add_task("samples", total=sample_total(cells))

        def update(progress: Progress) -> None:
            bar.update(cells_bar, completed=progress.cells_done, description=progress.model[:28] or "cells")
            bar.update(samples_bar, completed=progress.samples_done, description=progress.current[:28] or "samples")
            while progress.log:
                stderr.print(f"[yellow]cell failed:[/] {escape(progress.log.pop(0))}", highlight=False)
            while progress.notes:
                stderr.print(escape(progress.notes.pop(0)), highlight=False)

        completed = run_sweep(Progress(len(cells), sample_total(cells), update))
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
    from kvbench.config.cells import expand
    from kvbench.config.schema import load_config
    from kvbench.registry import load_plugins

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
    from kvbench.analysis.summary import summarize as write_summary
    from kvbench.runs.run_folder import merge_runs

    merge_runs(output, shards)
    frame = write_summary(output)
    stdout.print(f"{output}: merged {len(shards)} folders, {len(frame)} cells", highlight=False)

