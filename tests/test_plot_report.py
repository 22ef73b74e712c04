"""Figures, report, recommendation and LaTeX from a synthetic run folder (no model needed)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from kvbench.analysis.plot import figures, pareto_front
from kvbench.analysis.report import latex, recommend
from kvbench.analysis.summary import summarize
from kvbench.cli import app
from kvbench.runs.run_folder import RunFolder

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


def make_run(path, name="synthetic", model="m", shift=0.0):
    """A run folder of CELLS at 512 and 1024 tokens, two samples per depth; `shift` moves every cache ratio (a
    second run of the same grid that kept a little more)."""
    folder = RunFolder(path)
    ids = [f"{policy}-{budget}-{length}" for policy, budget, _, _ in CELLS for length in (512, 1024)] + ["oom-cell"]
    never_ran = {**BASE, "model": {"id": model}, "policy": {"name": "tova", "params": {}}, "budget": 64,
                 "context_length": 512}
    folder.open({"name": name, "config_hash": "h", "started": "t", "cells": [*ids, "never-ran"],
                 "cell_descriptions": {"never-ran": never_ran},
                 "model": {"spec": model, "layers": 2, "kv_heads": 2, "head_dim": 16}}, force=False)
    for policy, budget, ratio, by_depth in CELLS:
        ratio = min(1.0, ratio + shift) if policy != "full" else ratio
        for length in (512, 1024):
            cell_id = f"{policy}-{budget}-{length}"
            cell = {**BASE, "model": {"id": model}, "policy": {"name": policy, "params": {}}, "budget": budget,
                    "context_length": length}
            for index in range(2):
                for depth, score in zip(DEPTHS, by_depth, strict=True):
                    folder.add_record({
                        "cell_id": cell_id, "cell": cell, "sample_id": f"d{depth}-s{index}",
                        "meta": {"depth": depth, "needle": "The special magic number for tiger is: 42."},
                        "scores": {"score": score}, "prediction": "42" if score else "7", "references": ["42"],
                        "cache_ratio": ratio, "kv_bytes_live": ratio * length * 1024, "kv_bytes_peak": length * 1024,
                        # a decode step reads what the cache holds, but snapkv's here read half (as a sparse one)
                        "read_ratio": ratio / (2 if policy == "snapkv" else 1),
                        "kv_bytes_read": ratio / (2 if policy == "snapkv" else 1) * length * 64,
                        "ttft_s": 0.1, "tpot_s": 0.01, "decode_tok_s": 100 / (1 + ratio), "prefill_tok_s": 1000.0,
                        "mem_peak_alloc": 2**30, "budget_tokens": budget, "scenario": "prompt-heavy",
                    })
            folder.add_cell({"cell_id": cell_id, "cell": cell, "status": "ok"})
    oom = {**BASE, "model": {"id": model}, "policy": {"name": "h2o", "params": {}}, "budget": 2048,
           "context_length": 1024}
    folder.add_cell({"cell_id": "oom-cell", "cell": oom, "status": "oom", "message": "CUDA out of memory"})
    return folder.path


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path / "run")


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


def test_read_axis_plots_the_bytes_read(run):
    frame = summarize(run, write=False)
    drawn = figures(run, x="read")
    assert {"score_vs_read_niah", "score_vs_read_bytes_niah", "pareto_read"} <= set(drawn)
    lines = {line.get_label(): line for line in drawn["score_vs_read_niah"].axes[1].lines}
    expected = frame[(frame["policy"] == "snapkv") & (frame["context_length"] == 1024)].sort_values("read_ratio")
    np.testing.assert_allclose(lines["snapkv"].get_xdata(), expected["read_ratio"])
    np.testing.assert_allclose(lines["snapkv"].get_xdata(), expected["cache_ratio"] / 2)
    assert "read ratio" in drawn["score_vs_read_niah"].axes[1].get_xlabel()
    result = runner.invoke(app, ["plot", str(run), "--x", "read"])
    assert result.exit_code == 0, result.output
    assert (run / "figures" / "score_vs_read_niah.png").read_bytes().startswith(b"\x89PNG")
    result = runner.invoke(app, ["plot", str(run), "--x", "kept"])
    assert result.exit_code == 2 and "unknown x axis 'kept' (use stored, read)" in result.output


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
    # it opens with the answer: a sentence per task and length, in human units, then the advice per scenario
    answer, rest = page.split("<h2>Figures</h2>")
    sentence = ("<b>niah, 1024 tokens</b>: <b>snapkv</b> at 256 keeps 0.25× of full's KV bytes (768.0 KiB saved) "
                "at 10 ms per token (full: 10 ms); score 1 where full scores 1 (change +0.00, 95% CI [+0.00, +0.00]).")
    assert sentence in answer and "What to run, by scenario" in answer
    assert "prompt-heavy (niah): snapkv at 256 scores 1" in answer
    assert answer.count("data:image/png") == 1 and "alt='score_vs_ratio_niah'" in answer  # beside it: the lead
    # below the figures, every table collapsed and sortable, numbers in units, the oom's message on hover
    tables = rest.split("<h2>Tables</h2>")[1]
    assert tables.count("<details>") == 5 and tables.count("<table class='sortable'>") == 4
    assert "<td data-sort='524288.0'>512.0 KiB</td>" in tables and "<td data-sort='0.01'>10 ms</td>" in tables
    assert "<span title='CUDA out of memory'>oom</span>" in tables
    # the gallery highlights the answer in the needle sentence the record keeps and in full's prediction
    gallery = tables.split("Failure gallery")[1]
    assert "The special magic number for tiger is: <mark>42</mark>." in gallery
    assert "<td class='text'><mark>42</mark></td>" in gallery
    assert "'departure'" in gallery


def test_report_tables_shorten_long_parameters_and_split_by_model(run):
    from kvbench.analysis.report import _short, html_report

    long = "recent_ratio=0.5, storage=quant(bits=4, residual=32)"
    assert _short(long) == f"<span title='{long}'>recent_ratio=0.5, stora…</span>" and _short("bits=4") == \
        "<span>bits=4</span>"
    folder, other = RunFolder(run), RunFolder(make_run(run.parent / "other", model="n"))  # a second model's cells
    for record in other.records():
        folder.add_record({**record, "cell_id": f"n-{record['cell_id']}"})
    manifest = folder.manifest()
    folder.write_manifest({**manifest, "cells": [*manifest["cells"], *(f"n-{cell}" for cell in other.cells())]})
    page = html_report(run).read_text()
    answer = page.split("<h2>Figures</h2>")[0]
    assert "<h3>m</h3>" in answer and "<h3>n</h3>" in answer and answer.count("<li><b>niah, 1024 tokens</b>") == 2


def test_the_gallery_highlights_every_reference():
    from kvbench.analysis.report import highlight

    assert highlight("Paris, then paris<b>", ["paris"]) == "<mark>Paris</mark>, then <mark>paris</mark>&lt;b&gt;"
    assert highlight("12⟦345", ["345", "12345"]) == "12" + \
        "<span class='departure' title='leaves the full cache&#39;s prediction here'>⟦</span><mark>345</mark>"
    assert highlight("no answer", []) == "no answer"


# the page's first screen, in a 1400 x 900 window: what a reader sees before scrolling
SCREEN = (1400, 900)
# loaded before the page's own script: records script errors, failed loads and console errors, then (on load) the
# boxes of the advice and of the first figure, the images that did not load, and whether sorting works
PROBE = """<script>
const problems = [];
addEventListener("error", e => problems.push(e.message || "failed to load a " + e.target.tagName), true);
const consoleError = console.error;
console.error = (...parts) => { problems.push(parts.join(" ")); consoleError(...parts); };
addEventListener("load", () => {
  const box = element => { const r = element.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
  const images = [...document.images];
  const summary = [...document.querySelectorAll("table.sortable")][1];
  const peak = [...summary.tHead.rows[0].cells].find(cell => cell.textContent === "KV peak");
  peak.click();
  const sorted = [...summary.tBodies[0].rows].map(row => row.cells[peak.cellIndex].dataset.sort);
  document.body.dataset.probe = JSON.stringify({
    problems, broken: images.filter(image => !image.complete || image.naturalWidth === 0).length,
    images: images.length, advice: box(document.querySelector("#answer .advice")), figure: box(images[0]),
    advice_text: document.querySelector("#answer .advice").innerText, sorted});
});
</script>"""


def _chromium(tmp_path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
                           f"--window-size={SCREEN[0]},{SCREEN[1]}", *arguments],
                          check=True, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_report_renders_in_headless_chromium(run, tmp_path):
    import html
    import json
    import re

    from PIL import Image

    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    page = (run / "report.html").read_text()
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("<meta charset='utf-8'>", "<meta charset='utf-8'>" + PROBE, 1))
    dom = _chromium(tmp_path, "--dump-dom", probed.as_uri()).stdout
    probe = json.loads(html.unescape(re.search(r'data-probe="([^"]*)"', dom).group(1)))
    assert probe["problems"] == [] and probe["broken"] == 0 and probe["images"] == 6
    # the first screen shows the whole recommendation and at least half of the first figure
    left, top, width, height = probe["advice"]
    assert top + height <= SCREEN[1] and "snapkv at 256 keeps 0.25×" in probe["advice_text"]
    left, top, width, height = probe["figure"]
    assert width > 300 and top + height / 2 <= SCREEN[1]
    # a click on "KV peak" sorts by bytes (512 KiB before 1 MiB, which text order would not), blanks last
    sort_keys = [float(key) if key else None for key in probe["sorted"]]
    peaks = [key for key in sort_keys if key is not None]
    assert peaks == sorted(peaks) and len(set(peaks)) == 2 and sort_keys[-2:] == [None, None]

    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", (run / "report.html").as_uri())
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (SCREEN[1], SCREEN[0]) and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 1
    figure = pixels[int(top):int(min(top + height, SCREEN[1])), int(left):int(left + width)]
    drawn = (figure.reshape(-1, 3) < 200).any(axis=1).mean()  # share of the figure that is not white or near it
    assert 0.02 < drawn < 0.9 and len(np.unique(figure.reshape(-1, 3), axis=0)) > 50  # lines, bands, text


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


def test_the_drop_allowed_is_said_in_the_task_s_unit():
    from kvbench.analysis.report import tolerance

    assert tolerance(2, higher_is_better=True) == "2 points"
    assert tolerance(2, higher_is_better=False) == "2% of full's value"  # perplexity: relative to full's


# every built-in policy's colour as plot.py gave it before the colours moved to the policies' own files, and two
# names no policy has (a plugin's, picked from the palette by its name)
COLOURS = {
    "ada_kv": "#DDCC77", "adaptive": "#332288", "chunkkv": "#44AA99", "compose": "#661100", "criticalkv": "#F0E442",
    "duoattention": "#999999", "expected_attention": "#009E73", "expected_attention_stats": "#56B4E9",
    "full": "#000000", "h2o": "#009E73",
    "hybrid": "#44AA99", "keydiff": "#56B4E9", "knorm": "#117733", "kvzip": "#CC79A7", "kvzip_plus": "#F0E442",
    "kvzap": "#DDCC77", "lagkv": "#999999",
    "lowrank": "#F0E442", "merge": "#88CCEE", "mixed_precision": "#CC79A7", "pyramidkv": "#332288",
    "qfilter": "#661100", "quant": "#D55E00", "quest": "#CC3311", "random": "#999999", "razorattention": "#332288",
    "rkv": "#332288",
    "scissorhands": "#AA4499", "simlayerkv": "#009E73", "snapkv": "#0072B2", "streaming_llm": "#56B4E9",
    "think": "#882255", "tova": "#882255", "whole_segments": "#CC6677", "window": "#E69F00", "my_plugin": "#661100",
    "foo": "#56B4E9",
}


def test_every_policy_keeps_its_colour():
    from kvbench.analysis.plot import policy_colour
    from kvbench.policies import POLICIES

    # the built-in ones (other test files register plugins in the same process)
    assert {name for name in POLICIES.names() if POLICIES.get(name).__module__.startswith("kvbench.policies.")} \
        <= set(COLOURS)
    assert {name: policy_colour(name) for name in COLOURS} == COLOURS


def test_a_policy_declares_its_own_colour(monkeypatch):
    from kvbench.analysis.plot import policy_colour
    from kvbench.policies import POLICIES
    from kvbench.policies.streaming_llm import StreamingLLM

    class Painted(StreamingLLM):
        name = "painted"
        colour = "#123456"

    class Unpainted(Painted):  # a subclass is another policy: it does not take its parent's colour
        name = "unpainted"

    for cls in (Painted, Unpainted):
        monkeypatch.setitem(POLICIES._entries, cls.name, cls)
    assert policy_colour("painted") == "#123456"
    assert policy_colour("unpainted") != "#123456"
