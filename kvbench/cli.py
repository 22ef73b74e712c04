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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvbench import __version__
from kvbench.errors import KvbenchError
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
            stderr.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
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
    from kvbench.runner import check_budget

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
    from kvbench.runner import RunSettings, evaluate
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

    frame = pd.json_normalize(records)
    frame["budget"] = [("-" if r["budget"] is None else str(r["budget"])) for r in records]
    groups = frame.groupby(["context_length", "policy.name", "budget"], sort=False)
    table = Table(title=f"{model['spec']} ({model['layers']} layers, {model['kv_heads']} KV heads, "
                  f"{model['dtype']}, {model['device']})")
    for column in ("context", "policy", "budget", "n", "score", "cache ratio", "kv peak", "kv live", "ttft s",
                   "tpot ms"):
        table.add_column(column, justify="left" if column in ("policy", "budget") else "right", no_wrap=True)
    for (length, name, budget), rows in groups:
        mean = rows.mean(numeric_only=True)
        table.add_row(
            str(length), name, budget, str(len(rows)), f"{mean['scores.score']:.2f}", f"{mean['cache_ratio']:.3f}",
            human_bytes(mean["kv_bytes_peak"]), human_bytes(mean["kv_bytes_live"]), f"{mean['ttft_s']:.2f}",
            "-" if pd.isna(mean["tpot_s"]) else f"{mean['tpot_s'] * 1000:.0f}",
        )
    return table


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


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
    """List the policies, their phases and parameters."""
    from kvbench.policies import POLICIES
    from kvbench.registry import load_plugins

    if plugins:
        load_plugins(plugins)
    rows = []
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        params = ", ".join(f"{k}={v}" for k, v in cls.params().items()) or "-"
        rows.append((name, "+".join(cls.phases) or "-", "yes" if cls.needs_attention else "no", params,
                     first_line(cls)))
    _listing("policies", ("name", "phases", "needs attention", "parameters (defaults)", "what it does"), rows)


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
