"""Each policy keeps exactly the entries its paper's rule says, per layer and KV head (GQA: 4 query
heads share 2 KV heads), after the prompt and after every decode step."""

from __future__ import annotations

import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.policies import Demand, build_policy
from kvbench.policies.reference import (
    h2o_reference,
    key_norms,
    scissorhands_reference,
    snapkv_reference,
    tova_reference,
)
from tests.conftest import random_ids
from tests.helpers import run_cache

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
        build_policy(name, params).check(Demand(budget=budget))


@pytest.mark.parametrize("per_head", [False, True])
def test_tova_matches_last_query_attention_reference(sharp_llama, per_head):
    _, history = run_cache(sharp_llama, build_policy("tova", {"per_head": per_head}), PROMPT, DECODE, BUDGET)
    reference = tova_reference(sharp_llama, PROMPT, DECODE, BUDGET, per_head=per_head)
    for step, (ours, theirs) in enumerate(zip(history, reference, strict=True)):
        for layer, (mask, expected) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(mask, expected), f"step {step} layer {layer}"
    last = history[-1][0]
    assert torch.equal(last[0], last[1]) != per_head  # one choice per layer, or per KV head


@pytest.mark.parametrize("decode_too", [False, True])
def test_knorm_keeps_the_lowest_key_norms(sharp_llama, decode_too):
    policy = build_policy("knorm", {"decode": decode_too})
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    for layer, (mask, norms) in enumerate(zip(history[0], key_norms(sharp_llama, PROMPT), strict=True)):
        for head in range(sharp_llama.kv_heads):
            kept = norms[head][mask[head]].sort().values
            lowest = norms[head].topk(BUDGET, largest=False).values.sort().values
            torch.testing.assert_close(kept, lowest, msg=f"layer {layer} head {head}")
    held = [int(m.sum(-1).max()) for m in history[-1]]
    assert held == [BUDGET if decode_too else BUDGET + len(DECODE)] * sharp_llama.num_layers


