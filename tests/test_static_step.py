"""The decode step on static buffers (kvbench/engine/step.py): what it keeps, counts and computes is what the
dynamic layout keeps, counts and computes, for every policy that steps on it; it asks the host nothing; and it compiles
to one graph that is not recompiled as the cache evicts."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.cache import KVCache, step_blocker
from kvbench.engine.generation import Prompt, generate, generate_rows
from kvbench.engine.instruments import StepWork
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.policies import POLICIES
from tests.conftest import random_ids
from tests.helpers import assert_model_close, tiny_policy

PROMPT = random_ids(96, seed=31)
TIMING = {"prefill_tok_s", "decode_tok_s", "ttft_s", "tpot_s", "prefill_s", "decode_s", "calibration_s"}
NO_BUDGET = {"full", "quant", "mixed_precision", "lowrank", "think"}
# budgets that evict on these prompts and that every policy's own limits admit (pyramidkv: window + beta)
BUDGETS = {"pyramidkv": 60}


def dynamic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cache steps on the dynamic layout, as before static buffers."""
    monkeypatch.setattr(KVCache, "static_blocker", lambda self, compiled=False: "the dynamic layout, for a test")


def records(generations) -> list[tuple[list[int], dict]]:
    return [(g.tokens, {k: v for k, v in g.measurements.items() if k not in TIMING and not k.startswith("mem_")
                        and k != "limit_bytes"}) for g in generations]  # adaptive's limit: a share of free memory


def both(monkeypatch: pytest.MonkeyPatch, run):
    """`run()` on static buffers, then on the dynamic layout."""
    static = run()
    with monkeypatch.context() as patched:
        dynamic(patched)
        return static, run()


def steppable(name: str) -> bool:
    return step_blocker(tiny_policy(name)) is None


STATIC = sorted(name for name in POLICIES.names() if steppable(name))


def test_most_policies_step_on_static_buffers():
    assert {"full", "window", "streaming_llm", "snapkv", "h2o", "tova", "ada_kv", "scissorhands", "rkv",
            "pyramidkv", "compose", "adaptive"} <= set(STATIC)
    assert not steppable("quant") and not steppable("random") and not steppable("quest")


@pytest.mark.parametrize("evict_every", [1, 4])
@pytest.mark.parametrize("name", STATIC)
def test_a_policy_keeps_and_counts_on_static_buffers_what_it_does_on_the_dynamic_layout(tiny_llama, monkeypatch,
                                                                                        name, evict_every):
    budget = None if name in NO_BUDGET else BUDGETS.get(name, 40)
    settings = RunSettings(budget=budget, evict_every=evict_every)

    def run():
        return [generate(tiny_llama, tiny_policy(name), PROMPT, [], settings, max_new_tokens=24, eos_token_ids=set())]

    static, plain = both(monkeypatch, run)
    assert records(static) == records(plain)
    assert_model_close(tiny_llama, static[0].last_logits, plain[0].last_logits)


@pytest.mark.parametrize("name", ["full", "window", "streaming_llm", "h2o", "tova", "snapkv", "scissorhands", "rkv"])
def test_a_left_padded_batch_on_static_buffers_is_each_rows_own(tiny_llama, monkeypatch, name):
    prompts = [Prompt(PROMPT[:n], [], m) for n, m in ((96, 20), (70, 12), (88, 16))]
    settings = RunSettings(budget=None if name == "full" else 40)
    static, plain = both(monkeypatch, lambda: generate_rows(tiny_llama, tiny_policy(name), prompts, settings,
                                                            eos_token_ids=set()))
    assert records(static) == records(plain)


@pytest.mark.parametrize("shape", ["tiny-gemma3", "tiny-gemma2"])
@pytest.mark.parametrize("name", ["full", "window", "streaming_llm", "h2o", "tova", "snapkv", "kvzip"])
def test_sliding_and_soft_capped_layers_on_static_buffers(shape, monkeypatch, name):
    from kvbench.engine.models import load_model

    lm = load_model(f"random:{shape}", dtype="float32", device="cpu")
    settings = RunSettings(budget=None if name == "full" else 6)  # below the sliding window (8) too

    params = {"window": 4} if name == "snapkv" else {}

    def run():
        return [generate(lm, tiny_policy(name, params), PROMPT[:60], [], settings, max_new_tokens=20,
                         eos_token_ids=set())]

    static, plain = both(monkeypatch, run)
    assert records(static) == records(plain)


