"""The gate on constructed run folders where the right verdict is known."""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.runs.run_folder import RunFolder

runner = CliRunner()
BASE_CELL = {"model": {"id": "m"}, "task": {"name": "niah", "params": {}}, "context_length": 512,
             "question": "aware", "prefill": {"mode": "full", "chunk": None}, "samples": 8, "seed": 0}


def make_run(path: Path, cells: dict[str, dict], config_hash: str = "h1") -> Path:
    """cells: id -> {policy, budget, scores, kv_peak, decode_tok_s}"""
    folder = RunFolder(path)
    folder.open({"name": "t", "config_hash": config_hash, "started": "t", "cells": sorted(cells)}, force=False)
    for cell_id, spec in cells.items():
        cell = {**BASE_CELL, "policy": {"name": spec["policy"], "params": {}}, "budget": spec.get("budget")}
        for index, score in enumerate(spec["scores"]):
            folder.add_record({
                "cell_id": cell_id, "cell": cell, "sample_id": f"s{index}", "scores": {"score": score},
                "prediction": spec.get("prediction", "123"), "kv_bytes_peak": spec.get("kv_peak", 1000),
                "cache_ratio": 0.5, "decode_tok_s": spec.get("decode_tok_s", 100.0), "prefill_tok_s": 1000.0,
                "higher_is_better": spec.get("higher_is_better", True),
                **({"kl_mean": spec["kl"][index]} if "kl" in spec else {}),
            })
        folder.add_cell({"cell_id": cell_id, "cell": cell, "status": "ok"})
    return path


def cells(window_scores=(1,) * 8, **window):
    return {"full": {"policy": "full", "scores": [1] * 8},
            "win": {"policy": "window", "budget": 64, "scores": list(window_scores), **window}}


def run_gate(tmp_path, baseline_cells, run_cells, *options, run_hash="h1"):
    make_run(tmp_path / "base", baseline_cells)
    made = runner.invoke(app, ["baseline", str(tmp_path / "base"), "--out", str(tmp_path / "baseline.json")])
    assert made.exit_code == 0, made.output
    make_run(tmp_path / "run", run_cells, config_hash=run_hash)
    return runner.invoke(app, ["gate", str(tmp_path / "run"), "--baseline", str(tmp_path / "baseline.json"),
                               *options])


def test_identical_run_passes(tmp_path):
    result = run_gate(tmp_path, cells(), cells())
    assert result.exit_code == 0 and "all 4 checks passed" in result.output  # 2 cells, each policy pooled


def test_a_real_drop_fails(tmp_path):
    result = run_gate(tmp_path, cells(), cells(window_scores=[0] * 8), "--junit", str(tmp_path / "j.xml"),
                      "--markdown", str(tmp_path / "m.md"))
    assert result.exit_code == 1 and "score dropped 100.0 points" in (tmp_path / "m.md").read_text()
    suite = ElementTree.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "2" and suite.get("tests") == "4"  # the cell and its policy's pool
    assert "FAILED (2 of 4 checks failed)" in (tmp_path / "m.md").read_text()


def test_a_drop_within_noise_passes(tmp_path):
    noisy = run_gate(tmp_path, cells(window_scores=[1, 0, 1, 0, 1, 0, 1, 0]),
                     cells(window_scores=[0, 0, 1, 0, 1, 0, 1, 0]))
    assert noisy.exit_code == 0, noisy.output


def test_memory_growth_fails_beyond_the_limit(tmp_path):
    assert run_gate(tmp_path, cells(kv_peak=1000), cells(kv_peak=1100)).exit_code == 1
    small = run_gate(tmp_path / "b", cells(kv_peak=1000), cells(kv_peak=1030))
    assert small.exit_code == 0
    loose = run_gate(tmp_path / "c", cells(kv_peak=1000), cells(kv_peak=1100), "--max-mem-increase", "15%")
    assert loose.exit_code == 0


def test_speed_ratio_regression_fails_but_absolute_time_alone_passes(tmp_path):
    slower_cell = cells(decode_tok_s=50.0)  # full stays at 100: the ratio falls from 0.8 to 0.5
    report = tmp_path / "report.md"
    result = run_gate(tmp_path, cells(decode_tok_s=80.0), slower_cell, "--max-slowdown", "20%", "--markdown",
                      str(report))
    assert result.exit_code == 1 and "decode_tok_s vs full fell from 0.80x to 0.50x" in report.read_text()
    whole_machine_slower = cells(decode_tok_s=40.0)
    whole_machine_slower["full"]["decode_tok_s"] = 50.0  # everything twice as slow: same ratio
    assert run_gate(tmp_path / "b", cells(decode_tok_s=80.0), whole_machine_slower, "--max-slowdown", "20%") \
        .exit_code == 0
    assert run_gate(tmp_path / "c", cells(decode_tok_s=80.0), slower_cell).exit_code == 0  # speed not gated


