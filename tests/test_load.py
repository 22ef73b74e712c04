"""Serving under load: the joint decode step, the scheduler's accounts, load cells in a sweep."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import yaml

from kvbench.analysis.serving_report import sustained_lines
from kvbench.analysis.summary import summarize
from kvbench.calibration import calibrate
from kvbench.calibration.methods import Settings
from kvbench.cli import app
from kvbench.engine import models
from kvbench.engine.generation import Prompt, answer, generate
from kvbench.engine.instruments import PeakMemory
from kvbench.engine.models import load_model
from kvbench.engine.session import Session, step_together
from kvbench.engine.settings import RunSettings
from kvbench.policies import POLICIES, build_policy
from kvbench.policies.base import takes_budget
from kvbench.runs.load_cell import searched_rates
from kvbench.runs.run_folder import RunFolder
from kvbench.serving import (
    Admission,
    Load,
    Need,
    Request,
    Scheduler,
    Served,
    Service,
    need_tokens,
    read_trace,
    service_metrics,
)
from tests.conftest import random_ids
from tests.helpers import assert_rejected_in_one_line, tiny_policy
from tests.test_sweep import runner, sweep, sweep_until, write_config

SETTINGS = {"full": None, "window": 16, "h2o": 16, "streaming_llm": 16, "snapkv": 40}


@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model("random:tiny-gemma3", dtype="float32", device="cpu")


def _prefilled(lm, name: str, prompt: list[int]) -> Session:
    session = Session(lm, build_policy(name, {}), RunSettings(budget=SETTINGS[name]), prompt_tokens=len(prompt),
                      adds=12)
    session.prefill(prompt)
    return session


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_joint_step_is_each_requests_run_alone(tiny_gemma3, name):
    """Rows of different lengths join a running batch at different steps and leave it: each row's tokens, logits
    and cache accounts are its run alone's, on a model with sliding-window layers (every policy on a full-attention
    model: below)."""
    lm = tiny_gemma3
    prompts = [random_ids(n, seed=n) for n in (40, 23, 77)]
    alone = []
    for prompt in prompts:
        session = _prefilled(lm, name, prompt)
        tokens, logits = [int(session.logits.argmax())], []
        for _ in range(8):
            logits.append(session.step(tokens[-1])[0])
            tokens.append(int(logits[-1].argmax()))
        alone.append((tokens, torch.stack(logits), session.cache.stats()))
    sessions = [_prefilled(lm, name, prompt) for prompt in prompts]
    tokens = [[int(s.logits.argmax())] for s in sessions]
    logits: list[list[torch.Tensor]] = [[], [], []]
    for step in range(11):  # the first two leave after step 7; the third joins at step 3
        rows = [row for row in range(3) if (row < 2 and step < 8) or (row == 2 and step >= 3)]
        out = step_together([sessions[row] for row in rows], [tokens[row][-1] for row in rows])
        for index, row in enumerate(rows):
            logits[row].append(out[index])
            tokens[row].append(int(out[index].argmax()))
    for row, (want_tokens, want_logits, want_stats) in enumerate(alone):
        assert tokens[row] == want_tokens
        torch.testing.assert_close(torch.stack(logits[row]), want_logits)
        assert sessions[row].cache.stats() == want_stats


@pytest.mark.parametrize("name", POLICIES.names())
def test_every_policy_steps_jointly_as_it_runs_alone(tiny_llama, name):
    """Each registered policy (compressed storage, sparse reads, uneven heads, merging, thresholds of its own) in a
    joint step of three requests: each one's tokens and cache accounts are its run alone's."""
    params = {"rank": 8} if name == "lowrank" else {}
    budget = 56 if takes_budget(tiny_policy(name, params)) else None
    prompts = [random_ids(n, seed=n) for n in (70, 90, 110)]

    def prefilled(prompt: list[int]) -> Session:
        session = Session(tiny_llama, tiny_policy(name, params), RunSettings(budget=budget), prompt_tokens=len(prompt),
                          adds=8)
        session.prefill(prompt)
        return session

    alone = []
    for prompt in prompts:
        session = prefilled(prompt)
        tokens = [int(session.logits.argmax())]
        for _ in range(6):
            tokens.append(int(session.step(tokens[-1]).argmax()))
        alone.append((tokens, session.cache.stats()))
    sessions = [prefilled(prompt) for prompt in prompts]
    tokens = [[int(session.logits.argmax())] for session in sessions]
    for _ in range(6):
        out = step_together(sessions, [row[-1] for row in tokens])
        for row, logits in zip(tokens, out, strict=True):
            row.append(int(logits.argmax()))
    assert [(row, session.cache.stats()) for row, session in zip(tokens, sessions, strict=True)] == alone


def _prompts(lm, count: int, max_new_tokens: int = 6) -> list[Prompt]:
    return [Prompt(random_ids(30 + 7 * (i % 5), seed=100 + i), [], max_new_tokens) for i in range(count)]


def _serve(lm, name: str, prompts: list[Prompt], load: Load, budget=None):
    settings = RunSettings(budget=budget)
    with PeakMemory(lm.devices) as memory:
        return Service(lm, build_policy(name, {}), settings, prompts, load, memory).run()


def _alone(lm, name: str, prompt: Prompt, budget=None) -> list[int]:
    """The request's answer tokens run alone (without the end of sequence that ended it)."""
    return generate(lm, build_policy(name, {}), prompt.context, prompt.question, RunSettings(budget=budget),
                    prompt.max_new_tokens).tokens


