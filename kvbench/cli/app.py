"""The Typer app every command registers on, and what the commands share: the consoles, one-line errors,
option parsers, the progress bar and the run-folder check."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
import typer.core
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvbench import __version__
from kvbench.errors import KvbenchError

stdout = Console(width=max(Console().width, 110))
stderr = Console(stderr=True)


def print_error(message: str) -> None:
    """The one line every bad input ends in (the caller exits 2)."""
    one_line = " ".join(message.split())
    stderr.print(f"[bold red]error:[/] {escape(one_line)}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """Click's own errors (a bad option value, a missing argument, an unknown option) as one line, exit 2, instead of
    Typer's boxed usage text: the same shape as every other bad input."""
    try:
        yield
    except typer.TyperException as exc:  # Typer's Click raises its usage errors as these
        if type(exc).__name__ == "NoArgsIsHelpError":  # `kvbench` alone: the help is printed, nothing went wrong
            raise
        context = getattr(exc, "ctx", None)
        hint = f" (see '{context.command_path} --help')" if context is not None else ""
        print_error(exc.format_message() + hint)
        raise typer.Exit(2) from None


class OneLineErrorGroup(typer.core.TyperGroup):
    """The app's group: parsing its own options and every subcommand's (which happens in `invoke`) reports usage
    errors as one line."""

    # the contexts are Typer's own (private) Click's: `Any` stands in, these overrides only wrap their parent's call
    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with _one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=OneLineErrorGroup,
    help="Benchmark KV-cache eviction and compression policies: quality, speed and measured memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # help texts are plain text: brackets in them (pip install 'kvbench[ray]', [fidelity]) are not markup
    rich_markup_mode=None,
)
PLUGINS = typer.Option(None, "--plugins", help="Folder of extra policy/task files to load.")


def full_dtype_names(value: Any) -> Any:
    """`--dtype` (one or a list) by full names: bf16, fp16, fp32 as bfloat16, float16, float32."""
    from kvbench.engine.estimate import canonical_dtype

    return canonical_dtype(value) if isinstance(value, str) else [canonical_dtype(dtype) for dtype in value]


def json_flag(what: str) -> Any:
    """`--json`, the same on every command that has a JSON form: `what` on stdout instead of the human output."""
    return typer.Option(False, "--json", help=f"Print {what} on stdout instead of the human output.")


def json_out(what: str) -> Any:
    """`--json-out PATH`, beside `--json`: `what` written to a file, the human output kept."""
    return typer.Option(None, "--json-out", metavar="PATH", dir_okay=False, help=f"Write {what} to PATH (with or "
                        "without --json).")


def write_json(text: str, path: Path | None) -> None:
    """A command's JSON (`text`, from `json.dumps`) into `--json-out`'s file, whole, once the command has it all."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


DTYPE = typer.Option("auto", "--dtype", callback=full_dtype_names, help="auto (bfloat16 on GPU, float32 on CPU), "
                     "float32, bfloat16, float16 (or fp32, bf16, fp16).")


def user_errors(command: Callable) -> Callable:
    """Bad input ends in one line naming the culprit and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KvbenchError as exc:
            print_error(str(exc))
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
    hf_logging.disable_progress_bar()  # the "Loading weights" bar of every model load, not kvbench's own progress


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


def parse_budget(text: str, command: str | None = None) -> Any:
    """`128` (tokens per layer and KV head), `0.25` or `25%` (a ratio of the prompt), or `threshold=0.01` where
    `command` is None (a `Threshold`: what a prompt keeps, which only running it tells); warns, on one line, of a
    small integer that reads like a ratio."""
    from kvbench.config.schema import budget_from_text, warn_if_ratio_like
    from kvbench.policies.budgets import Threshold

    value = budget_from_text(text)
    if isinstance(value, Threshold) and command is not None:
        raise KvbenchError(f"kvbench {command}: --budget '{text}': a threshold keeps what each prompt's scores "
                           "decide, unknown before running it; give tokens (128) or a ratio (0.25)")
    warn_if_ratio_like(value)
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



def progress_bar(disable: bool) -> Progress:
    return Progress(
        TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(), console=stderr, disable=disable, transient=True,
    )


def run_folder(run: str) -> Path:
    if not (Path(run) / "manifest.json").exists():
        raise KvbenchError(f"not a run folder (no manifest.json): {run}")
    return Path(run)


def parse_fraction(text: str, option: str) -> float:
    """`5%` or `0.05` -> 0.05."""
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise KvbenchError(f"{option} '{text}' is not a percentage like 5% or a fraction like 0.05") from None
    if value < 0:
        raise KvbenchError(f"{option} must not be negative, got {text}")
    return value