def test_missing_cells_are_reported_and_fail_only_with_strict(tmp_path):
    fewer = {"full": cells()["full"]}
    result = run_gate(tmp_path, cells(), fewer)
    assert result.exit_code == 0 and "missing" in result.output
    assert run_gate(tmp_path / "b", cells(), fewer, "--strict").exit_code == 1


def test_changed_predictions_are_reported(tmp_path):
    result = run_gate(tmp_path, cells(), cells(prediction="456"), "--markdown", str(tmp_path / "m.md"))
    assert result.exit_code == 0 and "8/8 predictions changed" in (tmp_path / "m.md").read_text()


@pytest.mark.parametrize("args,culprit", [
    (["--max-mem-increase", "lots"], "--max-mem-increase 'lots'"),
    (["--baseline", "/no/such.json"], "baseline not found"),
])
def test_bad_gate_input(tmp_path, args, culprit):
    make_run(tmp_path / "run", cells())
    runner.invoke(app, ["baseline", str(tmp_path / "run"), "--out", str(tmp_path / "b.json")])
    base = ["gate", str(tmp_path / "run"), "--baseline", str(tmp_path / "b.json")]
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2 and culprit in result.output


def test_a_baseline_from_another_config_is_a_clear_error(tmp_path):
    result = run_gate(tmp_path, cells(), cells(), run_hash="other")
    assert result.exit_code == 2 and "another config" in result.output


def test_a_perplexity_rise_is_a_drop():
    from kvbench.analysis.gate import improvement

    assert improvement(0.5, 0.4, higher_is_better=True) == pytest.approx(-10)  # points of a fraction
    assert improvement(10.0, 10.5, higher_is_better=False) == pytest.approx(-5)  # perplexity +5%
    assert improvement(10.0, 9.0, higher_is_better=False) == pytest.approx(10)


def test_gate_fails_a_perplexity_that_rises(tmp_path):
    ppl = {"full": {"policy": "full", "scores": [10.0] * 8, "higher_is_better": False},
           "win": {"policy": "window", "budget": 64, "scores": [12.0] * 8, "higher_is_better": False}}
    worse = {**ppl, "win": {**ppl["win"], "scores": [13.0] * 8}}
    assert run_gate(tmp_path / "same", ppl, ppl).exit_code == 0
    result = run_gate(tmp_path / "worse", ppl, worse)
    assert result.exit_code == 1 and "-8.3" in result.output and "2 of 4 checks failed" in result.output
    better = {**ppl, "win": {**ppl["win"], "scores": [11.0] * 8}}
    assert run_gate(tmp_path / "better", ppl, better).exit_code == 0


def test_recommend_reads_perplexity_the_right_way_round(tmp_path):
    from kvbench.analysis.report import recommend
    from kvbench.analysis.summary import summarize

    close = {"full": {"policy": "full", "scores": [10.0, 10.2] * 4, "higher_is_better": False},
             "win": {"policy": "window", "budget": 64, "scores": [10.05, 10.25] * 4, "higher_is_better": False}}
    choice = recommend(summarize(make_run(tmp_path / "close", close), write=False), max_drop=1).iloc[0]
    assert choice["policy"] == "window"  # perplexity +0.5%: within 1 point
    far = {**close, "win": {**close["win"], "scores": [11.0, 11.2] * 4}}
    choice = recommend(summarize(make_run(tmp_path / "far", far), write=False), max_drop=1).iloc[0]
    assert choice["policy"] is None  # +10%


def test_the_committed_baseline_matches_the_gate_config():
    import json

    from kvbench.config.schema import load_config

    root = Path(__file__).resolve().parent.parent
    baseline = json.loads((root / "baselines" / "gate.json").read_text())
    assert load_config(root / "configs" / "gate.yaml").result_hash() == baseline["config_hash"]


