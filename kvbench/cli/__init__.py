"""The `kvbench` command line: one module per group of commands, all on one Typer app.

It is the last stage and may import any other; a command imports what it runs when it runs, so `kvbench --help`
loads the policy contract and no policy (tests/test_imports.py)."""

# each module registers its commands; the import order is the order `kvbench --help` lists them
from kvbench.cli import run, sweep, analyze, tools, check, calibrate  # noqa: F401, I001
from kvbench.cli.app import app

__all__ = ["app"]