def test_full_on_static_buffers_is_bit_identical_to_the_dynamic_layout(tiny_llama, monkeypatch):
    """Eager steps of a layer whose entries fill a prefix of its slots attend over just that prefix, unmasked: the
    stock attention (`StaticSlots.exact`)."""
    def run():
        return [generate(tiny_llama, tiny_policy("full"), PROMPT, [], RunSettings(), 16, eos_token_ids=set())]

    static, plain = both(monkeypatch, run)
    assert torch.equal(static[0].last_logits, plain[0].last_logits)


def test_the_cache_steps_on_buffers_that_do_not_move(tiny_llama):
    session = Session(tiny_llama, tiny_policy("h2o"), RunSettings(budget=40), len(PROMPT), adds=32)
    with session:
        session.prefill(PROMPT)
        session.step(5)
        layer = session.cache.layers[0]
        buffers = [layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr()]
        for token in random_ids(30, seed=32):
            session.step(token)
            assert session.cache.static
            assert [layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr()] == buffers
            assert int(layer.held_slots().sum(-1).max()) == 40  # the budget, the new token's slot free again
    assert session.measurements()["evictions"] > 0


@pytest.mark.parametrize("name", ["full", "window", "streaming_llm", "snapkv", "h2o", "tova", "ada_kv", "rkv"])
def test_a_static_step_reads_nothing_back_from_the_device(tiny_llama, name):
    budget = None if name == "full" else 40
    settings = RunSettings(budget=budget, evict_every=4 if name == "rkv" else 1)
    session = Session(tiny_llama, tiny_policy(name), settings, len(PROMPT), adds=16)
    with session:
        session.prefill(PROMPT)
        token = torch.tensor([7])
        for _ in range(3):
            token = session.step(token).argmax(-1)
        with StepWork() as work:
            for _ in range(8):  # evicting steps, and a due step for every 4
                token = session.step(token).argmax(-1)
    assert session.cache.static and work.ops > 0
    assert not work.syncs, dict(work.syncs)


@pytest.mark.parametrize("name", ["full", "window", "streaming_llm", "snapkv", "h2o", "tova", "scissorhands",
                                  "rkv", "ada_kv", "compose"])
def test_a_compiled_step_is_one_graph_kept_across_evicting_steps(tiny_llama, compiled_on_dynamo, name):
    """No graph break, the eager step's tokens, and after the first steps (a prefill-time policy's buffer, sized
    for the prompt, grows once as it does on the dynamic layout; a policy evicting every few steps has a graph for
    a step that evicts and one that does not) no new graph over 56 more steps, evicting at every one."""
    budget = None if name == "full" else 40
    settings = RunSettings(budget=budget, evict_every=8 if name == "rkv" else 1)
    tokens = random_ids(64, seed=33)

    def run(compile: bool) -> tuple[Session, list[int]]:
        tiny_llama.compile = compile
        session = Session(tiny_llama, tiny_policy(name), settings, len(PROMPT), adds=len(tokens))
        try:
            with session:
                session.prefill(PROMPT)
                for step, token in enumerate(tokens):
                    session.step(token)
                    if step == 7:
                        warm = compiled_on_dynamo["stats"]["unique_graphs"]
        finally:
            tiny_llama.compile = False
        return session, warm

    eager, _ = run(False)
    compiled, warm = run(True)
    assert compiled.logits is not None and eager.logits is not None
    assert_model_close(tiny_llama, compiled.logits, eager.logits)
    assert compiled.measurements()["evictions"] == eager.measurements()["evictions"]
    assert 1 <= warm == compiled_on_dynamo["stats"]["unique_graphs"] <= 3
    assert not compiled_on_dynamo["graph_break"]


def test_inductor_compiles_a_step_that_matches_the_eager_one(tiny_llama, fresh_inductor):
    """The real compiler (inductor's generated code), on one policy that evicts while decoding."""
    settings = RunSettings(budget=40)
    eager = generate(tiny_llama, tiny_policy("h2o"), PROMPT, [], settings, max_new_tokens=24, eos_token_ids=set())
    tiny_llama.compile = True
    try:
        compiled = generate(tiny_llama, tiny_policy("h2o"), PROMPT, [], settings, max_new_tokens=24,
                            eos_token_ids=set())
    finally:
        tiny_llama.compile = False
    assert compiled.tokens == eager.tokens
    assert_model_close(tiny_llama, compiled.last_logits, eager.last_logits)
    assert compiled.measurements["kv_bytes_live"] == eager.measurements["kv_bytes_live"]
