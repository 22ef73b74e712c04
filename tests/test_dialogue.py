"""Dialogue: one cache for the whole conversation, replies generated into it, nothing fed twice."""

from __future__ import annotations

import pytest

from kvbench.engine.models import byte_tokenizer
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task
from kvbench.tasks.dialogue import _matches


def recorded_forwards(lm, monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(input ids, position ids) of every forward the model runs."""
    calls = []
    original = lm.model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist()))
        return original(*args, **kwargs)

    monkeypatch.setattr(lm.model, "forward", spy)
    return calls


def test_the_conversation_streams_through_one_cache(tiny_llama, monkeypatch):
    task = build_task("dialogue", {"facts": 3, "passage_tokens": 120, "reply_tokens": 6, "answer_tokens": 4})
    sample = task.samples(tiny_llama.tokenizer, 1500, 1, seed=0)[0]
    calls = recorded_forwards(tiny_llama, monkeypatch)
    record = evaluate(tiny_llama, task, build_policy("full"), sample, RunSettings(), 1500, seed=0)
    positions = [p for _, ids in calls for p in ids]
    # every token goes in once, at the next position: no re-prefill of the conversation
    assert positions == list(range(len(positions)))
    stream = tiny_llama.tokenizer.decode([t for ids, _ in calls for t in ids])
    replies = [ids for ids, _ in calls if len(ids) == 1]
    assert len(replies) >= len(sample.turns) * 3  # generated tokens were fed back into the same cache
    assert record["kept_max_ever"] == len(positions) and record["cache_ratio"] == 1.0
    # with the full cache every fact is in the prompt before its question: a reference check
    for fact in sample.meta["facts"]:
        assert stream.index(fact["statement"]) < stream.index(fact["question"])
    assert abs(record["prompt_tokens"] - 1500) <= 0.05 * 1500
    assert [q["expected"] for q in record["questions"]] == sample.answers
    assert all(q["distance"] > 0 for q in record["questions"])


def test_the_policy_bounds_the_conversation(tiny_llama):
    task = build_task("dialogue", {"facts": 2, "passage_tokens": 100, "reply_tokens": 8, "answer_tokens": 4})
    sample = task.samples(tiny_llama.tokenizer, 1200, 1, seed=0)[0]
    h2o = evaluate(tiny_llama, task, build_policy("h2o"), sample, RunSettings(budget=200), 1200, seed=0)
    snapkv = evaluate(tiny_llama, task, build_policy("snapkv"), sample, RunSettings(budget=200), 1200, seed=0)
    longest_turn = max(len(tiny_llama.tokenizer(t["text"]).input_ids) for t in sample.turns) + 40
    assert h2o["kept_max_ever"] <= 200 + longest_turn  # evicts while replying too
    assert snapkv["kept_mean"] > 200  # one snapshot per user turn: replies pile up until the next turn
    assert h2o["scores"].keys() >= {"score"} and all(k.startswith(("score", "distance_")) for k in h2o["scores"])


def test_exact_match_and_errors():
    assert _matches("It is Rosa.", "Rosa") and _matches("the locker number is 216", "216")
    assert not _matches("Rosalind", "Rosa") and not _matches("2160", "216")
    with pytest.raises(KvbenchError, match="facts"):
        build_task("dialogue", {"facts": 9})
    with pytest.raises(KvbenchError, match="too short"):
        build_task("dialogue").samples(byte_tokenizer(), 300, 1, 0)
