"""A service's pool: requests decode in rows of static buffers, one batched step for all, each as it runs alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench.cli import app
from kvbench.engine.instruments import PeakMemory, StepWork
from kvbench.engine.models import load_model
from kvbench.engine.pool import Pool, PoolRefused, pool_plan
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.policies import POLICIES, build_policy
from kvbench.policies.base import takes_budget
from kvbench.serving import Load, Service
from tests.conftest import random_ids
from tests.helpers import tiny_policy
from tests.test_load import LOAD, _alone, _answer, _prompts
from tests.test_sweep import runner, write_config

STEPS = 8


def _bytes_aside(stats):
    """A pooled request's buffers are its row's: every other account is its run alone's."""
    return dataclasses.replace(stats, kv_bytes_physical=0, kv_bytes_peak=0)


def _pooled_as_alone(lm, name: str, params: dict, settings: RunSettings, lengths=(70, 90, 110)) -> None:
    """Three requests join a pool at different steps and leave it as their answers end (the last row moves into a
    freed one): each one's tokens, logits and cache accounts are its run alone's."""
    prompts = [random_ids(n, seed=n) for n in lengths]

    def session(prompt: list[int]) -> Session:
        return Session(lm, tiny_policy(name, params), settings, prompt_tokens=len(prompt), adds=STEPS + 1)

    plan = pool_plan([session(p) for p in prompts], max(lengths) + STEPS + 1)
    if isinstance(plan, str):
        return
    alone = []
    for prompt in prompts:
        one = session(prompt)
        one.prefill(prompt)
        tokens, logits = [int(one.logits.argmax())], []
        for _ in range(STEPS):
            logits.append(one.step(tokens[-1])[0])
            tokens.append(int(logits[-1].argmax()))
        alone.append((tokens, torch.stack(logits), _bytes_aside(one.cache.stats())))
    pool = Pool(lm, plan, rows=4)
    sessions = [session(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    ended = {}
    for step in range(STEPS + 3):
        for index in (0, 1) if step == 0 else (2,) if step == 3 else ():
            sessions[index].prefill(prompts[index])
            tokens[index].append(int(sessions[index].logits.argmax()))
            try:
                pool.join(sessions[index])
            except PoolRefused:
                assert name == "rkv"  # its window of queries per layer
                return
        rows = [sessions.index(member) for member in pool.members]
        out = pool.step([tokens[index][-1] for index in rows])
        for row, index in enumerate(rows):
            logits[index].append(out[row])
            tokens[index].append(int(out[row].argmax()))
            if len(tokens[index]) == STEPS + 1:
                ended[index] = _bytes_aside(sessions[index].cache.stats())
                pool.leave(sessions[index])
    assert not pool.members
    for index, (want_tokens, want_logits, want_stats) in enumerate(alone):
        assert tokens[index] == want_tokens
        torch.testing.assert_close(torch.stack(logits[index]), want_logits)  # float32: a few ulps of the batch
        assert ended[index] == want_stats


@pytest.mark.parametrize("name", POLICIES.names())
def test_every_policy_decodes_in_a_pool_as_it_runs_alone_or_says_why_not(tiny_llama, name):
    # R-KV with a buffer it fills within the steps: it evicts by its window of queries, which rows cannot share
    params = {"rank": 8} if name == "lowrank" else {"buffer": 4} if name == "rkv" else {}
    budget = 56 if takes_budget(tiny_policy(name, params)) else None
    probe = Session(tiny_llama, tiny_policy(name, params), RunSettings(budget=budget), prompt_tokens=70, adds=4)
    plan = pool_plan([probe], 80)
    if isinstance(plan, str):
        assert name in {"adaptive", "simlayerkv", "duoattention", "lowrank", "merge", "mixed_precision", "quant",
                        "quest", "random", "razorattention", "think"}, plan
        return
    _pooled_as_alone(tiny_llama, name, params, RunSettings(budget=budget))


@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model("random:tiny-gemma3", dtype="float32", device="cpu")


@pytest.mark.parametrize("name, budget, every", [("full", None, 1), ("window", 16, 1), ("h2o", 16, 1),
                                                 ("streaming_llm", 16, 1), ("snapkv", 40, 1), ("tova", 16, 3)])
def test_a_pool_on_a_model_with_sliding_layers_decodes_as_alone(tiny_gemma3, name, budget, every):
    """`every` > 1: the rows evict a few entries at a time, each when its own heads are due."""
    _pooled_as_alone(tiny_gemma3, name, {}, RunSettings(budget=budget, evict_every=every), lengths=(40, 23, 77))


@pytest.mark.parametrize("name, budget", [("full", None), ("snapkv", 40), ("h2o", 32)])
def test_a_pool_step_dispatches_the_same_ops_at_1_4_and_8_requests(tiny_llama, name, budget):
    settings = RunSettings(budget=budget)
    sessions = [Session(tiny_llama, build_policy(name, {}), settings, prompt_tokens=60, adds=8) for _ in range(8)]
    plan = pool_plan(sessions, 80)
    assert not isinstance(plan, str)
    ops = {}
    for running in (1, 4, 8):
        pool = Pool(tiny_llama, plan, rows=8)
        for index in range(running):
            sessions[index] = Session(tiny_llama, build_policy(name, {}), settings, prompt_tokens=60, adds=8)
            sessions[index].prefill(random_ids(60, seed=index))
            pool.join(sessions[index])
        pool.step([1] * running)  # a bucket's first step
        with StepWork() as work:
            pool.step([1] * running)
        ops[running] = work.ops
    assert ops[1] == ops[4] == ops[8], ops


@pytest.mark.parametrize("name, budget", [("full", None), ("window", 24), ("h2o", 24), ("tova", 24)])
def test_a_compiled_pool_step_is_one_graph_per_bucket_kept_across_evicting_steps(tiny_llama, compiled_on_dynamo,
                                                                                    name, budget):
    """Two requests, then a third joining: no graph break, the eager pool's tokens, one graph for each bucket of
    rows (2, then 4) and none more over the steps, evicting at every one."""
    settings = RunSettings(budget=budget, evict_every=4 if name == "tova" else 1)

    def run(compile: bool) -> tuple[list[list[int]], int]:
        tiny_llama.compile = compile
        try:
            sessions = [Session(tiny_llama, build_policy(name, {}), settings, prompt_tokens=50, adds=40)
                        for _ in range(3)]
            plan = pool_plan(sessions, 90)
            assert not isinstance(plan, str)
            pool = Pool(tiny_llama, plan, rows=4)
            tokens: list[list[int]] = [[], [], []]
            for step in range(32):
                for index in (0, 1) if step == 0 else (2,) if step == 4 else ():
                    sessions[index].prefill(random_ids(50, seed=index))
                    tokens[index].append(int(sessions[index].logits.argmax()))
                    pool.join(sessions[index])
                if step == 8:
                    warm = compiled_on_dynamo["stats"]["unique_graphs"]
                out = pool.step([tokens[sessions.index(m)][-1] for m in pool.members])
                for member, logits in zip(pool.members, out, strict=True):
                    tokens[sessions.index(member)].append(int(logits.argmax()))
        finally:
            tiny_llama.compile = False
        return tokens, warm

    eager, _ = run(False)
    compiled, warm = run(True)
    assert compiled == eager
    assert warm == compiled_on_dynamo["stats"]["unique_graphs"] <= 2 * 3
    assert not compiled_on_dynamo["graph_break"]


def _serve(lm, name, prompts, load, budget=None):
    with PeakMemory(lm.devices) as memory:
        service = Service(lm, build_policy(name, {}), RunSettings(budget=budget), prompts, load, memory)
        return service, service.run()


def test_a_pooled_service_has_the_rows_its_bytes_hold_and_answers_as_alone(tiny_llama):
    prompts = _prompts(tiny_llama, 8, max_new_tokens=10)
    slot = 2 * tiny_llama.kv_heads * tiny_llama.head_dim * 4 * tiny_llama.num_layers
    service, served = _serve(tiny_llama, "h2o", prompts, Load(requests=8, rate=1000.0, pool_bytes=3 * 20 * slot),
                             budget=16)
    assert service.pool is not None and served.joint_because is None
    assert served.pool_rows == 3 and served.pool_allocated == 3 * 17 * slot  # a row: the budget and one slot
    assert max(step["running"] for step in served.timeline) == 3
    for request in served.requests:
        assert _answer(tiny_llama, request) == _alone(tiny_llama, "h2o", request.prompt, 16)


def test_an_unbounded_pool_grows_to_the_requests_running(tiny_llama):
    prompts = _prompts(tiny_llama, 10, max_new_tokens=10)
    service, served = _serve(tiny_llama, "full", prompts, Load(requests=10, rate=10_000.0))
    assert served.pool_rows == 16 and max(step["running"] for step in served.timeline) > 4
    for request in served.requests:
        assert _answer(tiny_llama, request) == _alone(tiny_llama, "full", request.prompt)


def test_a_service_of_a_policy_keeping_queries_per_layer_steps_jointly_once_its_first_prompt_shows_it(tiny_llama):
    prompts = _prompts(tiny_llama, 4)
    service, served = _serve(tiny_llama, "rkv", prompts, Load(requests=4, rate=1000.0), budget=24)
    assert service.pool is None and "queries per layer" in str(served.joint_because)
    assert all(r.finished_s is not None for r in served.requests)


def test_a_service_whose_rows_would_be_bounded_apart_steps_jointly_and_says_why(tiny_llama):
    """A ratio budget bounds a decode-time policy at each prompt's own length: its rows share no rule."""
    prompts = _prompts(tiny_llama, 4)
    service, served = _serve(tiny_llama, "window", prompts, Load(requests=4, rate=1000.0), budget=0.5)
    assert service.pool is None and "its own length" in str(served.joint_because)
    for request in served.requests:
        assert _answer(tiny_llama, request) == _alone(tiny_llama, "window", request.prompt, 0.5)


def test_a_dry_run_counts_the_rows_a_pool_holds(tmp_path):
    """600 tokens of pool: full's rows hold a 256-token prompt and its 4 answer tokens, window's its quarter and a
    slot."""
    config = write_config(tmp_path, LOAD)
    planned = runner.invoke(app, ["sweep", str(config), "--dry-run", "-o", str(tmp_path / "r")])
    assert planned.exit_code == 0, planned.output
    text = " ".join(planned.output.split())
    assert "full 2 at once (a row of" in text and "window at 0.25 9 at once (a row of" in text, text
