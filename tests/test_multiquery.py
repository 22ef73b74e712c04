"""Multi-query tasks: access patterns, forks that see no other request, a conversation that holds its answers."""

from __future__ import annotations

import random

import pytest

from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task
from tests.conftest import needs_embedded
from tests.helpers import model_approx


def test_access_patterns_give_the_documented_orders():
    assert build_task("multiquery", {"facts": 5}).order(random.Random(0)) == [0, 1, 2, 3, 4]
    shuffled = build_task("multiquery", {"facts": 6, "pattern": "random"})
    order = shuffled.order(random.Random(1))
    assert sorted(order) == list(range(6)) and order != list(range(6))
    assert order == shuffled.order(random.Random(1))  # seeded
    hot = build_task("multiquery", {"facts": 8, "pattern": "hotspot", "hotspot_share": 1.0, "queries": 20})
    asked = hot.order(random.Random(2))
    assert len(asked) == 20 and max(asked) - min(asked) < 2  # one quarter of 8 facts: 2 neighbours
    mixed = build_task("multiquery", {"facts": 8, "pattern": "hotspot", "hotspot_share": 0.5, "queries": 200})
    assert len(set(mixed.order(random.Random(3)))) > 2
    with pytest.raises(KvbenchError, match="pattern"):
        build_task("multiquery", {"pattern": "zigzag"})


def run(lm, mode: str, policy: str = "full", budget=None):
    task = build_task("multiquery", {"facts": 3, "mode": mode, "answer_tokens": 4})
    sample = task.samples(lm.tokenizer, 400, 1, 0)[0]
    return sample, evaluate(lm, task, build_policy(policy), sample, RunSettings(budget=budget), 400, 0)


def test_each_request_forks_the_same_compressed_context(tiny_llama):
    sample, record = run(tiny_llama, "multi_request", "window", 64)
    positions = [q["position"] for q in record["questions"]]
    assert len(set(positions)) == 1  # every question starts from the compressed context, no earlier answer
    assert record["query_order"] == [0, 1, 2] and set(record["scores"]) == {"score", "q0", "q1", "q2"}
    assert record["kept_max"] <= 65  # the parent stays at its budget; each fork evicts its own


def test_a_conversation_holds_its_earlier_answers(tiny_llama):
    _, record = run(tiny_llama, "multi_turn")
    positions = [q["position"] for q in record["questions"]]
    assert positions[0] < positions[1] < positions[2]
    # each later question starts after the previous question and its (at most 4-token) answer
    assert positions[2] - positions[1] >= 4 and record["generated_tokens"] == 3 * 4


@needs_embedded
def test_the_embedded_model_finds_the_facts_with_a_full_cache(smollm):
    task = build_task("multiquery", {"facts": 2, "mode": "multi_turn"})
    sample = task.samples(smollm.tokenizer, 600, 1, 0)[0]
    record = evaluate(smollm, task, build_policy("full"), sample, RunSettings(), 600, 0)
    assert record["scores"]["score"] > 0, record["questions"]


def test_long_generation_scores_the_reference_through_the_cache_and_records_the_length(tiny_llama):
    import math

    import torch

    task = build_task("longgen", {"length": 24})
    sample = task.samples(tiny_llama.tokenizer, 100, 1, 0)[0]
    full = evaluate(tiny_llama, task, build_policy("full"), sample, RunSettings(), 100, 0)
    ids = sample.token_ids + sample.meta["continuation"]
    with torch.no_grad():
        logits = tiny_llama.model(input_ids=torch.tensor([ids])).logits[0, 99:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(sample.meta["continuation"]))
    assert full["scores"]["nll"] == model_approx(tiny_llama, float(nll))  # the model's own loss
    assert full["scores"]["score"] == pytest.approx(math.exp(full["scores"]["nll"]))
    window = evaluate(tiny_llama, task, build_policy("window"), sample, RunSettings(budget=32), 100, 0)
    assert window["scores"]["nll"] != model_approx(tiny_llama, full["scores"]["nll"])
    assert window["kept_max"] <= 33 and window["budget_scope"] == "decode"  # the budget held to the end
    assert full["generated_tokens"] <= 24 and len(window["nll_by_position"]) == 24