def test_hybrid_is_snapkv_for_the_prompt_then_h2o(sharp_llama):
    snap = {"name": "snapkv", "window": 8, "kernel": 5}
    _, history = run_cache(sharp_llama, build_policy("compose", {"prefill": snap, "decode": "h2o"}), PROMPT, DECODE,
                           BUDGET)
    _, snapkv_only = run_cache(sharp_llama, build_policy("snapkv", {"window": 8, "kernel": 5}), PROMPT, [], BUDGET)
    assert all(torch.equal(a, b) for a, b in zip(history[0], snapkv_only[0], strict=True))
    reference = h2o_reference(sharp_llama, PROMPT, DECODE, BUDGET, recent=BUDGET // 2, prefill_kept=history[0])
    for step, (ours, theirs) in enumerate(zip(history, reference, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), f"step {step}"
    assert build_policy("hybrid").describe() == {"name": "hybrid", "prefill": "snapkv", "decode": "h2o"}


def test_adaptive_switches_at_the_limit_and_not_before(tiny_llama):
    from kvbench.engine.generation import generate
    from kvbench.engine.settings import RunSettings

    slot = 2 * tiny_llama.kv_heads * tiny_llama.head_dim * 4 * tiny_llama.num_layers  # bytes per token
    prompt = PROMPT[:60]
    policy = build_policy("adaptive", {"limit_bytes": 70 * slot, "fallback": "window"})
    result = generate(tiny_llama, policy, prompt, [], RunSettings(budget=32), max_new_tokens=20, eos_token_ids=set())
    m = result.measurements
    assert m["switched_at_token"] == 70 and m["limit_bytes"] == 70 * slot
    assert m["kept_max_ever"] == 70  # the full cache until the limit
    assert m["kept_max"] == 32  # then the fallback at the budget
    never = build_policy("adaptive", {"limit_bytes": 1000 * slot})
    result = generate(tiny_llama, never, prompt, [], RunSettings(budget=32), max_new_tokens=20, eos_token_ids=set())
    assert result.measurements["switched_at_token"] is None and result.measurements["evictions"] == 0


def test_wrapper_parameters_are_checked():
    with pytest.raises(KvbenchError, match="does not evict while decoding"):
        build_policy("compose", {"prefill": "snapkv", "decode": "snapkv"})
    with pytest.raises(KvbenchError, match="unknown policy 'h3o'"):
        build_policy("adaptive", {"fallback": "h3o"})
    with pytest.raises(KvbenchError, match="limit_fraction"):
        build_policy("adaptive", {"limit_fraction": 2.0})


@pytest.mark.parametrize("budget,layers", [(40, 2), (64, 30), (1000, 32), (29, 5)])
@pytest.mark.parametrize("prompt", [None, 4096])
def test_pyramidkv_layer_budgets_fall_with_depth_by_a_whole_step(budget, layers, prompt):
    policy = build_policy("pyramidkv", {"window": 8, "beta": 20})
    budgets = policy.layer_budgets(budget, layers, prompt)
    steps = {a - b for a, b in zip(budgets[:-1], budgets[1:], strict=True)}
    assert len(steps) == 1 and steps.pop() > 0 and budgets[-1] > 8
    # the official step is floored: the total reaches layers x budget and overshoots by less than a step per layer
    assert 0 <= sum(budgets) - layers * budget < layers * (layers - 1) / 2
    with pytest.raises(KvbenchError, match="window \\+ beta"):
        policy.check(Demand(budget=20))


def test_pyramidkv_keeps_each_layers_snapkv_top_set(sharp_llama):
    params = {"window": 8, "kernel": 5, "beta": 4}
    policy = build_policy("pyramidkv", params)
    budgets = policy.layer_budgets(BUDGET, sharp_llama.num_layers, len(PROMPT))  # no cap binds at 96 tokens
    cache, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    reference = snapkv_reference(sharp_llama, PROMPT, window=8, kernel=5, pooling="max")
    for mask, scores, budget in zip(history[0], reference, budgets, strict=True):
        assert int(mask.sum(-1).max()) == budget
        for head in range(sharp_llama.kv_heads):
            kept = scores[head][mask[head, : len(PROMPT) - 8]].sort().values
            torch.testing.assert_close(kept, scores[head].topk(budget - 8).values.sort().values)
    assert [layer.length for layer in cache.layers] == [b + len(DECODE) for b in budgets]


@pytest.mark.parametrize("settings", [{"prefill": "chunked", "prefill_chunk": 32}, {"question": "agnostic"}])
def test_uneven_layer_lengths_run_chunked_and_agnostic(tiny_llama, settings):
    """Layers of different lengths need per-layer masks when several tokens arrive at once."""
    from kvbench.engine.generation import generate
    from kvbench.engine.settings import RunSettings

    result = generate(tiny_llama, build_policy("pyramidkv", {"window": 8, "beta": 4}), PROMPT[:80], PROMPT[80:],
                      RunSettings(budget=BUDGET, **settings), max_new_tokens=4, eos_token_ids=set())
    assert result.measurements["kept_max"] > result.measurements["kept_mean"]  # really uneven


@pytest.mark.parametrize("history,recent", [(8, 4), (32, 10)])
def test_scissorhands_matches_persistence_of_importance_reference(sharp_llama, history, recent):
    policy = build_policy("scissorhands", {"history": history, "recent": recent})
    _, ours = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    reference = scissorhands_reference(sharp_llama, PROMPT, DECODE, BUDGET, history=history, recent=recent)
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        for layer, (mask, expected) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(mask, expected), f"step {step} layer {layer}"


def ada_reference(scores: torch.Tensor, window: int, budget: int, alpha: float) -> torch.Tensor:
    """Ada-KV from its definition (FFY0/AdaKV): every head keeps its window; of the prefix, the layer's
    heads x base highest scores (base = budget - window) are counted per head, and a head with count c keeps its
    round(c x (1 - alpha) + int(base x alpha)) highest. `scores` `[kv_heads, prefix]` (SnapKV's)."""
    heads, prefix = scores.shape
    base = budget - window
    ranked = sorted(((float(scores[h, p]), h) for h in range(heads) for p in range(prefix)), reverse=True)
    counts = [sum(1 for _, h in ranked[: heads * base] if h == head) for head in range(heads)]
    keep = torch.zeros(heads, prefix + window, dtype=torch.bool)
    keep[:, prefix:] = True
    for h in range(heads):
        kept = round(counts[h] * (1 - alpha) + int(base * alpha))  # half to even, as torch.round
        keep[h, scores[h].argsort(descending=True)[:kept]] = True
    return keep


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.6])
def test_ada_kv_shares_the_layer_budget_across_heads_above_a_floor(sharp_llama, alpha):
    window = 8
    policy = build_policy("ada_kv", {"base": {"name": "snapkv", "window": window, "kernel": 5, "pooling": "avg"},
                                     "alpha": alpha})
    cache, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    scores = snapkv_reference(sharp_llama, PROMPT, window=window, kernel=5, pooling="avg")
    uneven = False
    for layer, (mask, layer_scores) in enumerate(zip(history[0], scores, strict=True)):
        counts = mask.sum(-1)
        # heads x budget, less the fraction int() drops from each head's floor, each head's count rounded
        assert abs(int(counts.sum()) - sharp_llama.kv_heads * BUDGET) < 1.5 * sharp_llama.kv_heads, f"layer {layer}"
        assert int(counts.min()) >= window + int(alpha * (BUDGET - window))
        assert torch.equal(mask, ada_reference(layer_scores, window, BUDGET, alpha)), f"layer {layer}"
        uneven |= bool(counts.max() > counts.min())
    assert uneven, "the heads should not all keep the same count here"
    stats = cache.stats()  # padding is allocated, not live: the record says so
    entry = 2 * sharp_llama.head_dim * 4
    kept = sum(int(mask.sum()) for mask in history[0])
    assert stats.kv_bytes_live == (kept + sharp_llama.kv_heads * len(DECODE) * sharp_llama.num_layers) * entry
    assert stats.kv_bytes_physical > stats.kv_bytes_live
    with pytest.raises(KvbenchError, match="cannot be followed"):
        build_policy("compose", {"prefill": "ada_kv", "decode": "h2o"})


def test_ada_kv_refuses_chunked_prefill(tiny_llama):
    from kvbench.engine.generation import generate
    from kvbench.engine.settings import RunSettings

    with pytest.raises(KvbenchError, match="prefill mode 'full'"):
        generate(tiny_llama, build_policy("ada_kv"), PROMPT, [], RunSettings(budget=48, prefill="chunked"),
                 max_new_tokens=2, eos_token_ids=set())
