"""Figures, report, recommendation and LaTeX from a synthetic run folder (no model needed)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.plot import figures, pareto_front
from kvbench.report import latex, recommend
from kvbench.results import RunFolder
from kvbench.summary import summarize

runner = CliRunner()
DEPTHS = [0.1, 0.5, 0.9]
BASE = {"model": {"id": "m"}, "task": {"name": "niah", "params": {}}, "question": "aware",
        "prefill": {"mode": "full", "chunk": None}, "samples": 2, "seed": 0}
# policy, budget, ratio, per-depth score -> the needle is found at these depths
CELLS = [("full", None, 1.0, [1, 1, 1]), ("window", 64, 0.1, [0, 0, 1]), ("window", 256, 0.25, [0, 1, 1]),
         ("snapkv", 64, 0.1, [1, 0, 1]), ("snapkv", 256, 0.25, [1, 1, 1]), ("h2o", 512, 0.5, [1, 1, 1])]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def run(tmp_path):
    folder = RunFolder(tmp_path / "run")
    ids = [f"{name}-{budget}-{length}" for name, budget, _, _ in CELLS for length in (512, 1024)] + ["oom-cell"]
    never_ran = {**BASE, "policy": {"name": "tova", "params": {}}, "budget": 64, "context_length": 512}
    folder.open({"name": "synthetic", "config_hash": "h", "started": "t", "cells": [*ids, "never-ran"],
                 "cell_descriptions": {"never-ran": never_ran},
                 "model": {"spec": "m", "layers": 2, "kv_heads": 2, "head_dim": 16}}, force=False)
    for name, budget, ratio, by_depth in CELLS:
        for length in (512, 1024):
            cell_id = f"{name}-{budget}-{length}"
            cell = {**BASE, "policy": {"name": name, "params": {}}, "budget": budget, "context_length": length}
            for index in range(2):
                for depth, score in zip(DEPTHS, by_depth, strict=True):
                    folder.add_record({
                        "cell_id": cell_id, "cell": cell, "sample_id": f"d{depth}-s{index}", "meta": {"depth": depth},
                        "scores": {"score": score}, "prediction": "42" if score else "7", "references": ["42"],
                        "cache_ratio": ratio, "kv_bytes_live": ratio * length * 1024, "kv_bytes_peak": length * 1024,
                        "ttft_s": 0.1, "tpot_s": 0.01, "decode_tok_s": 100 / (1 + ratio), "prefill_tok_s": 1000.0,
                        "mem_peak_alloc": 2**30, "budget_tokens": budget, "scenario": "prompt-heavy",
                    })
            folder.add_cell({"cell_id": cell_id, "cell": cell, "status": "ok"})
    oom = {**BASE, "policy": {"name": "h2o", "params": {}}, "budget": 2048, "context_length": 1024}
    folder.add_cell({"cell_id": "oom-cell", "cell": oom, "status": "oom", "message": "CUDA out of memory"})
    return folder.path


def test_every_figure_is_written_as_png_and_pdf(run):
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    names = {"score_vs_ratio_niah", "score_vs_bytes_niah", "needle_heatmaps_niah", "memory_vs_context",
             "speed_vs_budget", "pareto"}
    for name in names:
        data = (run / "figures" / f"{name}.png").read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, name
    result = runner.invoke(app, ["plot", str(run), "--format", "pdf", "--style", "paper", "--out", str(run / "pdf")])
    assert result.exit_code == 0, result.output
    for name in names:
        data = (run / "pdf" / f"{name}.pdf").read_bytes()
        assert data.startswith(b"%PDF") and len(data) > 5_000 and b"/FontFile2" in data  # TrueType, embedded


def test_curves_plot_the_summary_numbers(run):
    frame = summarize(run, write=False)
    axis = figures(run)["score_vs_ratio_niah"].axes[1]  # the 1024-token panel
    lines = {line.get_label(): line for line in axis.lines}
    for policy in ("window", "snapkv"):
        expected = frame[(frame["policy"] == policy) & (frame["context_length"] == 1024)].sort_values("cache_ratio")
        np.testing.assert_allclose(lines[policy].get_xdata(), expected["cache_ratio"])
        np.testing.assert_allclose(lines[policy].get_ydata(), expected["score"])
    full = frame[(frame["policy"] == "full") & (frame["context_length"] == 1024)]["score"].iloc[0]
    assert lines["full"].get_ydata()[0] == full
    # the oom cell and the cell that never ran leave gaps and say so
    assert any("oom: h2o b=2048" in text.get_text() for text in axis.texts)
    first = figures(run)["score_vs_ratio_niah"].axes[0]
    assert any("missing: tova b=64" in text.get_text() for text in first.texts)
    assert set(frame["status"]) == {"ok", "oom", "missing"}


def test_needle_heatmap_cells_are_mean_scores_by_depth_and_length(run):
    figure = figures(run)["needle_heatmaps_niah"]
    titled = {axis.get_title(): axis for axis in figure.axes if axis.images}
    window = titled["b=64, mean 0.33"]
    np.testing.assert_array_equal(window.images[0].get_array(), [[0, 0], [0, 0], [1, 1]])
    assert window.images[0].get_cmap().name == "RdYlGn"


def test_pareto_front():
    import pandas as pd

    points = pd.DataFrame({"x": [1, 2, 3, 4, 5], "y": [0.1, 0.5, 0.4, 0.9, 0.9]})
    assert pareto_front(points, "x", "y")["x"].tolist() == [1, 2, 4]


def test_recommend_picks_the_smallest_cache_within_the_drop(run):
    frame = summarize(run, write=False)
    choice = recommend(frame, max_drop=2).set_index("context_length")
    # snapkv b=256 (ratio 0.25) never misses; window b=256 and the ratio-0.1 cells do; h2o b=512 is larger
    assert choice.loc[1024, "policy"] == "snapkv" and choice.loc[1024, "budget"] == "256"
    assert choice.loc[1024, "cache_ratio"] == 0.25
    strict = recommend(frame[frame["policy"] != "snapkv"], max_drop=2).set_index("context_length")
    assert strict.loc[1024, "policy"] == "h2o"
    result = runner.invoke(app, ["recommend", str(run)])
    assert result.exit_code == 0 and "snapkv" in result.output


def test_latex_tables_bold_the_best(run):
    text = latex(summarize(run, write=False))
    assert text.count(r"\toprule") == 2 and r"\textbf{0.10}" in text  # smallest cache ratio
    result = runner.invoke(app, ["summarize", str(run), "--latex"])
    assert result.exit_code == 0 and (run / "summary.tex").exists()


def test_report_is_one_offline_file(run):
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6 and "http://" not in page and "https://" not in page
    assert "Failure gallery" in page and "window" in page and "CUDA out of memory" not in page.split("Summary")[0]
    # it opens with the advice per scenario: snapkv at 256 keeps every needle at both lengths in a quarter
    advice = page.split("<h2>Run</h2>")[0]
    assert "What to run, by scenario" in advice and "prompt-heavy (niah): snapkv at 256 scores 1" in advice


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_report_renders_in_headless_chromium(run, tmp_path):
    runner.invoke(app, ["report", str(run)])
    shot = tmp_path / "report.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600", f"--screenshot={shot}",
                    (run / "report.html").as_uri()], check=True, capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 50_000  # a page with tables and figures, not a blank one


def test_plot_bad_input(run, tmp_path):
    assert "unknown format" in runner.invoke(app, ["plot", str(run), "--format", "gif"]).output
    assert runner.invoke(app, ["plot", str(tmp_path / "nothing")]).exit_code == 2
    assert runner.invoke(app, ["plot", str(run), "--style", "comic"]).exit_code == 2


def test_nll_vs_position_curves_from_per_position_nll(tmp_path):
    folder = RunFolder(tmp_path / "ppl")
    folder.open({"name": "ppl", "config_hash": "h", "started": "t", "cells": ["full", "win"]}, force=False)
    for cell_id, name, budget, level in (("full", "full", None, 2.0), ("win", "window", 64, 3.0)):
        cell = {**BASE, "task": {"name": "perplexity", "params": {}}, "policy": {"name": name, "params": {}},
                "budget": budget, "context_length": 400}
        for index in range(2):
            folder.add_record({"cell_id": cell_id, "cell": cell, "sample_id": f"s{index}", "scores": {"score": 0.0},
                               "nll_by_position": [level + index] * 400, "cache_ratio": 0.5, "kv_bytes_live": 1.0,
                               "kv_bytes_peak": 1.0})
        folder.add_cell({"cell_id": cell_id, "cell": cell, "status": "ok"})
    axis = figures(folder.path)["nll_vs_position_perplexity"].axes[0]
    lines = {line.get_label(): line for line in axis.lines}
    np.testing.assert_allclose(lines["full"].get_ydata(), 2.5)  # mean of the two samples, smoothing keeps it flat
    np.testing.assert_allclose(lines["window b=64"].get_ydata(), 3.5)
    assert len(lines["full"].get_xdata()) == 400