def _answer(lm, request) -> list[int]:
    return answer(lm, request.tokens, lm.eos_token_ids, request.prompt.stop)[1]


def test_a_service_answers_every_request_as_it_runs_alone(tiny_llama):
    prompts = _prompts(tiny_llama, 8)
    slot = 2 * tiny_llama.kv_heads * tiny_llama.head_dim * 4 * tiny_llama.num_layers
    served = _serve(tiny_llama, "window", prompts, Load(requests=8, rate=50.0, pool_bytes=3 * 40 * slot), budget=16)
    assert all(r.finished_s is not None for r in served.requests)
    assert max(step["running"] for step in served.timeline) > 1  # requests ran together
    for request in served.requests:
        assert _answer(tiny_llama, request) == _alone(tiny_llama, "window", request.prompt, 16)
        assert request.measured["kv_bytes_peak"] > 0


def test_a_chunked_prefill_interleaves_with_decode_steps_and_answers_as_alone(tiny_llama):
    prompts = [Prompt(random_ids(n, seed=n), [], 8) for n in (200, 180, 220, 160)]
    settings = RunSettings(budget=48, prefill="chunked", prefill_chunk=32)
    with PeakMemory(tiny_llama.devices) as memory:
        served = Service(tiny_llama, build_policy("snapkv", {"window": 8}), settings, prompts,
                         Load(requests=4, rate=1000.0), memory).run()
    assert any(step["prefilling"] and step["running"] for step in served.timeline)  # decode between the chunks
    for request in served.requests:
        alone = generate(tiny_llama, build_policy("snapkv", {"window": 8}), request.prompt.context, [], settings,
                         8).tokens
        assert _answer(tiny_llama, request) == alone


def test_decoding_past_the_pool_preempts_the_newest_and_recomputes_it(tiny_llama, monkeypatch):
    """Admission that undercounts (here: forced to) lets decoding outgrow the pool of requests that step jointly
    (those of a policy whose rows cannot share a pool's): the newest request goes back to the queue, is recomputed,
    and still answers as alone."""
    monkeypatch.setattr("kvbench.serving.service.cache_need", lambda *args: Need(1, 1))
    monkeypatch.setattr("kvbench.serving.service.pool_plan", lambda *args: "forced to step jointly")
    prompts = _prompts(tiny_llama, 5, max_new_tokens=12)
    slot = 2 * tiny_llama.kv_heads * tiny_llama.head_dim * 4 * tiny_llama.num_layers
    served = _serve(tiny_llama, "full", prompts, Load(requests=5, rate=1000.0, pool_bytes=120 * slot))
    assert served.preemptions > 0
    assert sum(r.times_preempted for r in served.requests) == served.preemptions
    for request in served.requests:
        assert request.ended
        if request.finished_s is not None:
            assert _answer(tiny_llama, request) == _alone(tiny_llama, "full", request.prompt)


