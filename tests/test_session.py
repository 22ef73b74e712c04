"""The engine session: scoring through the compressed cache, forks that share nothing, pending tokens, phases."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.cache import Phase
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from tests.conftest import random_ids
from tests.helpers import assert_model_close

CONTEXT, CONTINUATION = random_ids(120, seed=11), random_ids(20, seed=12)


def one_pass_logprobs(lm, context: list[int], continuation: list[int]) -> torch.Tensor:
    """The stock model over context + continuation: each continuation token's log-probability."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([context + continuation])).logits[0].float()
    table = logits[len(context) - 1 : -1].log_softmax(-1)
    return table.gather(-1, torch.tensor(continuation)[:, None])[:, 0]


def scored(lm, policy: str, budget: int | None, chunk: int | None = None):
    session = Session(lm, build_policy(policy), RunSettings(budget=budget), prompt_tokens=len(CONTEXT),
                      arrival=chunk or len(CONTINUATION))
    with session:
        session.prefill(CONTEXT)
        result = session.score(CONTINUATION, chunk=chunk)
    return session, result


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_score_through_a_cache_that_holds_everything_is_the_models_own(tiny_llama, chunk):
    _, result = scored(tiny_llama, "window", budget=len(CONTEXT) + len(CONTINUATION), chunk=chunk)
    assert_model_close(tiny_llama, result.logprobs, one_pass_logprobs(tiny_llama, CONTEXT, CONTINUATION))
    full, _ = scored(tiny_llama, "full", budget=None, chunk=chunk)
    assert full.cache.evictions == 0 and full.pending == CONTINUATION[-1:]


@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv"])
def test_score_really_goes_through_the_compressed_cache(sharp_llama, policy):
    session, small = scored(sharp_llama, policy, budget=40)
    _, roomy = scored(sharp_llama, policy, budget=len(CONTEXT) + len(CONTINUATION))
    assert session.cache.evictions > 0
    assert (small.logprobs - roomy.logprobs).abs().max() > 1e-3
    assert small.greedy.dtype == torch.bool and small.greedy.shape == (len(CONTINUATION),)
    if policy != "snapkv":  # a decode-time policy keeps evicting while the continuation arrives
        assert max(layer.length for layer in session.cache.layers) <= 40


def test_a_fresh_session_scores_every_token_but_the_first(tiny_llama):
    text = CONTEXT + CONTINUATION
    session = Session(tiny_llama, build_policy("full"), RunSettings(), prompt_tokens=len(text), arrival=16)
    with session:
        result = session.score(text, chunk=16)
    assert_model_close(tiny_llama, result.logprobs, one_pass_logprobs(tiny_llama, text[:1], text[1:]))
    assert session.cache.phase is Phase.DECODE  # the first chunk was the prompt, the rest streamed as decode
    assert session.measurements()["budget_scope"] == "none"


@pytest.mark.parametrize(("policy", "bounded"), [("snapkv", False), ("window", True), ("hybrid", True)])
def test_streamed_text_is_a_prompt_then_a_continuation(sharp_llama, policy, bounded):
    """A fresh session's first chunk is compressed as a prompt; after it only a decode-time policy (or a hybrid's
    decode stage) evicts, so a prefill-time policy's cache grows with the text."""
    text, chunk, budget = CONTEXT + CONTINUATION, 48, 40
    session = Session(sharp_llama, build_policy(policy), RunSettings(budget=budget), prompt_tokens=len(text),
                      arrival=chunk)
    phases = []
    session.cache.compress = lambda original=session.cache.compress: (phases.append(session.cache.phase),
                                                                      original())[1]
    with session:
        session.score(text, chunk=chunk)
    held = max(layer.length for layer in session.cache.layers)
    assert phases[0] is Phase.PREFILL and set(phases[1:]) <= {Phase.DECODE}
    assert held == (budget if bounded else budget + len(text) - 1 - chunk)
    assert session.measurements()["budget_scope"] == ("decode" if bounded else "prefill")


def test_a_fork_shares_nothing_mutable(sharp_llama):
    question_a, question_b = random_ids(6, seed=13), random_ids(6, seed=14)
    session = Session(sharp_llama, build_policy("h2o"), RunSettings(budget=48), prompt_tokens=len(CONTEXT),
                      arrival=6, adds=16)
    with session:
        session.prefill(CONTEXT)
    before = [(layer.live_keys().clone(), layer.live_positions().clone()) for layer in session.cache.layers]
    answers = []
    for question in (question_a, question_b, question_a):
        with session.fork() as branch:
            branch.append(question)
            answers.append(branch.decode(8, eos=set())[0])
    assert answers[0] == answers[2] and answers[0] != answers[1]
    for layer, (keys, positions) in zip(session.cache.layers, before, strict=True):
        assert torch.equal(layer.live_keys(), keys) and torch.equal(layer.live_positions(), positions)
    # a fork answers as a session built from scratch does
    alone = Session(sharp_llama, build_policy("h2o"), RunSettings(budget=48), prompt_tokens=len(CONTEXT),
                    arrival=6, adds=16)
    with alone:
        alone.prefill(CONTEXT)
        alone.append(question_a)
        assert alone.decode(8, eos=set())[0] == answers[0]


