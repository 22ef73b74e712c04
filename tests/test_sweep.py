from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from kvbench.analysis.summary import summarize
from kvbench.cli import app
from kvbench.config.cells import expand
from kvbench.config.schema import load_config
from kvbench.runs.run_folder import RunFolder
from tests.helpers import assert_rejected_in_one_line

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
# columns that depend only on the records' scores and cache accounting, not on timing
STABLE = ["cell_id", "policy", "params", "budget", "context_length", "n", "score", "score_ci_low", "score_ci_high",
          "delta_vs_full", "delta_ci_low", "delta_ci_high", "cache_ratio", "kv_bytes_live", "kv_bytes_peak", "status"]
TINY = {
    "name": "tiny",
    "model": {"id": "random:tiny-llama", "dtype": "float32", "device": "cpu"},
    "policies": ["full", "window", {"name": "h2o", "recent_ratio": 0.5}, {"name": "snapkv", "window": 8}],
    "budgets": [32, 0.5],
    "context_lengths": [300],
    "tasks": [{"name": "niah", "depths": [0.3, 0.7]}],
    "samples": 2,
    "max_new_tokens": 3,
}


def write_config(folder: Path, config: dict, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def sweep(config: Path, output: Path, *extra: str):
    result = runner.invoke(app, ["sweep", str(config), "-o", str(output), "-q", *extra])
    assert result.exit_code == 0, result.output
    return result


def sweep_until(config: Path, run: Path, records: int) -> subprocess.Popen:
    """Start a sweep in a subprocess and return once it has written `records` records."""
    process = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "sweep", str(config), "-o", str(run), "-q"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    path, deadline = run / "records.jsonl", time.time() + 120
    while time.time() < deadline and (not path.exists() or path.read_text().count("\n") < records):
        time.sleep(0.01)
    return process


def records_by_key(folder: Path) -> dict[tuple[str, str], dict]:
    rows = RunFolder(folder).records()
    keys = [(r["cell_id"], r["sample_id"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (cell, sample) was recorded twice"
    return dict(zip(keys, rows, strict=True))


def test_cell_ids_do_not_depend_on_yaml_order(tmp_path):
    reordered = {**TINY, "policies": list(reversed(TINY["policies"])), "budgets": [0.5, 32]}
    reordered = dict(reversed(list(reordered.items())))
    first = {c.id for c in expand(load_config(write_config(tmp_path, TINY, "a.yaml")))}
    second = {c.id for c in expand(load_config(write_config(tmp_path, reordered, "b.yaml")))}
    assert first == second and len(first) == 1 + 3 * 2


def test_sweep_writes_the_run_folder_and_a_rerun_runs_nothing(tmp_path):
    config = write_config(tmp_path, TINY)
    sweep(config, tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config_hash"] and manifest["environment"]["torch"] and manifest["finished"]
    assert len(RunFolder(tmp_path / "run").records()) == 7 * 4  # 2 samples x 2 depths
    assert {s["status"] for s in RunFolder(tmp_path / "run").cells().values()} == {"ok"}
    frame = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert len(frame) == 7 and "score_ci_low" in frame and "delta_vs_full" in frame
    assert "| policy |" in (tmp_path / "run" / "summary.md").read_text()
    before = (tmp_path / "run" / "records.jsonl").read_bytes()
    started = time.perf_counter()
    sweep(config, tmp_path / "run")
    assert (tmp_path / "run" / "records.jsonl").read_bytes() == before
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("policies", [TINY["policies"], ["full", "tova", {"name": "knorm", "decode": True},
                                                        {"name": "scissorhands", "history": 8, "recent": 4},
                                                        {"name": "ada_kv", "base": {"name": "snapkv", "window": 8}},
                                                        {"name": "hybrid", "prefill": {"name": "snapkv", "window": 8}},
                                                        {"name": "adaptive", "limit_bytes": 40000, "fallback": "h2o"}]])
def test_shared_prefill_gives_the_records_of_cells_run_alone(tmp_path, policies):
    config = write_config(tmp_path, {**TINY, "policies": policies, "question": ["aware", "agnostic"]})
    sweep(config, tmp_path / "shared")
    sweep(config, tmp_path / "alone", "--no-share")
    shared, alone = records_by_key(tmp_path / "shared"), records_by_key(tmp_path / "alone")
    assert shared.keys() == alone.keys()
    assert any(r["prefill_shared"] for r in shared.values()) and not any(r["prefill_shared"] for r in alone.values())
    for key, record in shared.items():
        for field in ("prediction", "scores", "kv_bytes_live", "kv_bytes_full", "kept_max_ever", "evictions",
                      "generated_tokens"):
            assert record[field] == alone[key][field], (key, field)
        # a shared cell gathers what it keeps straight into buffers of the size it keeps: never more bytes than
        # alone (but adaptive, active once the cache holds enough bytes, sizes its buffers alone as the prompt
        # arrives and shared from the whole prompt: the two differ by its headroom either way)
        if record["cell"]["policy"]["name"] != "adaptive":
            for field in ("kv_bytes_physical", "kv_bytes_peak"):
                assert record[field] <= alone[key][field], (key, field)


def test_killed_sweep_resumes_to_the_uninterrupted_result(tmp_path):
    config = write_config(tmp_path, {**TINY, "context_lengths": [300, 700], "samples": 4})
    run = tmp_path / "run"
    process = sweep_until(config, run, records=6)
    records = run / "records.jsonl"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = records.read_text().count("\n")
    assert 6 <= killed_at < 2 * 7 * 8, "the kill should land mid-run"
    with records.open("a") as handle:  # what a kill during a write leaves behind
        handle.write('{"cell_id": "abc", "sample_')
    sweep(config, run)
    sweep(config, tmp_path / "straight")
    resumed, straight = records_by_key(run), records_by_key(tmp_path / "straight")
    assert resumed.keys() == straight.keys() and len(resumed) == 2 * 7 * 8
    columns = lambda folder: summarize(folder, write=False)[STABLE].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(columns(run), columns(tmp_path / "straight"))


def test_a_failing_cell_is_recorded_and_the_others_finish(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "broken.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import torch
        from kvbench.policies import Policy, register

        @register
        @dataclass
        class Crashes(Policy):
            """Fails when it must evict."""
            name = "crashes"
            def score(self, layer, budget):
                raise RuntimeError("impossible parameter at run time")

        @register
        @dataclass
        class Oom(Policy):
            """Simulates running out of device memory."""
            name = "oom"
            def score(self, layer, budget):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    '''))
    config = write_config(tmp_path, {**TINY, "policies": ["full", "crashes", "oom", "window"], "budgets": [32]})
    result = runner.invoke(app, ["sweep", str(config), "-o", str(tmp_path / "run"), "-q", "--plugins", str(plugins)])
    assert result.exit_code == 1 and "sweep failed: 1 error, 2 ok, 1 oom" in result.output  # a CI job fails
    statuses = {s["cell"]["policy"]["name"]: s for s in RunFolder(tmp_path / "run").cells().values()}
    assert statuses["crashes"]["status"] == "error" and "impossible parameter" in statuses["crashes"]["message"]
    assert statuses["oom"]["status"] == "oom" and "out of memory" in statuses["oom"]["message"]
    assert statuses["full"]["status"] == statuses["window"]["status"] == "ok"
    frame = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert set(frame["status"]) == {"ok", "error", "oom"}


def test_shards_merge_into_the_full_run(tmp_path):
    config = write_config(tmp_path, TINY)
    sweep(config, tmp_path / "s0", "--shard", "0/2")
    sweep(config, tmp_path / "s1", "--shard", "1/2")
    assert 0 < len(RunFolder(tmp_path / "s0").cells()) < 7
    result = runner.invoke(app, ["merge", str(tmp_path / "merged"), str(tmp_path / "s0"), str(tmp_path / "s1")])
    assert result.exit_code == 0, result.output
    sweep(config, tmp_path / "whole")
    assert records_by_key(tmp_path / "merged").keys() == records_by_key(tmp_path / "whole").keys()
    merged, whole = (summarize(tmp_path / name, write=False)[STABLE] for name in ("merged", "whole"))
    pd.testing.assert_frame_equal(merged.reset_index(drop=True), whole.reset_index(drop=True))


def test_a_changed_config_is_refused_unless_forced(tmp_path):
    sweep(write_config(tmp_path, TINY), tmp_path / "run")
    changed = write_config(tmp_path, {**TINY, "budgets": [32, 64]}, "changed.yaml")
    result = runner.invoke(app, ["sweep", str(changed), "-o", str(tmp_path / "run"), "-q"])
    assert result.exit_code == 2 and "different config" in result.output
    before = len(RunFolder(tmp_path / "run").records())
    sweep(changed, tmp_path / "run", "--force")
    after = RunFolder(tmp_path / "run").records()
    assert len(after) == before + 3 * 4  # only the new budget's cells ran
    assert len(summarize(tmp_path / "run", write=False)) == 1 + 3 * 2


def test_include_and_set_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({k: v for k, v in TINY.items() if k != "name"}))
    config = tmp_path / "child.yaml"
    config.write_text("include: base.yaml\nname: child\nbudgets: [16]\n")
    loaded = load_config(config, ["context_lengths=[128,256]", "model.dtype=bfloat16", "policies.0=window"])
    assert loaded.budgets == [16] and loaded.context_lengths == [128, 256] and loaded.model.dtype == "bfloat16"
    assert loaded.model.id == "random:tiny-llama" and loaded.name == "child"


def test_dry_run_prints_grid_and_estimate(tmp_path):
    result = runner.invoke(app, ["sweep", str(write_config(tmp_path, TINY)), "-o", str(tmp_path / "r"), "--dry-run"])
    assert result.exit_code == 0 and "7 cells" in result.output and "estimated time" in result.output
    assert not (tmp_path / "r").exists()


BAD = [
    ("name: x\nmodel: m\npolicies: [full]\nbudgets: [1]\ncontext_lengths: [9]\ntasks: [niah]\nfoo: 1\n",
     ":7: foo: unknown key 'foo'"),
    ("name: x\nmodel: {id: m, dtyp: float32}\npolicies: [full]\nbudgets: [1]\ncontext_lengths: [9]\ntasks: [niah]\n",
     ":2: model.dtyp: unknown key 'dtyp'"),
    ("name: x\npolicies: [full, h3o]\nbudgets: [1]\ncontext_lengths: [9]\ntasks: [niah]\n",
     ":2: policies[1].name: unknown policy 'h3o'"),
    ("name: x\npolicies: [{name: h2o, recent: 3}]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\n",
     "has no parameter 'recent'"),
    ("name: x\npolicies: [window]\nbudgets: [64, -5]\ncontext_lengths: [9]\ntasks: [niah]\n",
     ":3: budgets: budget must be a positive token count"),
    ("name: x\npolicies: [window]\nbudgets: [1.5]\ncontext_lengths: [9]\ntasks: [niah]\n",
     ":3: budgets"),
    ("name: x\npolicies: []\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\n",
     ":2: policies: List should have at least 1 item"),
    ("name: x\npolicies: [window\nbudgets: [8]\n", "malformed YAML"),
    ("name: x\npolicies: [snapkv]\nbudgets: [16]\ncontext_lengths: [9]\ntasks: [niah]\n",
     "budgets: snapkv: budget 16 must exceed the observation window"),
    ("name: x\npolicies: [window]\nbudgets: [8]\ncontext_lengths: [0]\ntasks: [niah]\n", "context_lengths"),
    ("name: x\npolicies: [window]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [{name: niah, depths: [2]}]\n",
     ":5: tasks[0].name: task 'niah' parameter 'depths'"),
    ("name: x\npolicies: [window]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\nquestion: sideways\n",
     ":6: question[0]: Input should be 'aware' or 'agnostic'"),
    ("policies: [window]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\n", "missing key 'name'"),
    ("- just\n- a list\n", "a config must be a mapping"),
    ("include: nowhere.yaml\nname: x\n", "config file not found"),
    ("name: x\npolicies: [{name: h2o, storage: {zip: {}}}]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\n",
     ":2: policies[0].name: unknown policy 'zip'"),
    ("name: x\npolicies: [{name: h2o, budget: 8, budgets: [9]}]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\n",
     "give 'budget' or 'budgets', not both"),
    ("name: x\npolicies: [ada_kv]\nbudgets: [64]\ncontext_lengths: [9]\ntasks: [niah]\nprefill: {mode: chunked}\n",
     ":2: policies[0].name: policy 'ada_kv' compresses the prompt once"),
]


@pytest.mark.parametrize("text,culprit", BAD)
def test_bad_configs_are_one_line_errors_with_exit_2(tmp_path, text, culprit):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert_rejected_in_one_line(path, culprit, tmp_path / "run")


def test_bad_set_and_missing_config(tmp_path):
    path = write_config(tmp_path, TINY)
    result = runner.invoke(app, ["validate", str(path), "--set", "budgets"])
    assert result.exit_code == 2 and "key=value" in result.output
    result = runner.invoke(app, ["validate", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2 and "config file not found" in result.output


def test_corrupted_record_line_names_file_and_line(tmp_path):
    config = write_config(tmp_path, TINY)
    sweep(config, tmp_path / "run")
    lines = (tmp_path / "run" / "records.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "{not json\n"
    (tmp_path / "run" / "records.jsonl").write_text("".join(lines))
    result = runner.invoke(app, ["sweep", str(config), "-o", str(tmp_path / "run"), "-q"])
    assert result.exit_code == 2 and "records.jsonl:3: corrupted result line" in result.output


def test_paired_delta_and_bootstrap_ci(tmp_path):
    folder = RunFolder(tmp_path)
    folder.open({"config_hash": "h", "started": "t", "cells": ["f", "p"]}, force=False)
    base = {"model": "m", "task": {"name": "t", "params": {}}, "context_length": 9, "question": "aware",
            "prefill": {"mode": "full", "chunk": None}, "samples": 4, "seed": 0}
    for cell_id, name, budget, scores in (("f", "full", None, [1, 1, 1, 0]), ("p", "window", 8, [1, 0, 1, 0])):
        cell = {**base, "policy": {"name": name, "params": {}}, "budget": budget}
        for index, score in enumerate(scores):
            folder.add_record({"cell_id": cell_id, "cell": cell, "sample_id": f"s{index}", "scores": {"score": score},
                               "budget_tokens": budget, "cache_ratio": 1.0})
        folder.add_cell({"cell_id": cell_id, "cell": cell, "status": "ok"})
    frame = summarize(tmp_path).set_index("policy")
    assert frame.loc["window", "score"] == 0.5 and frame.loc["window", "delta_vs_full"] == -0.25
    assert frame.loc["window", "delta_ci_low"] == -0.75 and frame.loc["window", "delta_ci_high"] == 0.0
    assert frame.loc["full", "score_ci_low"] <= 0.75 <= frame.loc["full", "score_ci_high"]
    assert summarize(tmp_path).equals(summarize(tmp_path))  # deterministic


def test_ctrl_c_stops_after_the_sample_in_flight(tmp_path):
    config = write_config(tmp_path, {**TINY, "context_lengths": [300, 700], "samples": 4})
    run = tmp_path / "run"
    process = sweep_until(config, run, records=4)
    records = run / "records.jsonl"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "run the same command again to resume" in err
    text = records.read_text()
    assert text.endswith("\n") and text.count("\n") < 2 * 7 * 8  # stopped cleanly, early
    assert (run / "summary.csv").exists()
    sweep(config, run)
    assert len(records_by_key(run)) == 2 * 7 * 8


@pytest.mark.parametrize("name", ["smoke", "llama8b", "llama7b", "ci", "gate", "bytes", "lmeval"])
def test_shipped_configs_validate(name):
    result = runner.invoke(app, ["validate", str(ROOT / "configs" / f"{name}.yaml")])
    assert result.exit_code == 0, result.output


def test_ci_config_runs_on_a_random_model(tmp_path):
    sweep(ROOT / "configs" / "ci.yaml", tmp_path / "ci")
    assert {s["status"] for s in RunFolder(tmp_path / "ci").cells().values()} == {"ok"}


def test_every_task_family_runs_in_a_sweep(tmp_path):
    (tmp_path / "lb").mkdir()
    (tmp_path / "lb" / "trec.jsonl").write_text(json.dumps({
        "input": "Question: Who ?\nType:", "context": "Question: Where ?\nType: City\n" * 30, "answers": ["City"],
        "length": 300, "dataset": "trec", "language": "en", "all_classes": ["City"], "_id": "t0"}) + "\n")
    config = {**TINY, "policies": ["full", "window"], "budgets": [0.5], "context_lengths": [900], "samples": 1,
              "tasks": [{"name": "perplexity", "chunk": 32}, {"name": "ruler", "subtasks": ["vt", "fwe"]},
                        {"name": "dialogue", "facts": 2, "passage_tokens": 100, "reply_tokens": 4},
                        {"name": "longbench", "datasets": ["trec"], "data_dir": str(tmp_path / "lb")}]}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    frame = summarize(tmp_path / "run")
    assert set(frame["task"]) == {"perplexity", "ruler", "dialogue", "longbench"} and (frame["status"] == "ok").all()
    assert frame.groupby("task")["higher_is_better"].all().to_dict()["perplexity"] is False
    assert {"score_ppl_past_budget", "score_vt", "score_fwe", "score_trec"} <= set(frame.columns)
    window_ppl = frame[(frame["task"] == "perplexity") & (frame["policy"] == "window")].iloc[0]
    assert window_ppl["score"] > 1 and not pd.isna(window_ppl["delta_vs_full"])
    assert "perplexity, 900 tokens, question aware, prefill full (score: lower is better)" in (
        tmp_path / "run" / "summary.md").read_text()
    records = RunFolder(tmp_path / "run").records()
    assert all(len(r["nll_by_position"]) == 899 for r in records if r["task"]["name"] == "perplexity")
    assert all(r["prompt_tokens"] > 0 and "references" in r for r in records)


def test_trace_saves_each_samples_memory_series(tmp_path):
    config = {**TINY, "policies": ["full", "window"], "budgets": [32], "samples": 1}
    sweep(write_config(tmp_path, config), tmp_path / "run", "--trace")
    traces = sorted((tmp_path / "run" / "traces").glob("*.jsonl"))
    assert len(traces) == 2
    line = json.loads(traces[0].read_text().splitlines()[0])
    assert line["sample_id"].startswith("niah-") and line["traces"][0]["columns"] == ["seconds", "bytes"]
    assert len(line["traces"][0]["rows"]) >= 2


def test_speed_cells_warm_up_repeat_and_keep_the_median(tmp_path, monkeypatch):
    import kvbench.runs.sweep

    calls = []
    real = kvbench.runs.sweep.evaluate
    monkeypatch.setattr(kvbench.runs.sweep, "evaluate", lambda *a, **k: calls.append(k["shared"]) or real(*a, **k))
    config = {**TINY, "policies": ["full", "window"], "budgets": [32], "samples": 1,
              "timing": {"warmup": 1, "repeats": 3}}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    assert len(calls) == 2 * 2 * 4 and all(shared is None for shared in calls)  # cells x depths x (1 + 3), own prefill
    record = RunFolder(tmp_path / "run").records()[0]
    low, high = record["tpot_s_spread"]
    assert low <= record["tpot_s"] <= high and record["timing"] == {"warmup": 1, "repeats": 3}
    plain = expand(load_config(write_config(tmp_path, TINY, "plain.yaml")))
    assert all("timing" not in cell.description for cell in plain)  # ids of untimed configs are unchanged


def test_an_out_of_memory_cell_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    import kvbench.runs.sweep

    real = kvbench.runs.sweep.evaluate

    def evaluate(lm, task, policy, *args, **kwargs):
        if policy.name == "window":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(lm, task, policy, *args, **kwargs)

    monkeypatch.setattr(kvbench.runs.sweep, "evaluate", evaluate)
    config = {**TINY, "policies": ["window", "full", {"name": "h2o", "recent_ratio": 0.5}], "budgets": [32]}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    statuses = {c["cell"]["policy"]["name"]: c for c in RunFolder(tmp_path / "run").cells().values()}
    assert statuses["window"]["status"] == "oom" and "Tried to allocate 2.00 GiB" in statuses["window"]["message"]
    assert statuses["full"]["status"] == statuses["h2o"]["status"] == "ok"


def test_a_memory_limit_fails_the_cells_that_do_not_fit(tmp_path):
    # tiny-llama holds 512 bytes per token (2 layers x 2 KV heads x 16 dims x K and V x 4 bytes): a 300-token
    # prompt needs ~150 KB in full; a 32-token window fed in chunks of 16 peaks near (32 + 16) x 512 = 24 KB
    # (with `prefill: full` the whole prompt lands before it is compressed, and would not fit either)
    config = {**TINY, "policies": ["full", "window"], "budgets": [32], "samples": 1, "memory_limit": "40KiB",
              "prefill": {"mode": "chunked", "chunk": 16}}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    cells = {c["cell"]["policy"]["name"]: c for c in RunFolder(tmp_path / "run").cells().values()}
    assert cells["full"]["status"] == "oom" and "over the limit of 40960" in cells["full"]["message"]
    assert cells["window"]["status"] == "ok" and cells["window"]["cell"]["memory"] == {"limit_bytes": 40960}
    record = RunFolder(tmp_path / "run").records()[0]
    assert record["kv_limit_bytes"] == 40960 and record["kv_bytes_peak"] <= 40960
    assert isinstance(record["mem_growth_over_limit"], bool)  # the process's RSS growth, checked against it
    frame = summarize(tmp_path / "run")
    assert set(frame["memory"]) == {"limit 40.0 KiB"}
    assert "| memory |" in (tmp_path / "run" / "summary.md").read_text()
    levels = expand(load_config(write_config(tmp_path, {**TINY, "pressure": [0.5, 0.9]}, "p.yaml")))
    assert len(levels) == 2 * len(expand(load_config(write_config(tmp_path, TINY, "plain.yaml"))))
    bad = runner.invoke(app, ["validate", str(write_config(tmp_path, {**TINY, "pressure": [1.2]}, "bad.yaml"))])
    assert bad.exit_code == 2 and "pressure" in bad.output


def test_compression_and_hybrid_cells_with_their_own_budgets(tmp_path):
    config = {**TINY, "policies": ["full", {"name": "quant", "bits": 4, "group_size": 16, "residual": 32},
                                   {"name": "h2o", "budget": 64, "storage": {"quant": {"bits": 4, "group_size": 16}}}],
              "samples": 1}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    frame = summarize(tmp_path / "run").set_index("policy")
    assert frame.loc["quant", "budget"] == "-" and frame.loc["h2o", "budget"] == "64"  # one cell each
    assert frame.loc["h2o", "cache_ratio"] < frame.loc["quant", "cache_ratio"] < 0.6
    assert frame["family"].to_dict() == {"full": "none", "quant": "compression", "h2o": "hybrid"}
    families = {r["policy"]["name"]: r["family"] for r in RunFolder(tmp_path / "run").records()}
    assert families == {"full": "none", "quant": "compression", "h2o": "hybrid"}
    pytest.importorskip("matplotlib")
    from kvbench.analysis.plot import figures

    drawn = figures(tmp_path / "run")  # a policy without a budget is one point / one heatmap panel
    assert {"score_vs_bytes_niah", "needle_heatmaps_niah"} <= set(drawn)
    heatmap_labels = [axis.get_ylabel() for axis in drawn["needle_heatmaps_niah"].axes if axis.get_ylabel()]
    assert any(label.startswith("quant") for label in heatmap_labels)
    assert any("storage=quant(bits=4" in label for label in heatmap_labels)


@pytest.mark.parametrize("failure", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB"),
                                     RuntimeError("the shared forward broke")])
def test_a_failing_shared_forward_records_its_cells_and_the_sweep_goes_on(tmp_path, monkeypatch, failure):
    import kvbench.runs.sweep

    real, calls = kvbench.runs.sweep.shared_prefill, []

    def shared_prefill(lm, ids, observers, settings=None):
        calls.append(len(ids))
        if len(calls) == 1:  # the first sample's prompt forward fails
            raise failure
        return real(lm, ids, observers, settings)

    monkeypatch.setattr(kvbench.runs.sweep, "shared_prefill", shared_prefill)
    config = {**TINY, "context_lengths": [260, 300], "samples": 1, "tasks": [{"name": "niah", "depths": [0.5]}],
              "budgets": [32]}
    result = runner.invoke(app, ["sweep", str(write_config(tmp_path, config)), "-o", str(tmp_path / "run"), "-q"])
    statuses = [c["status"] for c in RunFolder(tmp_path / "run").cells().values()]
    failed = "oom" if isinstance(failure, torch.OutOfMemoryError) else "error"
    assert sorted(statuses) == sorted([failed] * 4 + ["ok"] * 4)  # the other context length ran
    assert all(str(failure).split(".")[0] in c["message"] for c in RunFolder(tmp_path / "run").cells().values()
               if c["status"] == failed)
    assert result.exit_code == (1 if failed == "error" else 0), result.output
    rerun = runner.invoke(app, ["sweep", str(write_config(tmp_path, config)), "-o", str(tmp_path / "run"), "-q",
                                "--retry-failed"])
    assert rerun.exit_code == 0 and all(c["status"] == "ok" for c in RunFolder(tmp_path / "run").cells().values())


def test_a_sweep_where_no_cell_succeeded_exits_1(tmp_path, monkeypatch):
    import kvbench.runs.sweep

    def evaluate(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kvbench.runs.sweep, "evaluate", evaluate)
    config = {**TINY, "policies": ["full", "window"], "budgets": [32], "samples": 1}
    result = runner.invoke(app, ["sweep", str(write_config(tmp_path, config)), "-o", str(tmp_path / "run"), "-q"])
    assert result.exit_code == 1 and "sweep failed: 2 oom" in result.output


@pytest.mark.parametrize(("name", "shape", "cells"), [("llama8b", "llama-3.1-8b", 1392),
                                                     ("llama7b", "mistral-7b-v0.3", 1392),
                                                     ("llama7b-quick", "mistral-7b-v0.3", 56)])
def test_a_dry_run_needs_neither_the_device_nor_the_network(monkeypatch, name, shape, cells):
    """A config for a GPU and a hub model expands and estimates on a machine with neither: the model's size comes
    from its built-in shape (Llama-3.1-8B's, Mistral-7B-Instruct-v0.3's), LongBench's sample count from its smallest
    dataset's rows."""
    import torch
    import transformers
    from typer.testing import CliRunner

    from kvbench.cli import app
    from kvbench.engine.estimate import SHAPES, offline_shape

    def no_hub(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    config = ROOT / "configs" / f"{name}.yaml"
    result = CliRunner().invoke(app, ["sweep", str(config), "--dry-run"])
    printed = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert f"{cells} cells" in printed and "estimated time ~" in printed and "on cuda" in printed, printed
    assert offline_shape(load_config(config).model.id) == SHAPES[shape]  # the estimate's, the model's own
