"""Each policy keeps exactly the entries its paper's rule says, per layer and KV head (GQA: 4 query
heads share 2 KV heads), after the prompt and after every decode step."""

from __future__ import annotations

import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from tests.conftest import random_ids
from tests.helpers import run_cache
from tests.reference import h2o_reference, snapkv_reference

PROMPT, DECODE, BUDGET = random_ids(96, seed=11), random_ids(10, seed=12), 40


def positions_mask(seen: int, kept: list[int], kv_heads: int) -> torch.Tensor:
    mask = torch.zeros(kv_heads, seen, dtype=torch.bool)
    mask[:, kept] = True
    return mask


@pytest.mark.parametrize("chunk", [None, 32])
def test_window_keeps_the_last_budget_entries(sharp_llama, chunk):
    _, history = run_cache(sharp_llama, build_policy("window"), PROMPT, DECODE, BUDGET, chunk=chunk)
    for step, masks in enumerate(history):
        seen = len(PROMPT) + step
        expected = positions_mask(seen, list(range(seen - BUDGET, seen)), sharp_llama.kv_heads)
        assert all(torch.equal(mask, expected) for mask in masks), f"step {step}"


def test_streaming_llm_keeps_sinks_and_recent(sharp_llama):
    sinks = 4
    _, history = run_cache(sharp_llama, build_policy("streaming_llm", {"sinks": sinks}), PROMPT, DECODE, BUDGET)
    for step, masks in enumerate(history):
        seen = len(PROMPT) + step
        kept = list(range(sinks)) + list(range(seen - (BUDGET - sinks), seen))
        expected = positions_mask(seen, kept, sharp_llama.kv_heads)
        assert all(torch.equal(mask, expected) for mask in masks), f"step {step}"


@pytest.mark.parametrize("recent_ratio", [0.25, 0.5])
def test_h2o_matches_accumulated_attention_reference(sharp_llama, recent_ratio):
    policy = build_policy("h2o", {"recent_ratio": recent_ratio})
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    reference = h2o_reference(sharp_llama, PROMPT, DECODE, BUDGET, recent=round(BUDGET * recent_ratio))
    assert len(history) == len(reference)
    for step, (ours, theirs) in enumerate(zip(history, reference, strict=True)):
        for layer, (mask, expected) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(mask, expected), f"step {step} layer {layer}"
    # heavy hitters really differ per head and from a plain window (else the test proves little)
    last = history[-1][1]
    assert not torch.equal(last[0], last[1])


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_matches_observation_window_reference(sharp_llama, pooling):
    window, prefix = 8, len(PROMPT) - 8
    params = {"window": window, "kernel": 5, "pooling": pooling}
    _, history = run_cache(sharp_llama, build_policy("snapkv", params), PROMPT, DECODE, BUDGET)
    reference = snapkv_reference(sharp_llama, PROMPT, window=window, kernel=5, pooling=pooling)
    for layer, (mask, scores) in enumerate(zip(history[0], reference, strict=True)):
        assert mask[:, prefix:].all(), "the observation window is always kept"
        for head in range(sharp_llama.kv_heads):
            # max pooling makes plateaus of equal scores: compare the kept scores, not which of tied positions
            kept = scores[head][mask[head, :prefix]].sort().values
            best = scores[head].topk(BUDGET - window).values.sort().values
            torch.testing.assert_close(kept, best, msg=f"layer {layer} head {head}")
    # prefill-only: decode tokens are all kept on top of the snapshot
    for step, masks in enumerate(history[1:], start=1):
        for layer, mask in enumerate(masks):
            assert torch.equal(mask[:, : len(PROMPT)], history[0][layer])
            assert mask[:, len(PROMPT) :].all()
            assert mask.shape[1] == len(PROMPT) + step


def test_random_keeps_budget_entries_and_is_seeded(sharp_llama):
    first = run_cache(sharp_llama, build_policy("random", {"seed": 3}), PROMPT, DECODE, BUDGET)[1]
    again = run_cache(sharp_llama, build_policy("random", {"seed": 3}), PROMPT, DECODE, BUDGET)[1]
    other = run_cache(sharp_llama, build_policy("random", {"seed": 4}), PROMPT, DECODE, BUDGET)[1]
    assert all(int(m.sum(-1).max()) == BUDGET for step in first for m in step)
    assert all(torch.equal(a, b) for sa, sb in zip(first, again, strict=True) for a, b in zip(sa, sb, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first[-1], other[-1], strict=True))


@pytest.mark.parametrize("name,params,budget,message", [
    ("streaming_llm", {"sinks": 8}, 8, "no room beyond sinks"),
    ("snapkv", {"window": 32}, 16, "must exceed the observation window"),
    ("h2o", {"recent_ratio": 1.5}, 64, "recent_ratio"),
    ("snapkv", {"kernel": 4}, 64, "odd"),
    ("snapkv", {"pooling": "mean"}, 64, "'max' or 'avg'"),
    ("window", {"sinks": 4}, 64, "has no parameter 'sinks'"),
    ("window", {}, 0, "at least 1"),
])
def test_bad_policy_parameters_are_named(name, params, budget, message):
    with pytest.raises(KvbenchError, match=message):
        build_policy(name, params).check_budget(budget)
