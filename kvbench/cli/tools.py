"""Commands that need no run folder: `capacity`, `estimate`, `policies`, `tasks`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal, cast

import typer

from kvbench.analysis.tables import listing
from kvbench.cli.app import (
    DTYPE,
    PLUGINS,
    app,
    full_dtype_names,
    json_flag,
    json_out,
    parse_assignments,
    parse_budget,
    stderr,
    stdout,
    user_errors,
    write_json,
)
from kvbench.engine.estimate import human_bytes
from kvbench.errors import KvbenchError
from kvbench.registry import first_line


@app.command(name="capacity")
@user_errors
def capacity_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="As for `run`."),
    policy: str = typer.Option("full", "--policy", "-p", help="Policy name."),
    param: list[str] = typer.Option([], "--param", help="Policy parameter k=v; repeatable."),
    budget: str | None = typer.Option(None, "--budget", "-b", help="Tokens per layer and KV head, or a ratio "
                                      "(0.25 or 25%)."),
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
    dtype: str = DTYPE,
    device: str = typer.Option("auto", "--device", help="As for `run`."),
) -> None:
    """Find the largest batch or longest context that fits memory.

    The largest batch at --context, or the longest context at --batch, within --memory-limit or --pressure, and
    its decode speed."""
    from kvbench.engine.estimate import parse_bytes
    from kvbench.engine.models import load_model
    from kvbench.engine.settings import RunSettings
    from kvbench.policies import build_policy
    from kvbench.tasks.capacity_search import capacity

    if (context is None) == (batch is None):
        raise KvbenchError("give either --context (find the largest batch) or --batch (find the longest context)")
    if memory_limit is None and pressure is None:
        raise KvbenchError("give --memory-limit or --pressure")
    pol = build_policy(policy, parse_assignments(param, "--param"))
    # prefill stays text here: RunSettings checks it and names the allowed values
    settings = RunSettings(budget=None if budget is None else parse_budget(budget, "capacity"),
                           prefill=cast(Any, prefill), prefill_chunk=prefill_chunk)
    lm = load_model(model, dtype=dtype, device=device)
    search: Literal["batch", "context"] = "batch" if context is not None else "context"
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


ESTIMATE_JSON = ("one JSON object: the model, its shape (layers, kv_heads, head_dim, parameters) and `rows`, one per "
                 "table row, with bytes as numbers, budget null for the full cache and fits null without "
                 "--device-memory")


@app.command(name="estimate")
@user_errors
def estimate_command(
    model: str = typer.Argument(..., help="A built-in shape (llama-2-70b, llama-3.1-8b, mistral-7b, qwen2.5-7b, "
                                           "smollm2-135m, ...), random:<shape>, a local folder or a hub id."),
    context: list[int] = typer.Option([4096], "--context", "-c", help="Context length in tokens; repeatable."),
    batch: list[int] = typer.Option([1], "--batch", help="Sequences in the batch; repeatable."),
    dtype: list[str] = typer.Option(["bfloat16"], "--dtype", callback=full_dtype_names, help="KV and weight "
                                    "dtype: float32, bfloat16, float16 (or fp32, bf16, fp16), float8, int8, int4; "
                                    "repeatable."),
    budget: list[str] = typer.Option([], "--budget", "-b", help="Tokens per layer and KV head or a ratio (0.25 or "
                                     "25%); repeatable (the full cache is always shown)."),
    device_memory: str | None = typer.Option(None, "--device-memory", help="e.g. 80GiB: warn where cache plus "
                                                                             "weights do not fit."),
    as_json: bool = json_flag(ESTIMATE_JSON),
    json_path: Path | None = json_out(ESTIMATE_JSON),
) -> None:
    """Estimate a model's KV-cache memory without loading it.

    One row per context length, batch, dtype and budget, beside the weights."""
    from kvbench.analysis.tables import estimate_table
    from kvbench.engine.estimate import estimate, model_shape, parse_bytes

    shape = model_shape(model)
    limit = None if device_memory is None else parse_bytes(device_memory)
    rows = estimate(shape, context, batch, dtype, [None, *(parse_budget(b, "estimate") for b in budget)], limit)
    text = json.dumps({"model": model, **dataclasses.asdict(shape), "device_memory_bytes": limit, "rows": rows})
    write_json(text, json_path)
    if as_json:
        typer.echo(text)
    else:
        stdout.print(estimate_table(model, shape, rows))
    over = [r for r in rows if r["fits"] is False]
    if over:
        stderr.print(f"warning: {len(over)} of {len(rows)} settings need more than {device_memory} "
                     "(weights + KV cache, before activations)", highlight=False, soft_wrap=True)


LISTING_JSON = "a JSON list, one object per entry,"


def print_listing(title: str, columns: tuple[str, ...], entries: list[dict[str, Any]], as_json: bool,
                  json_path: Path | None) -> None:
    """`entries` (one dict per row, keyed by `columns`, parameters as a dict) as JSON, as a table on a terminal,
    or as tab-separated rows, never cut or wrapped, when the output is a pipe or a file (`kvbench policies | grep`)."""
    text = json.dumps(entries, default=str)
    write_json(text, json_path)
    if as_json:
        typer.echo(text)
        return

    def cell(value: Any) -> str:
        if isinstance(value, dict):
            return ", ".join(f"{k}={v!r}" for k, v in value.items()) or "-"
        if isinstance(value, (list, tuple)):
            return "+".join(map(str, value)) or "-"
        return "yes" if value is True else "no" if value is False else str(value)

    rows = [tuple(cell(entry[column]) for column in columns) for entry in entries]
    if stdout.is_terminal:
        stdout.print(listing(title, tuple(c.replace("_", " ") for c in columns), rows))
    else:
        typer.echo("\n".join("\t".join(row) for row in [columns, *rows]))


@app.command()
@user_errors
def policies(plugins: str | None = PLUGINS, as_json: bool = json_flag(LISTING_JSON),
             json_path: Path | None = json_out(LISTING_JSON)) -> None:
    """List the policies, their family, schedule and parameters.

    Every eviction policy also takes `storage:` (a compression policy, e.g. `{quant: {bits: 4}}`) to keep what it
    keeps compressed: its records then say family `hybrid`."""
    from kvbench.policies import POLICIES
    from kvbench.registry import load_plugins

    if plugins:
        load_plugins(plugins)
    entries = []
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        entries.append({"name": name, "family": cls.family, "schedule": cls.schedule.when,
                        "needs_attention": cls.needs_attention, "decode_step": decode_step(name),
                        "parameters": {k: v for k, v in cls.params().items() if k != "storage"},
                        "description": first_line(cls)})
    print_listing("policies", ("name", "family", "schedule", "needs_attention", "decode_step", "parameters",
                               "description"), entries, as_json, json_path)


def decode_step(name: str) -> str:
    """How a policy's decode steps run at its defaults: `static` (on static buffers, compiled with --compile), or
    `dynamic: <why>` (eager on the dynamic layout). A policy that needs parameters to be built is judged by its
    class."""
    from kvbench.engine.cache import step_blocker
    from kvbench.errors import KvbenchError
    from kvbench.policies import POLICIES, Policy

    try:
        why = step_blocker(POLICIES.build(name))
    except KvbenchError:  # it needs a parameter (a pattern, an artifact): what its class says
        cls = POLICIES.get(name)
        selects = cls.schedule.decodes and cls.select is not Policy.select
        why = "it picks a kept set of any size per head while decoding" if selects else cls.eager_only
    return "static" if why is None else f"dynamic: {why}"


@app.command()
@user_errors
def tasks(plugins: str | None = PLUGINS, as_json: bool = json_flag(LISTING_JSON),
          json_path: Path | None = json_out(LISTING_JSON)) -> None:
    """List the tasks and their parameters."""
    from kvbench.registry import load_plugins
    from kvbench.tasks import TASKS

    if plugins:
        load_plugins(plugins)
    entries = [{"name": name, "parameters": TASKS.get(name).params(), "description": first_line(TASKS.get(name))}
               for name in TASKS.names()]
    print_listing("tasks", ("name", "parameters", "description"), entries, as_json, json_path)


@app.command(name="lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def lm_eval_command(ctx: typer.Context) -> None:
    """Run lm-evaluation-harness with the kvbench model registered.

    lm-eval's own command line, e.g. `kvbench lm-eval run --model kvbench --model_args
    pretrained=smollm2-135m,policy=snapkv,budget=0.25 --tasks TASK`."""
    import sys

    try:
        from lm_eval.__main__ import cli_evaluate

        from kvbench.tasks import lmeval_model as lmeval  # registers the model
    except ImportError:
        raise KvbenchError("lm-evaluation-harness is not installed: pip install -e '.[lmeval]' in the kvbench "
                           "checkout") from None
    args = list(ctx.args)
    if "-h" in args or "--help" in args:
        typer.echo(lmeval.model_args_help())
    elif args and args[0] not in ("ls", "validate"):  # `run`, named or (lm-eval's older form) implied
        lmeval.check_command_tasks(args)
    lmeval.log_to_current_stderr()
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except FileNotFoundError as exc:  # a task's local data_files, which lm-eval resolves from the current folder
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvbenchError(f"lm-eval: {first} (a task's data_files are relative to the folder you run from)") from None
