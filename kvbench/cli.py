"""The `kvbench` command line."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.estimate import human_bytes
from kvbench.registry import first_line

app = typer.Typer(
    help="Benchmark KV-cache eviction and compression policies: quality, speed and measured memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
stdout = Console(width=max(Console().width, 110))
stderr = Console(stderr=True)
PLUGINS = typer.Option(None, "--plugins", help="Folder of extra policy/task files to load.")


def user_errors(command: Callable) -> Callable:
    """Bad input ends in one line naming the culprit and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KvbenchError as exc:
            stderr.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvbench {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    logging.basicConfig(format="kvbench: %(message)s", level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def parse_assignments(items: list[str], option: str) -> dict[str, Any]:
    """`k=v` pairs; values are read as YAML scalars or lists (`4`, `0.5`, `max`, `[0.1,0.5]`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KvbenchError(f"{option} '{item}' is not of the form key=value")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise KvbenchError(f"{option} '{item}': the value is not valid YAML") from None
    return out


def parse_budget(text: str) -> int | float:
    """`128` (tokens per layer and KV head) or `0.25` (a ratio of the prompt)."""
    from kvbench.session import check_budget

    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise KvbenchError(f"budget '{text}' is not a number") from None
    check_budget(value)
    return value


def policy_params(names: list[str], params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Route `--param k=v` to every named policy that has `k`; `--param snapkv.window=16` to one."""
    from kvbench.policies import POLICIES

    routed: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, value in params.items():
        target, _, param = key.rpartition(".")
        takers = [target] if target else [n for n in names if param in POLICIES.get(n).params()]
        if target and target not in routed:
            raise KvbenchError(f"--param {key}: policy '{target}' is not among --policy {', '.join(names)}")
        if not takers:
            raise KvbenchError(f"--param {key}: none of the policies {', '.join(names)} has a parameter '{param}'")
        for name in takers:
            routed[name][param] = value
    return routed


@app.command()
@user_errors
def run(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Hub id, local folder, .gguf file, "
                              "smollm2-135m (embedded) or random:<shape>."),
    policy: list[str] = typer.Option(["full"], "--policy", "-p", help="Policy name; repeat to compare several."),
    param: list[str] = typer.Option([], "--param", help="Policy parameter k=v (or policy.k=v); repeatable."),
    budget: list[str] = typer.Option(["0.25"], "--budget", "-b", help="Tokens per layer and KV head (128) or "
                                     "a ratio of the prompt (0.25); repeatable."),
    task: str = typer.Option("niah", "--task", "-t", help="Task name (see `kvbench tasks`)."),
    task_param: list[str] = typer.Option([], "--task-param", help="Task parameter k=v; repeatable."),
    context: list[int] = typer.Option([1024], "--context", "-c", help="Context length in tokens; repeatable."),
    depth: list[float] = typer.Option([], "--depth", help="Needle depth in [0, 1]; repeatable (niah)."),
    samples: int = typer.Option(1, "--samples", "-n", min=1, help="Samples per context length (and depth)."),
    prefill: str = typer.Option("full", "--prefill", help="full: one forward, then compress; chunked: "
                                "compress after every --prefill-chunk tokens."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", min=1, help="Chunk size for --prefill chunked."),
    question: str = typer.Option("aware", "--question", help="aware: question inside the compressed prompt; "
                                 "agnostic: context compressed first, question appended after."),
    evict_every: int = typer.Option(1, "--evict-every", min=1, help="Decode-time slack: evict once this "
                                    "many tokens exceed the budget."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", min=1, help="Override the task's."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    device_map: str | None = typer.Option(None, "--device-map", help="'auto' to spread a large model over GPUs."),
    seed: int = typer.Option(0, "--seed", help="Seed for sample generation and random weights."),
    plugins: str | None = PLUGINS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record per sample instead of a table."),
) -> None:
    """Run policies on a task and compare quality, speed and cache memory."""
    from kvbench.policies import build_policy
    from kvbench.registry import load_plugins
    from kvbench.runner import evaluate
    from kvbench.session import RunSettings
    from kvbench.tasks import build_task

    if plugins:
        load_plugins(plugins)
    settings = [
        RunSettings(budget=parse_budget(b), prefill=prefill, prefill_chunk=prefill_chunk, question=question,
                    evict_every=evict_every, max_new_tokens=max_new_tokens)
        for b in budget
    ]
    routed = policy_params(policy, parse_assignments(param, "--param"))
    policies = [build_policy(name, routed[name]) for name in dict.fromkeys(policy)]
    for pol in policies:  # token budgets can be checked before the model loads; ratios only per prompt
        for setting in settings:
            if pol.phases and isinstance(setting.budget, int):
                pol.check_budget(setting.budget)
    task_params = parse_assignments(task_param, "--task-param")
    if depth:
        task_params["depths"] = depth
    task_obj = build_task(task, task_params)
    if any(c < 1 for c in context):
        raise KvbenchError(f"context lengths must be positive, got {context}")

    from kvbench.models import load_model

    lm = load_model(model, dtype=dtype, device=device, device_map=device_map, seed=seed)
    work = []
    for length in context:
        for sample in task_obj.samples(lm.tokenizer, length, samples, seed):
            for pol in policies:
                # a budget means nothing to `full`: run it once per sample, not once per budget
                for setting in settings[:1] if not pol.phases else settings:
                    work.append((length, sample, pol, setting))

    records = []
    with _progress(disable=False) as progress:
        bar = progress.add_task("samples", total=len(work))
        for length, sample, pol, setting in work:
            progress.update(bar, description=f"{pol.name} L={length}")
            record = evaluate(lm, task_obj, pol, sample, setting, length, seed)
            records.append(record)
            if as_json:
                sys.stdout.write(json.dumps(record) + "\n")
                sys.stdout.flush()
            progress.advance(bar)
    if not as_json:
        stdout.print(summary_table(records, lm.describe()))


def _progress(disable: bool) -> Progress:
    return Progress(
        TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(), console=stderr, disable=disable, transient=True,
    )


def summary_table(records: list[dict[str, Any]], model: dict[str, Any]) -> Table:
    """Mean over samples per (context, policy, budget)."""
    import pandas as pd

    from kvbench.summary import param_text

    frame = pd.json_normalize(records)
    frame["budget"] = [("-" if r["budget"] is None else str(r["budget"])) for r in records]
    frame["label"] = [r["policy"]["name"] + (f"+{param_text(r['policy']['storage'])}" if "storage" in r["policy"]
                                             else "") for r in records]
    groups = frame.groupby(["context_length", "label", "budget"], sort=False)
    table = Table(title=f"{model['spec']} ({model['layers']} layers, {model['kv_heads']} KV heads, "
                  f"{model['dtype']}, {model['device']})")
    for column in ("context", "policy", "budget", "n", "score", "cache ratio", "kv peak", "kv live", "ttft s",
                   "tpot ms"):
        table.add_column(column, justify="left" if column in ("policy", "budget") else "right", no_wrap=True)
    for (length, name, budget), rows in groups:
        mean = rows.mean(numeric_only=True)
        table.add_row(
            str(length), name, budget, str(len(rows)), f"{mean['scores.score']:.2f}",
            _number(mean, "cache_ratio", ".3f"), _bytes(mean, "kv_bytes_peak"), _bytes(mean, "kv_bytes_live"),
            _number(mean, "ttft_s", ".2f"),
            _number(mean, "tpot_s", ".0f", 1000),
        )
    if not all(r.get("higher_is_better", True) for r in records):
        table.caption = "score: perplexity, lower is better"
    return table


def _number(row, key: str, spec: str, scale: float = 1.0) -> str:
    """A mean that some tasks do not measure (perplexity has no time to first token): '-' then."""
    import pandas as pd

    value = row.get(key)
    return "-" if value is None or pd.isna(value) else format(value * scale, spec)


def _bytes(row, key: str) -> str:
    import pandas as pd

    value = row.get(key)
    return "-" if value is None or pd.isna(value) else human_bytes(value)


def sweep_table(frame, title: str) -> Table:
    """The summary of a sweep, one row per cell (summary.md has the same, grouped)."""
    import pandas as pd

    varying = [column for column in ("task", "question", "prefill") if frame[column].nunique() > 1]
    table = Table(title=f"{title}: score = mean [95% bootstrap CI]; delta = paired change vs full")
    for column in (*varying, "context", "policy", "budget", "n", "score", "delta", "cache ratio", "kv peak",
                   "status"):
        table.add_column(column, no_wrap=column != "policy",
                         justify="right" if column in ("context", "n", "cache ratio", "kv peak") else "left")
    for _, r in frame.iterrows():
        score = "" if pd.isna(r["score"]) else f"{r['score']:.2f} [{r['score_ci_low']:.2f},{r['score_ci_high']:.2f}]"
        delta = "" if pd.isna(r["delta_vs_full"]) else f"{r['delta_vs_full']:+.2f}"
        policy = f"{r['policy']} ({r['params']})" if r["params"] else r["policy"]
        table.add_row(*(str(r[c]) for c in varying), str(r["context_length"]), policy, r["budget"], str(r["n"]),
                      score, delta, "" if pd.isna(r["cache_ratio"]) else f"{r['cache_ratio']:.3f}",
                      "" if pd.isna(r["kv_bytes_peak"]) else human_bytes(r["kv_bytes_peak"]), r["status"])
    return table


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
    from kvbench.models import count_parameters, load_model, resolve_device
    from kvbench.registry import load_plugins
    from kvbench.results import RunFolder
    from kvbench.summary import summarize
    from kvbench.sweep import estimate_seconds, expand, finished_cells, shard

    if plugins:
        load_plugins(plugins)
    cfg = load_config(config, overrides)
    cells = shard(expand(cfg), shard_spec)
    folder = RunFolder(output or cfg.output or _default_output(cfg.name, shard_spec))
    if dry_run:
        done = folder.done() if folder.manifest() else set()
        parameters = count_parameters(cfg.model.id)
        estimate = "unknown" if parameters is None else \
            f"~{estimate_seconds(cells, parameters, resolve_device(cfg.model.device), share) / 60:.1f} min"
        stdout.print(f"{config}: {len(cells)} cells, {len({c.group for c in cells})} sample groups, "
                     f"{len(done)} samples already in {folder.path}; estimated time {estimate} "
                     "(a rough guess from model size: 2 x parameters FLOPs per token)", highlight=False)
        return
    previous = folder.manifest()
    if previous and previous["config_hash"] == cfg.result_hash() and {c.id for c in cells} <= finished_cells(
            folder, retry_failed):
        completed = True  # nothing left to run: no need to load the model
    else:
        lm = load_model(cfg.model.id, dtype=cfg.model.dtype, device=cfg.model.device,
                        device_map=cfg.model.device_map, seed=cfg.seed)
        completed = _run(cfg, cells, lm, folder, shard_spec, force, quiet, share, retry_failed, trace)
    frame = summarize(folder.path)
    if not quiet and not frame.empty:
        stdout.print(sweep_table(frame, cfg.name))
    stdout.print(f"run folder: {folder.path} (summary.md, summary.csv, records.jsonl)", highlight=False)
    if not completed:
        stderr.print("interrupted: run the same command again to resume")
        raise typer.Exit(130)


def _run(cfg, cells, lm, folder, shard_spec, force: bool, quiet: bool, share: bool, retry_failed: bool,
         trace: bool) -> bool:
    """Open the run folder and run the sweep with a progress bar; False if interrupted."""
    from kvbench.results import now
    from kvbench.sweep import Progress, manifest, run_sweep, sample_total

    run_manifest = manifest(cfg, cells, lm, shard_spec)
    folder.open(run_manifest, force)
    with _progress(disable=quiet) as bar:
        cells_bar = bar.add_task("cells", total=len(cells))
        samples_bar = bar.add_task("samples", total=sample_total(cells))

        def update(progress: Progress) -> None:
            bar.update(cells_bar, completed=progress.cells_done)
            bar.update(samples_bar, completed=progress.samples_done, description=progress.current[:28] or "samples")
            while progress.log:
                stderr.print(f"[yellow]cell failed:[/] {escape(progress.log.pop(0))}", highlight=False)

        completed = run_sweep(lm, folder, cells, Progress(len(cells), sample_total(cells), update), share=share,
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


def _run_folder(run: str):
    from pathlib import Path

    if not (Path(run) / "manifest.json").exists():
        raise KvbenchError(f"not a run folder (no manifest.json): {run}")
    return Path(run)


@app.command()
@user_errors
def summarize(
    run: str = typer.Argument(..., help="Run folder."),
    latex: bool = typer.Option(False, "--latex", help="Also write summary.tex (booktabs, best per column in bold)."),
) -> None:
    """(Re)write summary.csv and summary.md of a run folder from its records."""
    from kvbench.report import latex as latex_tables
    from kvbench.summary import summarize as write_summary

    folder = _run_folder(run)
    frame = write_summary(folder)
    if latex:
        (folder / "summary.tex").write_text(latex_tables(frame))
    stdout.print(f"{run}: {len(frame)} cells summarized into summary.csv, summary.md"
                 f"{', summary.tex' if latex else ''}", highlight=False)


@app.command()
@user_errors
def plot(
    run: str = typer.Argument(..., help="Run folder."),
    out: str | None = typer.Option(None, "--out", help="Folder for the figures (default RUN/figures)."),
    fmt: str = typer.Option("png", "--format", help="png, pdf or svg."),
    style: str = typer.Option("default", "--style", help="default, or paper: two-column sizes, fonts that embed."),
    log_x: bool = typer.Option(False, "--log-x", help="Logarithmic cache-ratio / bytes axis."),
) -> None:
    """Draw score vs cache ratio and bytes, needle heatmaps, memory, speed and the Pareto front."""
    from kvbench.plot import plot_run

    paths = plot_run(_run_folder(run), out, fmt, style, log_x)
    stdout.print(f"{len(paths)} figures in {paths[0].parent}: " + ", ".join(p.name for p in paths), highlight=False)


@app.command()
@user_errors
def report(
    run: str = typer.Argument(..., help="Run folder."),
    max_drop: float = typer.Option(2.0, "--max-drop", min=0, help="Allowed drop (points) for the recommendation."),
) -> None:
    """Write RUN/report.html: one offline file with the run, tables, figures and a failure gallery."""
    from kvbench.report import html_report

    path = html_report(_run_folder(run), max_drop)
    stdout.print(f"report: {path}", highlight=False)


@app.command()
@user_errors
def recommend(
    run: str = typer.Argument(..., help="Run folder."),
    max_drop: float = typer.Option(2.0, "--max-drop", min=0, help="Allowed score drop vs full, in points; the "
                                   "low end of the paired 95% CI must stay within it."),
) -> None:
    """The smallest cache that stays within the allowed drop of full, per task and context length."""
    import pandas as pd

    from kvbench.report import recommend as pick
    from kvbench.summary import summarize as read_summary

    choices = pick(read_summary(_run_folder(run), write=False), max_drop)
    table = Table(title=f"smallest cache within {max_drop:g} points of full (95% CI low end)")
    for column in ("task", "context", "question", "policy", "budget", "cache ratio", "score (full)", "kv saved",
                   "decode speed vs full", "note"):
        table.add_column(column)
    for _, r in choices.iterrows():
        found = r["policy"] is not None and not pd.isna(r["policy"])
        policy = (f"{r['policy']} ({r['params']})" if r.get("params") else r["policy"]) if found else "-"
        table.add_row(
            r["task"], str(r["context_length"]), r["question"], policy, r.get("budget", "") if found else "",
            f"{r['cache_ratio']:.3f}" if found else "", f"{r['score']:.2f} ({r['full_score']:.2f})" if found else "",
            human_bytes(r["kv_saved_bytes"]) if found else "",
            f"{r['decode_speed_vs_full']:.2f}x" if found and not pd.isna(r["decode_speed_vs_full"]) else "",
            r["note"])
    stdout.print(table)


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


def parse_fraction(text: str, option: str) -> float:
    """`5%` or `0.05` -> 0.05."""
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise KvbenchError(f"{option} '{text}' is not a percentage like 5% or a fraction like 0.05") from None
    if value < 0:
        raise KvbenchError(f"{option} must not be negative, got {text}")
    return value


@app.command()
@user_errors
def baseline(
    run: str = typer.Argument(..., help="Run folder to freeze."),
    out: str = typer.Option(..., "--out", help="Baseline file to write, e.g. baselines/smoke.json."),
) -> None:
    """Freeze a run's per-cell metrics (scores per sample, kv peak, speed ratios) as a baseline."""
    from kvbench.gate import make_baseline

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
    junit_path: str | None = typer.Option(None, "--junit", help="Write JUnit XML here."),
    markdown_path: str | None = typer.Option(None, "--markdown", help="Write a Markdown report here."),
) -> None:
    """Check a run against a baseline: exit 1 on a regression, 2 on bad input, 0 otherwise."""
    from pathlib import Path

    from kvbench.gate import Limits, gate, junit, load_baseline, markdown

    limits = Limits(max_drop=max_drop, max_mem_increase=parse_fraction(max_mem_increase, "--max-mem-increase"),
                    max_slowdown=None if max_slowdown is None else parse_fraction(max_slowdown, "--max-slowdown"),
                    strict=strict)
    checks = gate(run, load_baseline(baseline_path), limits)
    table = Table(title=f"kvbench gate: {run} against {baseline_path}")
    for column in ("cell", "verdict", "score", "change [95% CI]", "kv peak", "why"):
        table.add_column(column)
    colour = {"pass": "green", "fail": "bold red", "missing": "yellow", "new": "yellow"}
    for c in checks:
        table.add_row(
            c.label, f"[{colour[c.verdict]}]{c.verdict}[/]",
            "" if c.score is None else f"{c.score[0]:.2f} -> {c.score[1]:.2f}",
            "" if c.delta is None else f"{c.delta[0]:+.1f} [{c.delta[1]:+.1f}, {c.delta[2]:+.1f}]",
            "" if c.memory is None else f"{c.memory[1] / c.memory[0] - 1:+.1%}", "; ".join(c.reasons + c.notes))
    stdout.print(table)
    if junit_path:
        Path(junit_path).write_text(junit(checks))
    if markdown_path:
        Path(markdown_path).write_text(markdown(checks))
    failed = [c for c in checks if c.failed]
    stdout.print(f"{len(failed)} of {len(checks)} cells failed" if failed else f"all {len(checks)} cells passed",
                 highlight=False)
    if failed:
        raise typer.Exit(1)


@app.command(name="capacity")
@user_errors
def capacity_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="As for `run`."),
    policy: str = typer.Option("full", "--policy", "-p", help="Policy name."),
    param: list[str] = typer.Option([], "--param", help="Policy parameter k=v; repeatable."),
    budget: str | None = typer.Option(None, "--budget", "-b", help="Tokens per layer and KV head, or a ratio."),
    memory_limit: str | None = typer.Option(None, "--memory-limit", help="Memory the run may use, e.g. 24GiB "
                                            "(on CPU: the KV cache's bytes)."),
    pressure: float | None = typer.Option(None, "--pressure", min=0, max=0.999, help="Share of device memory "
                                          "already taken by others, e.g. 0.9."),
    context: int | None = typer.Option(None, "--context", "-c", min=1, help="Find the largest batch at this "
                                       "context length."),
    batch: int | None = typer.Option(None, "--batch", min=1, help="Find the longest context at this batch."),
    decode_steps: int = typer.Option(16, "--decode-steps", min=1, help="Decode steps each probe must complete."),
    most: int | None = typer.Option(None, "--max", min=1, help="Upper bound of the search."),
    prefill: str = typer.Option("full", "--prefill", help="full or chunked (see `run`)."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", min=1, help="Chunk size for --prefill chunked."),
    dtype: str = typer.Option("auto", "--dtype", help="As for `run`."),
    device: str = typer.Option("auto", "--device", help="As for `run`."),
) -> None:
    """Largest batch (--context) or longest context (--batch) that fits a memory limit, and its decode speed."""
    from kvbench.capacity import capacity
    from kvbench.estimate import parse_bytes
    from kvbench.models import load_model
    from kvbench.policies import build_policy
    from kvbench.session import RunSettings

    if (context is None) == (batch is None):
        raise KvbenchError("give either --context (find the largest batch) or --batch (find the longest context)")
    if memory_limit is None and pressure is None:
        raise KvbenchError("give --memory-limit or --pressure")
    pol = build_policy(policy, parse_assignments(param, "--param"))
    settings = RunSettings(budget=None if budget is None else parse_budget(budget), prefill=prefill,
                           prefill_chunk=prefill_chunk)
    lm = load_model(model, dtype=dtype, device=device)
    search = "batch" if context is not None else "context"
    with stderr.status(f"searching the largest {search} ..."):
        found = capacity(lm, pol, settings, search, context=context or 0, batch=batch or 1,
                         decode_steps=decode_steps, limit_bytes=None if memory_limit is None else
                         parse_bytes(memory_limit), pressure=pressure, bound=most)
    probes = ", ".join(f"{n} {'ok' if fit else 'OOM'}" for n, fit in found.probes)
    where = f"at {context} tokens" if search == "batch" else f"at batch {batch}"
    limit = memory_limit or f"{pressure:.0%} of the device taken"
    stdout.print(f"{model}, {pol.name} budget {budget or '-'}, limit {limit}: largest {search} {where}: "
                 f"[bold]{found.size}[/] (probes: {probes})", highlight=False)
    if found.size:
        m = found.measurements
        stdout.print(f"there: decode {m['decode_tok_s'] or 0:.1f} tok/s over the batch, KV peak "
                     f"{human_bytes(m['kv_bytes_peak'])}, process peak {human_bytes(m['mem_peak_alloc'])}",
                     highlight=False)


@app.command(name="estimate")
@user_errors
def estimate_command(
    model: str = typer.Argument(..., help="A built-in shape (llama-2-70b, llama-3.1-8b, mistral-7b, qwen2.5-7b, "
                                           "smollm2-135m, ...), random:<shape>, a local folder or a hub id."),
    context: list[int] = typer.Option([4096], "--context", "-c", help="Context length in tokens; repeatable."),
    batch: list[int] = typer.Option([1], "--batch", help="Sequences in the batch; repeatable."),
    dtype: list[str] = typer.Option(["bfloat16"], "--dtype", help="KV and weight dtype; repeatable."),
    budget: list[str] = typer.Option([], "--budget", "-b", help="Tokens per layer and KV head or a ratio; "
                                                                  "repeatable (the full cache is always shown)."),
    device_memory: str | None = typer.Option(None, "--device-memory", help="e.g. 80GiB: warn where cache plus "
                                                                             "weights do not fit."),
) -> None:
    """KV-cache memory of a model at given lengths, batches, dtypes and budgets, without loading it."""
    from kvbench.estimate import estimate, model_shape, parse_bytes

    shape = model_shape(model)
    limit = None if device_memory is None else parse_bytes(device_memory)
    rows = estimate(shape, context, batch, dtype, [None, *(parse_budget(b) for b in budget)], limit)
    table = Table(title=f"{model}: {shape.layers} layers x {shape.kv_heads} KV heads x head_dim {shape.head_dim}"
                  + ("" if shape.parameters is None else f", {shape.parameters / 1e9:.2f}B parameters"))
    for column in ("context", "batch", "dtype", "budget", "per token", "KV cache", "+ weights", "fits"):
        table.add_column(column, justify="left" if column in ("dtype", "budget") else "right")
    for r in rows:
        total = "?" if r["total_bytes"] is None else human_bytes(r["total_bytes"])
        fits = "" if r["fits"] is None else ("yes" if r["fits"] else "NO")
        table.add_row(str(r["context"]), str(r["batch"]), r["dtype"], "full" if r["budget"] is None else
                      str(r["budget"]), human_bytes(r["bytes_per_token"]), human_bytes(r["cache_bytes"]), total, fits)
    stdout.print(table)
    over = [r for r in rows if r["fits"] is False]
    if over:
        stderr.print(f"warning: {len(over)} of {len(rows)} settings need more than {device_memory} "
                     "(weights + KV cache, before activations)")


def _listing(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    stdout.print(table)


@app.command()
@user_errors
def policies(plugins: str | None = PLUGINS) -> None:
    """List the policies, their family, phases and parameters.

    Every eviction policy also takes `storage:` (a compression policy, e.g. `{quant: {bits: 4}}`) to keep what it
    keeps compressed: its records then say family `hybrid`."""
    from kvbench.policies import POLICIES
    from kvbench.registry import load_plugins

    if plugins:
        load_plugins(plugins)
    rows = []
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        params = ", ".join(f"{k}={v}" for k, v in cls.params().items() if k != "storage") or "-"
        rows.append((name, cls.family, "+".join(cls.phases) or "-", "yes" if cls.needs_attention else "no", params,
                     first_line(cls)))
    _listing("policies", ("name", "family", "phases", "needs attention", "parameters (defaults)", "what it does"),
             rows)


@app.command()
@user_errors
def tasks(plugins: str | None = PLUGINS) -> None:
    """List the tasks and their parameters."""
    from kvbench.registry import load_plugins
    from kvbench.tasks import TASKS

    if plugins:
        load_plugins(plugins)
    rows = [(name, "\n".join(f"{k}={v!r}" for k, v in TASKS.get(name).params().items()), first_line(TASKS.get(name)))
            for name in TASKS.names()]
    _listing("tasks", ("name", "parameters (defaults)", "what it does"), rows)


if __name__ == "__main__":
    app()