@pytest.mark.parametrize("name, budget, prefill, chunk", [
    ("full", None, "full", 64), ("snapkv", 0.25, "full", 64), ("snapkv", 0.25, "chunked", 64),
    ("snapkv", 0.25, "chunked", 32), ("h2o", 0.25, "full", 64), ("window", 0.25, "chunked", 64)])
def test_admission_judges_a_cache_as_the_session_sizes_it(tiny_llama, name, budget, prefill, chunk):
    """`need_tokens` before a request runs is what its cache then holds at its largest and after its prompt (an
    answer of 40 tokens: within a chunk of 64, beyond one of 32)."""
    prompt, answer = random_ids(300, seed=3), 40
    settings = RunSettings(budget=budget, prefill=prefill, prefill_chunk=chunk)
    session = Session(tiny_llama, build_policy(name, {}), settings, prompt_tokens=len(prompt), adds=answer)
    session.prefill(prompt)
    token = int(session.logits.argmax())
    for _ in range(answer - 1):
        token = int(session.step(token).argmax())
    slot = 2 * tiny_llama.kv_heads * tiny_llama.head_dim * 4 * tiny_llama.num_layers
    need = need_tokens(session.policy, settings, len(prompt), answer, tiny_llama.num_layers)
    assert need.peak == -(-session.cache.peak_bytes // slot)  # one layer's compressed buffer: half a slot here
    assert need.held == session.cache.physical_bytes() // slot


def test_overload_ends_in_its_time_with_every_request_accounted_for(tiny_llama):
    prompts = _prompts(tiny_llama, 30)
    load = Load(requests=30, rate=10_000.0, timeout_s=0.02, max_queue=3, slo_ttft_s=0.5)
    served = _serve(tiny_llama, "full", prompts, load)
    metrics = service_metrics(served, load)
    assert metrics["finished"] + metrics["rejected"] == metrics["offered"] == 30
    assert metrics["rejected"] > 0 and set(metrics["rejected_why"]) <= {"queue full", "timed out in the queue"}
    assert sum(metrics["rejected_why"].values()) == metrics["rejected"]


class _ShortestFirst(Scheduler):
    """Admits the shortest queued prompt that fits; preempts the oldest running request."""

    def admission(self, queue, running, fits):
        fitting = [r for r in queue if fits(r)]
        return Admission(min(fitting, key=lambda r: len(r.prompt.context))) if fitting else None

    def preempted(self, running):
        return running[0]


def test_another_policy_of_scheduling_is_one_class(tiny_llama):
    prompts = _prompts(tiny_llama, 5)[::-1]  # longest first
    load = Load(requests=5, arrivals=(0.0,) * 5)  # all queued at once; one prefill at a time
    with PeakMemory(tiny_llama.devices) as memory:
        served = Service(tiny_llama, build_policy("full", {}), RunSettings(), prompts, load, memory,
                         scheduler=_ShortestFirst()).run()
    order = [r.index for r in sorted(served.requests, key=lambda r: r.admitted_s)]
    assert order == sorted(range(5), key=lambda i: (len(prompts[i].context), i)) != list(range(5))
    for request in served.requests:
        assert _answer(tiny_llama, request) == _alone(tiny_llama, "full", request.prompt)
    fcfs = _serve(tiny_llama, "full", prompts, load)
    assert [r.index for r in sorted(fcfs.requests, key=lambda r: r.admitted_s)] == list(range(5))


def test_a_request_larger_than_the_pool_is_rejected_not_run(tiny_llama):
    served = _serve(tiny_llama, "full", _prompts(tiny_llama, 2), Load(requests=2, rate=5.0, pool_bytes=1000))
    assert all(r.rejected == "larger than the pool" for r in served.requests)


def test_a_closed_loop_sends_each_users_next_request_when_the_last_ended(tiny_llama):
    served = _serve(tiny_llama, "full", _prompts(tiny_llama, 6), Load(requests=6, users=2))
    assert all(r.finished_s is not None for r in served.requests)
    assert max(step["running"] for step in served.timeline) <= 2
    for user in (0, 1):
        mine = [r for r in served.requests if r.user == user]
        assert all(later.arrival_s >= earlier.finished_s for earlier, later in zip(mine, mine[1:], strict=False))


def test_a_horizon_rejects_what_arrived_and_offers_nothing_that_had_not(tiny_llama):
    """Open loop: the two requests at 0 are offered (finished, or cut by the horizon); the two arriving after it are
    not, and the idle service skips only to the horizon. Closed loop: a user's request sent after the horizon is not
    offered either."""
    load = Load(requests=4, arrivals=(0.0, 0.0, 50.0, 60.0), horizon_s=5.0, slo_ttft_s=100.0)
    served = _serve(tiny_llama, "full", _prompts(tiny_llama, 4), load)
    assert [r.offered for r in served.requests] == [True, True, False, False]
    assert all(r.finished_s is not None for r in served.requests[:2])
    metrics = service_metrics(served, load)
    assert (metrics["offered"], metrics["finished"], metrics["rejected"], metrics["slo_attained"]) == (2, 2, 0, 1.0)
    assert 5.0 <= served.duration_s < 6.0  # not the next arrival's 50 s
    closed = Load(requests=6, users=2, horizon_s=0.05)
    served = _serve(tiny_llama, "full", _prompts(tiny_llama, 6, max_new_tokens=24), closed)
    metrics = service_metrics(served, closed)
    assert metrics["offered"] == sum(r.arrival_s <= 0.05 for r in served.requests) < 6
    assert metrics["finished"] + metrics["rejected"] == metrics["offered"]
    assert all(r.arrival_s > 0.05 and r.rejected is None for r in served.requests if not r.offered)


def _request(index, arrival, admitted=None, first=None, finished=None, tokens=0, rejected=None, offered=True):
    return Request(index, Prompt([1, 2, 3], [], 8), arrival, admitted_s=admitted, first_token_s=first,
                   finished_s=finished, tokens=list(range(tokens)), rejected=rejected, offered=offered)


def test_service_metrics_on_a_trace_made_by_hand():
    """TTFT from arrival (queueing in it), TPOT over the tokens after the first, goodput over the wall time,
    `slo_attained` over what was offered (rejections and timeouts in it, not what arrived after the horizon), and
    numpy's linear percentiles."""
    requests = [
        _request(0, 0.0, admitted=0.0, first=1.0, finished=3.0, tokens=5),  # TTFT 1, TPOT 2/4 = 0.5: good
        _request(1, 1.0, admitted=2.0, first=3.0, finished=4.5, tokens=3),  # TTFT 2 (1 s queued), TPOT 0.75
        _request(2, 2.0, admitted=2.5, first=3.5, finished=3.5, tokens=1),  # TTFT 1.5, no TPOT: good
        _request(3, 3.0, rejected="timed out in the queue"),
        _request(4, 4.0, rejected="queue full"),
        _request(5, 5.0, rejected="not ended by the horizon"),
        _request(6, 12.0, offered=False),  # after the horizon: never offered
    ]
    timeline = [{"running": 1, "pool_bytes": 100}, {"running": 3, "pool_bytes": 300}]
    load = Load(requests=7, rate=1.0, horizon_s=10.0, slo_ttft_s=1.6, slo_tpot_s=0.55)
    metrics = service_metrics(Served(requests, timeline, 2, 10.0, 1000), load)  # cut at the horizon
    assert {key: metrics[key] for key in ("offered", "finished", "rejected", "preemptions", "duration_s")} == {
        "offered": 6, "finished": 3, "rejected": 3, "preemptions": 2, "duration_s": 10.0}
    assert metrics["rejected_why"] == {"timed out in the queue": 1, "queue full": 1, "not ended by the horizon": 1}
    assert metrics["goodput"] == 2 / 10 and metrics["slo_attained"] == 2 / 6
    assert metrics["request_rate"] == 3 / 10 and metrics["output_tok_s"] == 9 / 10
    expected = {"ttft_p50": 1.5, "ttft_p99": 1.99, "tpot_p50": 0.625, "tpot_p99": 0.7475, "e2e_p50": 3.0,
                "e2e_p99": 3.49, "queue_p50": 0.5, "queue_p99": 0.99}
    assert {key: metrics[key] for key in expected} == pytest.approx(expected)
    assert (metrics["concurrency_mean"], metrics["concurrency_peak"]) == (2.0, 3)
    assert (metrics["pool_used_mean"], metrics["pool_used_peak"], metrics["pool_bytes"]) == (200.0, 300, 1000)


def test_a_calibrated_policy_hashes_and_reads_its_model_once_before_the_clock_starts(tmp_path, monkeypatch):
    """8 qfilter requests on a random two-layer model with the artifact in its default folder: the model's digest
    is hashed and the artifact read once, at the service's start-up (before its clock), not once per request; a
    second cell on the same model does neither."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    lm = load_model("random:tiny-llama", dtype="float32", device="cpu", seed=7)
    calibrate.calibrate(lm, "qfilter", "embedded", Settings(documents=2, tokens=64, samples=64))
    models._DIGESTS.clear()  # a new process, the artifact on disk
    calibrate._READ.clear()
    hashed, read = [], []
    hash_weights, read_weights = models.hash_weights, calibrate.read_weights
    monkeypatch.setattr(models, "hash_weights", lambda *args: hashed.append(time.perf_counter()) or hash_weights(*args))
    monkeypatch.setattr(calibrate, "read_weights",
                        lambda folder: read.append(time.perf_counter()) or read_weights(folder))
    for cell in range(2):
        with PeakMemory(lm.devices) as memory:
            service = Service(lm, build_policy("qfilter", {}), RunSettings(budget=16), _prompts(lm, 8),
                              Load(requests=8, rate=1000.0), memory)
            served = service.run()
        assert all(r.finished_s is not None for r in served.requests)
        assert len(hashed) == 1 and len(read) == 1
        assert max(hashed + read) < service.clock.start or cell == 1


LOAD = {
    "name": "load",
    "model": {"id": "random:tiny-llama", "dtype": "float32", "device": "cpu"},
    "policies": ["full", "window"],
    "budgets": [0.25],
    "context_lengths": [256],
    "tasks": [{"name": "niah"}],
    "samples": 3,
    "max_new_tokens": 4,
    "load": {"rates": [5, 50], "requests": 6, "kv_pool": "600 tokens", "slo": {"ttft_s": 5.0}},
}


def test_a_load_sweep_records_its_requests_and_a_rerun_counts_none_twice(tmp_path):
    config = write_config(tmp_path, LOAD)
    run = tmp_path / "run"
    sweep(config, run)
    folder = RunFolder(run)
    statuses = folder.cells()
    assert len(statuses) == 4 and all(s["load"]["finished"] + s["load"]["rejected"] == 6 for s in statuses.values())
    frame = summarize(run)
    assert frame["goodput"].notna().all() and set(frame["load_rate"]) == {5, 50}
    assert set(frame["pool_step"]) == {"batched"} and frame["pool_rows"].min() >= 2  # rows of the pool's own
    assert all("rows of the pool" in line for line in sustained_lines(frame, lambda row: row["policy"]))
    # a load cell cut short after its records: it runs again whole, and only the rerun's records count
    lines = (run / "cells.jsonl").read_text().splitlines()
    (run / "cells.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    before = (run / "records.jsonl").read_text().count("\n")
    sweep(config, run)
    assert (run / "records.jsonl").read_text().count("\n") > before
    keys = [(r["cell_id"], r["sample_id"]) for r in folder.records()]
    assert len(keys) == len(set(keys)) == sum(s["load"]["finished"] for s in folder.cells().values())
    assert "Under load" in (run / "summary.md").read_text()
    # the gate reads load cells as every cell: a rerun's answers are the same, request by request
    baseline = tmp_path / "baseline.json"
    assert runner.invoke(app, ["baseline", str(run), "--out", str(baseline)]).exit_code == 0
    gated = runner.invoke(app, ["gate", str(run), "--baseline", str(baseline), "--strict-predictions", "--strict",
                                "--markdown", str(tmp_path / "gate.md")])
    assert gated.exit_code == 0, gated.output
    assert "at 50 req/s, pool 600 tokens" in (tmp_path / "gate.md").read_text()


def test_a_load_sweep_killed_mid_run_resumes_with_every_request_counted_once(tmp_path):
    config = write_config(tmp_path, {**LOAD, "policies": ["full", "window", "h2o"]})
    run = tmp_path / "run"
    process = sweep_until(config, run, records=1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    sweep(config, run)
    folder = RunFolder(run)
    statuses = folder.cells()
    assert len(statuses) == 6
    counted: dict[str, int] = {}
    for row in folder.records():
        counted[row["cell_id"]] = counted.get(row["cell_id"], 0) + 1
        assert row["attempt"] == statuses[row["cell_id"]]["attempt"]
    assert counted == {cell_id: status["load"]["finished"] for cell_id, status in statuses.items()}


@pytest.mark.parametrize("start, limit, refine, holds_to, held, missed, tried", [
    (0.1, 12.8, 2, 0.7, 0.7, 0.8, [0.1, 0.2, 0.4, 0.8, 0.6, 0.7]),  # doubles to the first miss, then halves the gap
    (0.1, 12.8, 2, 0.65, 0.6, 0.7, [0.1, 0.2, 0.4, 0.8, 0.6, 0.7]),
    (0.1, 0.3, 2, 5.0, 0.2, None, [0.1, 0.2]),  # up to the limit, then nothing to refine
    (1.0, 12.8, 2, 0.5, None, 1.0, [1.0]),  # the first rate misses: none held
])
def test_a_rate_search_doubles_until_a_rate_misses_then_halves_the_gap(start, limit, refine, holds_to, held, missed,
                                                                       tried):
    asked = []

    def attained(rate):
        asked.append(rate)
        return 0.95 if rate <= holds_to + 1e-9 else 0.5

    found, lowest_missed, order = searched_rates(attained, {"start": start, "limit": limit, "refine": refine}, 0.9)
    assert found == pytest.approx(held) if held is not None else found is None
    assert lowest_missed == pytest.approx(missed) if missed is not None else lowest_missed is None
    assert order == pytest.approx(tried) and asked == order


def test_a_rate_search_cell_records_the_rate_it_found_and_every_rate_it_tried(tmp_path):
    load = {"rates": "auto", "requests": 4, "kv_pool": "600 tokens", "slo": {"ttft_s": 1.0},
            "search": {"start": 2, "limit": 64, "refine": 1}}
    config = write_config(tmp_path, {**LOAD, "policies": ["window"], "load": load})
    run = tmp_path / "run"
    sweep(config, run)
    folder = RunFolder(run)
    (status,) = folder.cells().values()
    service = status["load"]
    tried = {t["rate"]: t for t in service["tried"]}
    # the search the cell ran is the one its measurements call for, and its records are the rate it found
    held, missed, order = searched_rates(lambda rate: tried[rate]["slo_attained"], load["search"], 0.9)
    assert sorted(order) == sorted(tried) and service["sustained_rate"] == held and service["missed_rate"] == missed
    assert service["rate"] == (order[0] if held is None else held)
    assert len(folder.records()) == service["finished"] == tried[service["rate"]]["finished"]
    frame = summarize(run)
    assert frame["rate_searched"].all() and frame["load_rate"].iloc[0] == service["rate"]
    assert "the rate sustained by 90%" in frame["load"].iloc[0]
    assert "window" in (run / "summary.md").read_text()


@pytest.mark.parametrize("load, culprit", [
    ({"rates": "auto"}, "give slo.ttft_s or slo.tpot_s"),
    ({"rates": "auto", "slo": {"ttft_s": 1}, "search": {"start": 2, "limit": 1}}, "search.start 2 is above"),
    ({"rates": "sometimes"}, "rates"),
    ({"rates": [1], "attainment": 1.5}, "attainment"),
    ({"rates": [1], "users": [2]}, "give 'rates'"),
    ({"rates": [0]}, "rates must be positive"),
    ({"rates": [1], "kv_pool": "lots"}, "lots"),
    ({"rates": [1], "kv_pool": "1MiB", "pressure": 0.5}, "not both"),
    ({"rates": [1], "requests": 0}, "requests"),
])
def test_a_bad_load_section_is_one_line(tmp_path, load, culprit):
    config = write_config(tmp_path, {**LOAD, "load": load})
    assert_rejected_in_one_line(config, culprit, tmp_path / "run")


def test_load_cells_serve_only_tasks_that_answer_one_prompt(tmp_path):
    config = write_config(tmp_path, {**LOAD, "tasks": [{"name": "multiquery"}]})
    assert_rejected_in_one_line(config, "multiquery", tmp_path / "run")


def test_the_load_config_shipped_is_valid():
    from pathlib import Path

    from kvbench.config.schema import load_config

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "load.yaml")
    assert config.load is not None and len(config.load.rates or []) >= 3
    assert {p.name for p in config.policies} >= {"full", "window", "snapkv", "h2o"}
    json.dumps(yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "load.yaml").read_text()))


def test_the_rate_search_config_shipped_is_valid(tmp_path):
    from pathlib import Path

    from kvbench.config.schema import load_config

    shipped = Path(__file__).resolve().parent.parent / "configs" / "load-search.yaml"
    config = load_config(shipped)
    assert config.load is not None and config.load.rates == "auto"
    planned = runner.invoke(app, ["sweep", str(shipped), "--dry-run", "--output", str(tmp_path / "run")])
    assert planned.exit_code == 0, planned.output
    assert "the rate sustained by 90%" in planned.output
    # its time estimate counts each rate the search may try: 0.05 to 3.2 doubling (7 rates), then 2 more
    from kvbench.runs.work import served_requests

    assert served_requests(config.load.conditions()[0]) == 8 * 9


def test_a_trace_replays_its_arrivals_prompts_and_output_limits(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in [
        {"arrival_s": 0.0}, {"arrival_s": 0.05, "max_tokens": 2},
        {"arrival_s": 0.1, "prompt": "Say hello.", "max_tokens": 3}]) + "\n")
    config = write_config(tmp_path, {**LOAD, "policies": ["full"], "load": {"trace": str(trace), "kv_pool": "1MiB"}})
    run = tmp_path / "run"
    sweep(config, run)
    (status,) = RunFolder(run).cells().values()
    assert status["load"]["offered"] == 3 and status["cell"]["load"]["trace_sha256"]
    records = sorted(RunFolder(run).records(), key=lambda r: r["request"])
    assert [r["arrival_s"] for r in records] == [0.0, 0.05, 0.1]
    assert records[1]["generated_tokens"] <= 2 and records[2]["generated_tokens"] <= 3
    assert records[2]["sample_id"].endswith("trace-2") and records[2]["scores"]["score"] != records[2]["scores"][
        "score"]  # NaN: a trace's own prompt is not scored


@pytest.mark.parametrize("text, where", [('{"arrival_s": 0}\n{"arrival": 1}\n', "trace.jsonl:2"),
                                         ('{"arrival_s": 0}\n\n{"arrival_s": 1', "trace.jsonl:3: not JSON")])
def test_a_bad_trace_line_is_one_line_naming_it(tmp_path, text, where):
    """A line's number is its place in the file, blank lines counted; a cut-off line is an error, not dropped."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text)
    config = write_config(tmp_path, {**LOAD, "load": {"trace": str(trace)}})
    assert_rejected_in_one_line(config, where, tmp_path / "run")


def test_a_traces_last_line_counts_without_its_newline(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0}\n{"arrival_s": 0.5}')
    assert [request.arrival_s for request in read_trace(trace)] == [0.0, 0.5]
