"""`kvbench check`: the harness checks itself on this model, dtype, attention kernel and device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.markup import escape

from kvbench.cli.app import DTYPE, app, json_flag, json_out, stderr, stdout, user_errors, write_json

REPORT = "the report (versions, device, every number)"
MARKS = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "skip": "[yellow]skip[/]"}


@app.command()
@user_errors
def check(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Hub id, local folder, .gguf file, an embedded "
                              "model (smollm2-135m, gemma3-270m) or random:<shape>."),
    dtype: str = DTYPE,
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
    context: int | None = typer.Option(None, "--context", "-c", min=16, help="Tokens of the long prompt "
                                       "(default 16384 on a GPU, 1024 on CPU); the short one has 256."),
    policies: str | None = typer.Option(None, "--policies", help="Comma-separated policies to check against their "
                                        "references (default: snapkv,h2o,tova,knorm,streaming_llm,qfilter,kvzap; "
                                        "qfilter and kvzap skipped until kvbench calibrate has run)."),
    attention: str = typer.Option("auto", "--attention", help="model.generate's attention implementation, the "
                                  "reference for full: sdpa, eager, flash_attention_2, ...; auto: sdpa, or eager "
                                  "where logits are soft-capped."),
    as_json: bool = json_flag(REPORT + " (the lines of each check go to stderr)"),
    json_path: Path | None = json_out(REPORT),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="Judge decode speed against model.generate "
                                "(--no-timing reports it skipped: for machines whose cores other work shares)."),
    seed: int = typer.Option(0, "--seed", help="Seed for random weights."),
) -> None:
    """Check kvbench on this model and device.

    full equals model.generate, policies keep what their references keep, memory readings hold, decode speed. Exit
    1 if a check fails."""
    from kvbench.checks.suite import (
        CheckSettings,
        checkable,
        default_context,
        reference_kernel,
        report_dict,
        run_checks,
    )
    from kvbench.engine.models import load_model, resolve_device

    names = tuple(name.strip() for name in policies.split(",") if name.strip()) if policies else checkable()
    long = context or default_context(resolve_device(device))
    started = time.perf_counter()
    lm = load_model(model, dtype=dtype, device=device, seed=seed)
    settings = CheckSettings(short=min(256, long), long=long, policies=names,
                             attention=reference_kernel(lm, attention), timing=timing)
    described = lm.describe()
    lines = stderr if as_json else stdout  # stdout holds the JSON alone
    lines.print(f"kvbench check: {escape(model)} ({described['architecture']}, {described['layers']} layers, "
                 f"{described['kv_heads']} KV heads x {described['head_dim']}) on {lm.device}, "
                 f"{described['dtype']}; prompts of {settings.short} and {settings.long} tokens; model.generate "
                 f"with {settings.attention} attention as the reference", highlight=False)

    def report(result) -> None:
        lines.print(f"  {MARKS[result.status]}  {result.name:<27} {escape(result.detail)}", highlight=False,
                     soft_wrap=True)

    checks = run_checks(lm, settings, report)
    seconds = time.perf_counter() - started
    counts = {status: sum(c.status == status for c in checks) for status in MARKS}
    summary = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in {seconds:.0f} s"
    text = json.dumps(report_dict(lm, settings, checks, seconds), indent=2, default=str)
    write_json(text, json_path)
    if json_path is not None:
        summary += f"; report: {json_path}"
    lines.print(summary, highlight=False)
    if as_json:
        typer.echo(text)
    if counts["fail"]:
        raise typer.Exit(1)
