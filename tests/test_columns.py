"""kvbench/analysis/columns.py is the one home of a record column: every column a record has is declared there, every
declared aggregate reaches the summary, and a column added to the table reaches the summary and the gate alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.analysis import columns
from kvbench.analysis.columns import COLUMNS, VIEWS, Column, Display
from kvbench.cli import app
from tests.test_gate import cells, make_run

runner = CliRunner()


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory) -> Path:
    """A tiny sweep with fidelity and a task with segments: records as the producers write them, and their summary."""
    from tests.test_sweep import TINY, sweep, write_config

    folder = tmp_path_factory.mktemp("columns")
    config = {**TINY, "policies": ["full", "h2o"], "budgets": [64], "samples": 1, "diagnostics": ["fidelity"],
              "tasks": [*TINY["tasks"], {"name": "instructions", "instructions": 1}]}  # its segments and leak
    sweep(write_config(folder, config), folder / "run")
    return folder / "run"


def test_every_column_a_record_has_is_declared(sweep_run):
    records = [json.loads(line) for line in (sweep_run / "records.jsonl").read_text().splitlines()]
    undeclared = {key for record in records for key in record} - set(columns.BY_NAME)
    assert not undeclared, f"declare these in kvbench/analysis/columns.py: {sorted(undeclared)}"


def test_every_declared_aggregate_reaches_the_summary(sweep_run):
    from kvbench.analysis.summary import summarize

    frame = summarize(sweep_run, write=False)
    missing = [c.name for c in COLUMNS if c.aggregate and c.name not in frame]
    assert not missing, f"declared with an aggregate but not in the summary: {missing}"


def test_the_declarations_are_whole():
    assert len(columns.BY_NAME) == len(COLUMNS), "a column declared twice"
    for column in COLUMNS:
        assert column.aggregate in (None, *columns.AGGREGATES) and column.gate in (None, *columns.GATE_ROLES)
        assert column.better in (None, "higher", "lower")
    for view, names in VIEWS.items():
        for column, display in columns.view(view):
            assert isinstance(display, Display), (view, column.name)
        assert len(names) == len(set(names))


@pytest.fixture
def extra_column(monkeypatch):
    """A memory column added to the table and nowhere else."""
    extra = Column("kv_bytes_extra", "bytes", "test", "mean", better="lower", gate="memory",
                   shown={"gate": Display("kv extra", "+.1%")})
    monkeypatch.setattr(columns, "COLUMNS", [*COLUMNS, extra])
    monkeypatch.setitem(columns.BY_NAME, extra.name, extra)
    return extra


def _with_extra(run: Path, value: float) -> Path:
    path = run / "records.jsonl"
    records = [{**json.loads(line), "kv_bytes_extra": value} for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return run


def test_a_column_added_to_the_table_reaches_the_summary_and_the_gate(tmp_path, extra_column):
    from kvbench.analysis.summary import summarize

    base = _with_extra(make_run(tmp_path / "base", cells()), 100)
    assert summarize(base, write=False)["kv_bytes_extra"].tolist() == [100.0, 100.0]
    made = runner.invoke(app, ["baseline", str(base), "--out", str(tmp_path / "baseline.json")])
    assert made.exit_code == 0, made.output
    assert all(cell["kv_bytes_extra"] == 100 for cell in json.loads((tmp_path / "baseline.json").read_text())[
        "cells"].values())
    run = _with_extra(make_run(tmp_path / "run", cells()), 200)
    result = runner.invoke(app, ["gate", str(run), "--baseline", str(tmp_path / "baseline.json"), "--markdown",
                                 str(tmp_path / "gate.md")])
    assert result.exit_code == 1 and "kv extra grew +100.0%" in (tmp_path / "gate.md").read_text()


def test_each_column_is_named_by_the_module_that_writes_it():
    """A column's producer is a module (or package) under kvbench whose source writes the column's name, as a key
    or a keyword; a column the summary aggregates from another (`source=`) is the summary's."""
    import importlib
    import inspect
    import pkgutil
    import re

    def sources(producer: str) -> str:
        module = importlib.import_module(f"kvbench.{producer}")
        found = [inspect.getsource(module)]
        for inner in pkgutil.walk_packages(getattr(module, "__path__", []), f"{module.__name__}."):
            found.append(inspect.getsource(importlib.import_module(inner.name)))
        return "\n".join(found)

    for column in COLUMNS:
        if column.source is not None:
            assert column.producer == "analysis.summary", column.name
            continue
        # a name the producer composes: `mem_group_peak_alloc` from `mem_peak_alloc`, `ttft_p99` from `ttft`
        written = "mem_group_" if column.name.startswith("mem_group_") else re.sub(r"_p(50|90|99)$", "", column.name)
        writes = re.compile(rf'"{written}|\b{written}=')
        assert writes.search(sources(column.producer)), f"{column.name}: not written by kvbench.{column.producer}"