def test_a_generated_token_is_fed_with_what_comes_next(tiny_llama):
    session = Session(tiny_llama, build_policy("full"), RunSettings(), prompt_tokens=len(CONTEXT), arrival=8)
    with session:
        session.prefill(CONTEXT)
        tokens = session.decode(5, eos=set())[0]
        assert session.pending == tokens[-1:] and session.seen == len(CONTEXT) + 4
        session.append(CONTINUATION[:3])
        assert session.pending == [] and session.seen == len(CONTEXT) + 5 + 3
    stock = torch.tensor([CONTEXT + tokens + CONTINUATION[:3]])
    with torch.inference_mode():
        expected = tiny_llama.model(input_ids=stock).logits[:, -1]
    assert_model_close(tiny_llama, session.logits, expected)
    measured = session.measurements()
    assert measured["prompt_tokens"] == len(CONTEXT) + 4 and measured["generated_tokens"] == 5


def test_the_phase_is_the_sessions(tiny_llama):
    session = Session(tiny_llama, build_policy("snapkv", {"window": 8}), RunSettings(budget=40),
                      prompt_tokens=len(CONTEXT), adds=16)
    assert session.cache.phase is Phase.PREFILL
    with session:
        session.prefill(CONTEXT)
        assert session.cache.phase is Phase.DECODE and session.cache.layers[0].length == 40
        session.decode(6, eos=set())
    assert session.cache.layers[0].length == 45  # a prefill-time policy lets the generation grow
    assert session.measurements()["budget_scope"] == "prefill"


def test_decode_needs_a_prediction_and_measurements_a_with_block(tiny_llama):
    session = Session(tiny_llama, build_policy("full"), RunSettings(), prompt_tokens=4)
    with pytest.raises(RuntimeError, match="prefill"):
        session.decode(2, eos=set())
    with pytest.raises(RuntimeError, match="with session"):
        session.measurements()


def documented_example(marker: str) -> str:
    """The python block of docs/extending.md that contains `marker`."""
    import re
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "extending.md").read_text()
    return next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if marker in block)


def test_the_documented_task_runs_on_session_calls(tiny_llama):
    """docs/extending.md's "Adding a task" example, executed as written."""
    from kvbench.tasks import TASKS, Sample

    if "ask_twice" not in TASKS.names():
        exec(compile(documented_example("class AskTwice"), "docs/extending.md", "exec"), {})
    task = TASKS.build("ask_twice")
    sample = Sample("s0", context=" ".join(["word"] * 60), question="", answers=["x"],
                    meta={"questions": ["one?", "two?"]})
    generation = task.run(tiny_llama, build_policy("window"), sample, RunSettings(budget=32))
    assert generation.prediction.count("|") == 1 and generation.measurements["kept_max"] <= 33
    assert task.score(generation.prediction, sample)["score"] in (0.0, 1.0)


def test_the_documented_policy_keeps_what_it_says(tiny_llama):
    """docs/extending.md's "Adding a policy" example, executed as written: its score (the position) keeps the
    newest entries, as `window` does."""
    from kvbench.policies import POLICIES

    if "oldest_first" not in POLICIES.names():
        exec(compile(documented_example("class OldestFirst"), "docs/extending.md", "exec"), {})
    prompt, decode = random_ids(80, seed=3), random_ids(6, seed=4)
    kept = []
    for name in ("oldest_first", "window"):
        session = Session(tiny_llama, build_policy(name), RunSettings(budget=24), prompt_tokens=len(prompt), adds=8)
        session.prefill(prompt)
        for token in decode:
            session.step(token)
        kept.append([layer.live_positions().sort(dim=-1).values for layer in session.cache.layers])
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))


def test_a_shared_prefill_bills_each_policys_statistics_to_it_alone(tiny_llama, monkeypatch):
    """A fake clock in which H2O's statistics take 10 s a layer: in a group where H2O is the only policy that
    observes, `full` and `window` must not be charged for them."""
    import time

    from kvbench.engine.generation import generate
    from kvbench.engine.sharing import shared_prefill
    from kvbench.policies.h2o import H2O

    now = [0.0]

    def clock() -> float:
        now[0] += 1e-6
        return now[0]

    observe = H2O.observe

    def slow_observe(self, *args):
        now[0] += 10.0
        return observe(self, *args)

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(H2O, "observe", slow_observe)
    policies = {name: build_policy(name) for name in ("full", "window", "h2o")}
    prompt = random_ids(60, seed=15)
    shared = shared_prefill(tiny_llama, prompt, list(policies.values()))
    ttft = {name: generate(tiny_llama, policy, prompt, [], RunSettings(budget=32), max_new_tokens=2,
                           eos_token_ids=set(), shared=shared).measurements["ttft_s"]
            for name, policy in policies.items()}
    layers = tiny_llama.num_layers
    assert ttft["full"] < 1 and ttft["window"] < 1
    assert 10 * layers <= ttft["h2o"] < 10 * layers + 1
