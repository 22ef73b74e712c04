"""Batched sweeps: a cell's samples decoded together give the records they give one at a time, but for timing.

Every registered policy (and storage policies) on random models, over samples of very different lengths whose
answers end at different steps; rows that cannot batch fall back as their manifest line says. One run folder
takes one writer: a second sweep on it exits 2, naming the first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.config.cells import expand
from kvbench.config.schema import load_config
from kvbench.engine.generation import Prompt, generate, generate_rows
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import POLICIES, build_policy
from kvbench.runs.run_folder import RunFolder
from tests.conftest import random_ids
from tests.helpers import NEEDED_PARAMS, assert_model_close
from tests.test_sweep import ROOT, records_by_key, sweep, sweep_until, write_config

runner = CliRunner()

# what a batch measures together (or, for memory, as a process): the only columns a batched record may change
TIMING = {"ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s", "batch_size", "mem_peak_alloc", "mem_peak_reserved",
          "mem_peak_device", "mem_group_peak_alloc", "mem_group_peak_reserved", "mem_group_peak_device",
          "mem_baseline", "mem_device_note",
          "calibration_s"}  # a per-model calibration's seconds: paid by the first cell of a model that calibrates

SNAP = {"name": "snapkv", "window": 8}
# every registered policy, at parameters that fit prompts of 30-250 tokens and budgets of 24 tokens or half
QUANT = {"bits": 4, "residual": 8, "group_size": 8}
POLICY_SPECS = [
    "full", "window", {"name": "streaming_llm", "sinks": 4}, {"name": "h2o", "recent_ratio": 0.5}, "tova",
    SNAP, {"name": "pyramidkv", "window": 8, "beta": 4}, {"name": "ada_kv", "base": SNAP},
    {"name": "chunkkv", "base": SNAP, "chunk": 4}, {"name": "criticalkv", "base": SNAP},
    {"name": "whole_segments", "base": SNAP},
    {"name": "compose", "prefill": SNAP, "decode": "h2o"}, {"name": "hybrid", "prefill": SNAP},
    {"name": "expected_attention", "n_future_positions": 16},
    {"name": "expected_attention", "n_future_positions": 16, "decode": True}, "knorm",
    {"name": "knorm", "decode": True}, "keydiff", {"name": "lagkv", "lag_size": 8, "sink_size": 2},
    {"name": "merge", "recent": 4, "sinks": 2}, {"name": "scissorhands", "history": 8, "recent": 4}, "random",
    {"name": "kvzip", "chunk": 64}, {"name": "kvzip_plus", "chunk": 64},
    {"name": "adaptive", "limit_bytes": 20000, "fallback": "h2o"}, {"name": "qfilter", **NEEDED_PARAMS["qfilter"]},
    {"name": "kvzap", **NEEDED_PARAMS["kvzap"]},
    {"name": "expected_attention_stats", **NEEDED_PARAMS["expected_attention_stats"], "n_future_positions": 16},
    {"name": "razorattention", "calibration_tokens": 32, "induction": 0.25},
    {"name": "duoattention", **NEEDED_PARAMS["duoattention"]},
    {"name": "simlayerkv", "lazy_threshold": 0.5}, {"name": "rkv", "window": 4, "buffer": 4},
    # compressed storage: every token at fewer bits (batches rows of one length), and under an eviction policy
    {"name": "quant", **QUANT}, {"name": "mixed_precision", "recent": 8, "group_size": 8},
    {"name": "lowrank", "rank": 4}, {"name": "h2o", "budgets": [24], "storage": {"quant": QUANT}},
    {"name": "think", "window": 8, "recent": 4}, {"name": "snapkv", "window": 8, "storage": {"think": {"window": 8}}},
    {"name": "quest", "page_size": 8, "dense_layers": 0},  # sparse: keeps every token, reads pages
]

# samples of very different lengths (the shortest an eighth of the longest), answers cut at different lengths,
# two question lengths, and a stop string random bytes meet early
PLUGIN_TASK = '''
import random
import time
from dataclasses import dataclass
from kvbench.tasks.base import Sample, Task, register

SHARES = (0.12, 1.0, 0.45, 0.7, 0.25, 0.9)
ANSWERS = (3, 10, 6, 12, 1, 8)
# a random model's bytes are often no UTF-8: their replacement character ends an answer early
STOPS = ("\ufffd", "x")


@register
@dataclass
class RaggedRows(Task):
    """Random-letter contexts from an eighth of the context length to all of it (a batch test's task)."""

    name = "ragged_rows"
    pause: float = 0.0  # seconds each sample group takes to make (a sweep that stays running)

    def samples(self, tokenizer, context_length, count, seed):
        time.sleep(self.pause)
        out = []
        for index in range(count):
            for share, answer in zip(SHARES, ANSWERS):
                rng = random.Random(f"{seed}:{index}:{share}")
                text = "".join(rng.choice("abcdefghij ") for _ in range(int(share * context_length)))
                out.append(Sample(id=f"ragged-{index}-{share}", context=text, question="Which?" if share < 0.5 else
                                  "Which letter?", answers=["a"], max_new_tokens=answer, stop=STOPS, chat=False))
        return out

    def sample_count(self, count):
        return count * len(SHARES)

    def score(self, prediction, sample):
        return {"score": float("a" in prediction), "length": float(len(prediction))}
'''


def test_the_grid_names_every_registered_policy():
    named = {spec if isinstance(spec, str) else spec["name"] for spec in POLICY_SPECS}
    assert named == set(POLICIES.names())


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    """A folder with the `ragged_rows` task plugin."""
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "ragged.py").write_text(PLUGIN_TASK)
    return folder


def ragged_config(plugins, **overrides) -> dict:
    return {"name": "ragged", "plugins": [str(plugins)], "model": {"id": "random:tiny-llama", "dtype": "float32",
                                                                    "device": "cpu"},
            "policies": POLICY_SPECS, "budgets": [24, 0.5], "context_lengths": [240],
            "tasks": [{"name": "ragged_rows"}], "samples": 1, "question": ["aware", "agnostic"], **overrides}


def assert_one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output


def assert_same_records(batched: dict, alone: dict) -> None:
    assert batched.keys() == alone.keys()
    for key, record in alone.items():
        for field in sorted(set(record) | set(batched[key])):
            if field not in TIMING and not field.endswith("_spread"):
                assert batched[key].get(field) == record.get(field), (record["cell"]["policy"], key[1], field)


def test_a_batched_sweep_records_what_an_unbatched_one_does(tmp_path, ragged):
    config = write_config(tmp_path, ragged_config(ragged))
    sweep(config, tmp_path / "alone")
    sweep(config, tmp_path / "batched", "--batch-size", "4")
    alone, batched = records_by_key(tmp_path / "alone"), records_by_key(tmp_path / "batched")
    assert_same_records(batched, alone)
    sizes = {record["batch_size"] for record in batched.values()}
    assert {1, 4} <= sizes and {record["batch_size"] for record in alone.values()} == {1}
    # rows ended at different steps: by their answer lengths and by stop strings met early
    assert len({record["generated_tokens"] for record in batched.values()}) > 5
    assert any(record["generated_tokens"] < 10 for key, record in batched.items() if "-1.0" in key[1])
    # the policies that cannot batch said so, one line each
    fallback = json.loads((tmp_path / "batched" / "manifest.json").read_text())["batching"]
    assert fallback["batch_size"] == 4
    lines = "\n".join(fallback["fallback"])
    for name in ("kvzip", "adaptive", "random", "merge", "quant", "h2o(storage=", "snapkv(storage="):
        assert name in lines, name
    assert not any(line.startswith("snapkv") and "storage=" not in line for line in fallback["fallback"])


@pytest.mark.parametrize("model, overrides", [
    ("random:tiny-llama", {"prefill": {"mode": "chunked", "chunk": 32}, "evict_every": 4}),
    ("random:tiny-mistral-sliding", {}),  # sliding-window layers drop what leaves the window
    ("random:tiny-qwen2", {"evict_every": 3, "question": ["aware"]}),
])
def test_batched_records_match_under_chunked_prefill_sliding_windows_and_slack(tmp_path, ragged, model, overrides):
    policies = ["full", "window", {"name": "h2o", "recent_ratio": 0.5}, "tova", SNAP, {"name": "ada_kv", "base": SNAP},
                {"name": "scissorhands", "history": 8, "recent": 4}, {"name": "knorm", "decode": True}, "random"]
    if overrides.get("prefill", {}).get("mode") == "chunked":
        policies = [p for p in policies if not (isinstance(p, dict) and p["name"] == "ada_kv")]
    settings = {**ragged_config(ragged), "policies": policies, "model": {"id": model, "dtype": "float32",
                                                                         "device": "cpu"}, **overrides}
    config = write_config(tmp_path, settings)
    sweep(config, tmp_path / "alone")
    sweep(config, tmp_path / "batched", "--batch-size", "3")
    assert_same_records(records_by_key(tmp_path / "batched"), records_by_key(tmp_path / "alone"))


# --- the engine: a batch of rows as each row alone --------------------------------------------------------------

LENGTHS = (23, 97, 41, 180, 64)


def prompts(limits: tuple[int, ...] = (4, 9, 2, 12, 7)) -> list[Prompt]:
    return [Prompt(random_ids(n, seed=n)[:-6], random_ids(n, seed=n)[-6:], limit) for n, limit in zip(LENGTHS, limits,
                                                                                                      strict=True)]


def alone_and_batched(lm, name: str, params: dict, settings: RunSettings, rows: list[Prompt], eos: set[int]):
    batched = generate_rows(lm, build_policy(name, params), rows, settings, eos_token_ids=eos)
    alone = [generate(lm, build_policy(name, params), row.context, row.question, settings, row.max_new_tokens,
                      eos_token_ids=eos) for row in rows]
    return alone, batched


@pytest.mark.parametrize("name, params", [("h2o", {}), ("snapkv", {"window": 8}), ("tova", {}),
                                          ("scissorhands", {"history": 8, "recent": 4}), ("window", {}),
                                          ("razorattention", {"calibration_tokens": 32, "induction": 0.25}),
                                          ("duoattention", NEEDED_PARAMS["duoattention"]),
                                          ("quest", {"page_size": 8, "dense_layers": 0})])
def test_each_row_stops_at_its_own_end_of_sequence(sharp_llama, name, params):
    """A row whose answer ends early (an end-of-sequence token it met alone) keeps its record as it ended, while
    the others decode on."""
    settings = RunSettings(budget=20)
    rows = prompts((12, 12, 12, 12, 12))
    free = [generate(sharp_llama, build_policy(name, params), row.context, row.question, settings, 12,
                     eos_token_ids=set()) for row in rows]
    eos = {free[0].tokens[2], free[3].tokens[5]}  # tokens two rows produce early
    alone, batched = alone_and_batched(sharp_llama, name, params, settings, rows, eos)
    assert alone[0].measurements["generated_tokens"] <= 3 and alone[3].measurements["generated_tokens"] <= 6
    assert max(g.measurements["generated_tokens"] for g in alone) == 12
    for one, row in zip(alone, batched, strict=True):
        assert one.tokens == row.tokens and one.prediction == row.prediction
        assert_model_close(sharp_llama, row.last_logits, one.last_logits)
        for field, value in one.measurements.items():
            if field not in TIMING:
                assert row.measurements[field] == value, field
        assert row.measurements["batch_size"] == len(rows)


@pytest.mark.parametrize("name", ["full", "window", "h2o", "snapkv", "ada_kv", "knorm"])
def test_one_rows_accounts_are_its_caches_own(tiny_llama, name):
    """The per-row accounts (engine/row_accounts.py) of a one-row batch say what the cache's own buffers say: the two
    bookkeepings follow one allocation rule."""
    params = {"window": 8} if name == "snapkv" else {"base": SNAP} if name == "ada_kv" else {}
    for settings in (RunSettings(budget=20), RunSettings(budget=20, evict_every=4)):
        row = prompts()[3]
        session = Session(tiny_llama, build_policy(name, params), settings, len(row.context) + len(row.question),
                          adds=9, left_padding=torch.tensor([0]))
        assert session.cache.rows is not None
        with session:
            session.prefill(row.context + row.question)
            session.decode(9, set())
        assert session.cache.row_stats(0) == session.cache.stats()


def test_rows_of_one_batch_share_a_budget():
    from kvbench.engine.models import load_model

    lm = load_model("random:tiny-llama", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="share one budget"):
        Session(lm, build_policy("window"), RunSettings(budget=0.5), [40, 90], left_padding=torch.tensor([50, 0]))


# --- the config, the CLI and the gate --------------------------------------------------------------------------

def test_batch_size_changes_no_cell_and_no_hash(tmp_path, ragged):
    one = load_config(write_config(tmp_path, ragged_config(ragged), "a.yaml"))
    eight = load_config(write_config(tmp_path, ragged_config(ragged, batch_size=8), "b.yaml"))
    assert one.batch_size == 1 and eight.batch_size == 8 and one.result_hash() == eight.result_hash()


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size 0: a batch holds at least 1 sample"),
    (["--set", "batch_size=0"], "batch_size: Input should be greater than 0"),
])
def test_a_bad_batch_size_is_one_line(tmp_path, ragged, args, message):
    config = write_config(tmp_path, ragged_config(ragged))
    result = runner.invoke(app, ["sweep", str(config), "-o", str(tmp_path / "r"), "-q", *args])
    assert_one_line_error(result, message)
    assert not (tmp_path / "r").exists()


def test_the_gate_passes_a_batched_run_but_will_not_compare_its_speed(tmp_path, ragged):
    config = write_config(tmp_path, {**ragged_config(ragged), "policies": ["full", "window", "h2o"],
                                     "question": "aware"})
    sweep(config, tmp_path / "alone")
    sweep(config, tmp_path / "batched", "--batch-size", "6")
    baseline = tmp_path / "baseline.json"
    assert runner.invoke(app, ["baseline", str(tmp_path / "alone"), "--out", str(baseline)]).exit_code == 0
    passed = runner.invoke(app, ["gate", str(tmp_path / "batched"), "--baseline", str(baseline),
                                 "--strict-predictions", "--max-mem-increase", "0%"])
    assert passed.exit_code == 0, passed.output
    refused = runner.invoke(app, ["gate", str(tmp_path / "batched"), "--baseline", str(baseline),
                                  "--max-slowdown", "20%"])
    assert_one_line_error(refused, "--max-slowdown: ragged_rows L=240 aware full decoded at batch size 6, the "
                                         "baseline at 1; their speeds do not compare")
    summary = (tmp_path / "batched" / "summary.md").read_text()
    assert "| batch |" in summary and "speeds of cells of different batch sizes do not compare" in summary
    assert "| batch |" not in (tmp_path / "alone" / "summary.md").read_text()


def test_the_recommendation_compares_speed_with_full_at_one_batch_size(tmp_path, ragged):
    from kvbench.analysis.report import recommend
    from kvbench.analysis.summary import summarize

    # a ratio budget resolves differently over these samples' lengths: their rows would run apart
    config = write_config(tmp_path, {**ragged_config(ragged), "policies": ["full", "window", "h2o"],
                                     "budgets": [24], "question": "aware"})
    sweep(config, tmp_path / "batched", "--batch-size", "6")
    frame = summarize(tmp_path / "batched", write=False)
    assert set(frame["batch_size"]) == {6}
    chosen = recommend(frame, max_drop=100).iloc[0]  # every cell qualifies: the smallest cache wins
    assert chosen["policy"] != "full" and chosen["note"] == "" and chosen["full_tpot_s"] is not None
    frame.loc[frame["policy"] != "full", "batch_size"] = 1  # as a policy that runs each sample alone beside full
    chosen = recommend(frame, max_drop=100).iloc[0]
    assert chosen["decode_speed_vs_full"] is None and pd.isna(chosen["full_tpot_s"])
    assert chosen["note"] == "speed not compared: batch size 1, full's 6"


# --- one writer per run folder ---------------------------------------------------------------------------------

def test_two_sweeps_on_one_folder_cannot_both_run(tmp_path, ragged):
    # the first sweep stays running: each of its sample groups after the first takes seconds to make
    config = write_config(tmp_path, {**ragged_config(ragged), "policies": ["full", "window", "h2o"],
                                     "context_lengths": [120, 240], "tasks": [{"name": "ragged_rows", "pause": 3}]})
    run = tmp_path / "run"
    first = sweep_until(config, run, records=1)
    second = subprocess.run([sys.executable, "-m", "kvbench.cli", "sweep", str(config), "-o", str(run), "-q"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr
    line, = second.stderr.strip().splitlines()
    assert line.startswith(f"error: {run} is being written by another sweep (pid {first.pid} on "
                           f"{socket.gethostname()}, since ")
    assert line.endswith("): wait for it to finish, or give this one another --output folder")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    # each (cell, sample) once: only the first sweep wrote
    assert len(records_by_key(run)) == len(expand(load_config(config))) * 6


@pytest.mark.parametrize("where", ["run", "run/inside"])
def test_a_run_folder_where_a_file_is_is_a_one_line_error(tmp_path, where):
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(KvbenchError) as raised:
        RunFolder(tmp_path / where).lock()
    assert str(raised.value) == (f"cannot write the run's folder {tmp_path / where}: {tmp_path / 'run'} is a file; "
                                 "give another --output folder")
    assert (tmp_path / "run").read_text() == "not a folder"


def test_a_killed_sweep_leaves_no_lock_behind(tmp_path, ragged):
    config = write_config(tmp_path, {**ragged_config(ragged), "policies": ["full", "window"],
                                     "context_lengths": [120, 240], "tasks": [{"name": "ragged_rows", "pause": 3}]})
    run = tmp_path / "run"
    first = sweep_until(config, run, records=2)
    os.killpg(first.pid, signal.SIGKILL)  # no handler runs: only the kernel lets go of the lock
    first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL and (run / "writer.lock").exists()
    resumed = subprocess.run([sys.executable, "-m", "kvbench.cli", "sweep", str(config), "-o", str(run), "-q"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert len(records_by_key(run)) == len(expand(load_config(config))) * 6


def test_merging_into_a_folder_a_sweep_writes_is_refused(tmp_path):
    target = RunFolder(tmp_path / "merged")
    target.lock()
    try:
        shard = RunFolder(tmp_path / "shard")
        shard.open({"config_hash": "h", "started": "t", "cells": []}, force=False)
        shard.release()
        code = textwrap.dedent(f"""
            from kvbench.runs.run_folder import merge_runs
            merge_runs({str(tmp_path / 'merged')!r}, [{str(tmp_path / 'shard')!r}])
        """)
        other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "is being written by another sweep" in other.stderr
        assert f"pid {os.getpid()}" in other.stderr
    finally:
        target.release()