def test_task_specs_that_share_a_name_are_told_apart():
    from kvbench.analysis.summary import task_key, task_labels

    exact = {"name": "perplexity", "params": {"mode": "exact"}}
    chunked = {"name": "perplexity", "params": {"chunk": 64, "mode": "chunked"}}
    niah = {"name": "niah", "params": {"depths": [0.5]}}
    labels = task_labels([exact, chunked, niah, exact])
    assert labels[task_key(exact)] == "perplexity (mode=exact)"
    assert labels[task_key(chunked)] == "perplexity (chunk=64, mode=chunked)"
    assert labels[task_key(niah)] == "niah"  # alone: just its name


def test_each_cell_says_the_smallest_drop_it_could_detect(tmp_path):
    from kvbench.analysis.gate import detectable_drop

    assert detectable_drop(2, 1.0) == 100.0  # two 0/1 samples: only both falling is a supported drop
    assert detectable_drop(8, 1.0) == 50.0 and detectable_drop(1, 100.0) is None
    result = run_gate(tmp_path / "a", cells(), cells(), "--markdown", str(tmp_path / "m.md"))
    assert result.exit_code == 0 and "detects a drop of >= 50 points" in (tmp_path / "m.md").read_text()
    assert "cannot detect a drop of 1 points" in result.output  # a warning, not a failure
    strict = run_gate(tmp_path / "b", cells(), cells(), "--require-power")
    assert strict.exit_code == 2 and "cannot detect a drop of 1 points" in strict.output


def ci_like_cells() -> dict[str, dict]:
    """The committed CI baseline's cells (baselines/gate.json: 7 policies and full, 2 needles per cell, few of
    them found) as constructed cells with the same per-sample scores."""
    import json

    baseline = json.loads((Path(__file__).parent.parent / "baselines" / "gate.json").read_text())
    out = {}
    for cell_id, cell in baseline["cells"].items():
        if "samples" in cell:
            policy = cell["label"].split()[3].split("(")[0]
            out[cell_id] = {"policy": policy, "budget": cell["label"].split("b=")[-1] if "b=" in cell["label"] else
                            None, "scores": [cell["samples"][s] for s in sorted(cell["samples"])],
                            "kv_peak": cell["kv_bytes_peak"]}
    return out


def broken(cells_: dict[str, dict], how: str) -> dict[str, dict]:
    out = {cell_id: dict(spec) for cell_id, spec in cells_.items()}
    for spec in out.values():
        if how == "zeroed" and spec["policy"] != "full":
            spec["scores"] = [0] * len(spec["scores"])
        if how == "inverted" and spec["policy"] == "h2o":  # evicting its best entries: other answers, lost needles
            spec["scores"], spec["prediction"] = [0] * len(spec["scores"]), "4"
    if how == "kv+10%":
        first = sorted(out)[0]
        out[first]["kv_peak"] = out[first]["kv_peak"] * 1.1
    return out


@pytest.mark.parametrize("how", ["zeroed", "inverted", "kv+10%"])
def test_the_ci_gate_fails_each_broken_run(tmp_path, how):
    """With .ci/run's options, on the committed baseline's score pattern, each way of breaking the run fails."""
    ci = ci_like_cells()
    options = ("--max-drop", "1", "--max-mem-increase", "5%", "--strict-predictions")
    assert run_gate(tmp_path / "same", ci, ci, *options).exit_code == 0
    result = run_gate(tmp_path / how, ci, broken(ci, how), *options, "--markdown", str(tmp_path / "m.md"))
    assert result.exit_code == 1, result.output
    failed = [line for line in (tmp_path / "m.md").read_text().splitlines() if "| fail |" in line]
    if how == "zeroed":  # the run's pool shows it, whichever single cells of two needles can
        assert any("pooled: every policy but full" in line for line in failed)


def test_a_rise_of_kl_from_the_full_cache_fails_where_scores_cannot_show_it(tmp_path):
    base = cells(kl=[0.10, 0.12, 0.08, 0.11, 0.09, 0.10, 0.13, 0.07])
    slightly = cells(kl=[k + 0.001 for k in base["win"]["kl"]])
    worse = cells(kl=[k + 0.2 for k in base["win"]["kl"]])
    options = ("--max-kl-increase", "0.01", "--markdown", str(tmp_path / "m.md"))
    assert run_gate(tmp_path / "same", base, slightly, *options).exit_code == 0
    result = run_gate(tmp_path / "worse", base, worse, *options)
    assert result.exit_code == 1 and "KL from the full cache rose +0.2000" in (tmp_path / "m.md").read_text()
    assert run_gate(tmp_path / "unchecked", base, worse).exit_code == 0  # the scores alone did not move
