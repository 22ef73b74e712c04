"""`kvbench plot` and `kvbench report` on a folder of run folders: each run as on its own, and the runs that share a
task and model drawn together into the folder (synthetic runs, no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from kvbench.analysis.plot import compare_figures
from kvbench.analysis.summary import summarize
from kvbench.cli import app
from kvbench.runs.run_folder import RunFolder
from tests.test_plot_report import make_run

runner = CliRunner()


@pytest.fixture(autouse=True)
def close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def results(tmp_path):
    """Two runs of one grid on model m, the second keeping a little more of the cache."""
    make_run(tmp_path / "results" / "alpha", name="alpha")
    make_run(tmp_path / "results" / "beta", name="beta", shift=0.05)
    return tmp_path / "results"


def test_runs_that_share_a_task_and_model_are_drawn_together(results):
    drawn = compare_figures([results / "alpha", results / "beta"])
    assert list(drawn) == ["compare_niah"]
    axis = drawn["compare_niah"].axes[1]  # the 1024-token panel
    lines = {line.get_label(): line for line in axis.lines}
    assert {"alpha: full", "beta: full", "alpha: snapkv", "beta: snapkv"} <= set(lines)
    for run in ("alpha", "beta"):
        frame = summarize(results / run, write=False)
        expected = frame[(frame["policy"] == "snapkv") & (frame["context_length"] == 1024)].sort_values("cache_ratio")
        np.testing.assert_allclose(lines[f"{run}: snapkv"].get_xdata(), expected["cache_ratio"])
        np.testing.assert_allclose(lines[f"{run}: snapkv"].get_ydata(), expected["score"])
    # one policy keeps its colour across runs; the runs differ in line style, the full references in dashes
    assert lines["alpha: snapkv"].get_color() == lines["beta: snapkv"].get_color()
    assert lines["alpha: snapkv"].get_linestyle() != lines["beta: snapkv"].get_linestyle()
    assert lines["alpha: full"].get_linestyle() != lines["beta: full"].get_linestyle()


def test_plot_a_folder_draws_each_run_and_the_comparison(results):
    make_run(results / "gamma", name="gamma", model="other")  # alone on its model: drawn, compared with nothing
    result = runner.invoke(app, ["plot", str(results)])
    assert result.exit_code == 0, result.output
    for run in ("alpha", "beta", "gamma"):
        assert (results / run / "figures" / "score_vs_ratio_niah.png").read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in (results / "figures").iterdir()] == ["compare_niah_m.png"]  # named by its model
    assert "1 comparisons" in result.output and "compare_niah_m.png" in result.output


def test_plot_a_folder_into_out(results, tmp_path):
    result = runner.invoke(app, ["plot", str(results), "--out", str(tmp_path / "out"), "--format", "svg"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "compare_niah.svg").exists() and (tmp_path / "out" / "beta" / "pareto.svg").exists()
    assert not (results / "figures").exists() and not (results / "alpha" / "figures").exists()


def test_report_a_folder_indexes_the_runs_and_shows_the_comparison(results):
    result = runner.invoke(app, ["report", str(results)])
    assert result.exit_code == 0, result.output
    assert (results / "alpha" / "report.html").exists() and (results / "beta" / "report.html").exists()
    index = (results / "report.html").read_text()
    assert "<a href='alpha/report.html'>alpha</a>" in index and "<a href='beta/report.html'>beta</a>" in index
    assert index.count("data:image/png;base64,") == 1 and "alt='compare_niah'" in index
    assert "http://" not in index and "https://" not in index
    assert "snapkv</b> at 256 keeps 0.3× of full's KV bytes" in index  # beta's answer, next to alpha's 0.25×


def test_a_plain_run_folder_is_drawn_as_before(results):
    result = runner.invoke(app, ["plot", str(results / "alpha")])
    assert result.exit_code == 0 and "figures in" in result.output
    assert not (results / "figures").exists()
    assert runner.invoke(app, ["report", str(results / "alpha")]).exit_code == 0
    assert not (results / "report.html").exists()


@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_folder_without_runs_is_a_one_line_error(tmp_path, command):
    (tmp_path / "empty" / "not-a-run").mkdir(parents=True)
    result = runner.invoke(app, [command, str(tmp_path / "empty")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {tmp_path / 'empty'}: not a run folder (no manifest.json) and no run folders inside"]


@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_run_without_records_stops_the_folder_before_anything_is_written(results, command):
    RunFolder(results / "broken").open({"name": "broken", "config_hash": "x", "started": "t", "cells": []},
                                       force=False)
    result = runner.invoke(app, [command, str(results)])
    assert result.exit_code == 2 and "broken: no records to plot" in result.output
    assert not (results / "alpha" / "figures").exists() and not (results / "alpha" / "report.html").exists()
