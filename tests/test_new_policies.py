"""KeyDiff, LagKV and ChunkKV keep what their definitions say, checked against plain-loop references computed
over a stock cache (GQA: 4 query heads share 2 KV heads), plus their parameter errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvbench.policies.chunkkv
import kvbench.policies.keydiff
import kvbench.policies.lagkv  # noqa: F401  (registers the three)
from kvbench.checks.tolerance import sum_roundings
from kvbench.errors import KvbenchError
from kvbench.policies import Demand, build_policy
from kvbench.policies.reference import key_norms, simulate, snapkv_reference, stock_forward
from tests.conftest import random_ids
from tests.helpers import assert_close, run_cache

PROMPT, DECODE, BUDGET = random_ids(96, seed=11), random_ids(10, seed=12), 40


@torch.no_grad()
def stock_kv(lm, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, every prompt key and value `[kv_heads, n, head_dim]` from a stock cache."""
    cache = DynamicCache()
    stock_forward(lm, cache, prompt, 0)
    return [(cache.layers[layer].keys[0], cache.layers[layer].values[0]) for layer in range(lm.num_layers)]


@torch.no_grad()
def simulate_keys(lm, prompt: list[int], decode: list[int], rule) -> list[list[torch.Tensor]]:
    """`tests.reference.simulate`, with `rule(keys, alive, seen)` seeing each layer's stock keys `[kv_heads, seen,
    d]` (attention masked to what is kept) and the kept-so-far-plus-new mask `[kv_heads, seen]`."""
    cache = DynamicCache()
    return simulate(lm, prompt, decode, lambda layer, weights, alive, seen, new: rule(
        cache.layers[layer].keys[0], alive, seen), cache=cache)


def top(scores, candidates: list[int], count: int) -> list[int]:
    """The `count` candidates with the highest `scores`."""
    return sorted(candidates, key=lambda p: -float(scores[p]))[:count]


def assert_same_history(ours, theirs):
    assert len(ours) == len(theirs)
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
        for layer, (mask, reference) in enumerate(zip(mine, expected, strict=True)):
            assert torch.equal(mask, reference), f"step {step} layer {layer}"


# --- KeyDiff ------------------------------------------------------------------------------------------------

def keydiff_scores(keys: torch.Tensor, alive: list[int]) -> dict[int, float]:
    """Minus each alive key's cosine similarity to the mean of the alive keys scaled to unit length."""
    anchor = sum(keys[p] / keys[p].norm() for p in alive) / len(alive)
    return {p: -float(keys[p] @ anchor / (keys[p].norm() * anchor.norm())) for p in alive}


@pytest.mark.parametrize("decode_too", [False, True])
def test_keydiff_keeps_the_keys_least_like_the_mean_key(sharp_llama, decode_too):
    def rule(keys, alive, seen):
        if (seen > len(PROMPT) and not decode_too) or int(alive[0].sum()) <= BUDGET:
            return alive
        kept = torch.zeros_like(alive)
        for h in range(alive.shape[0]):
            scores = keydiff_scores(keys[h], alive[h].nonzero().flatten().tolist())
            kept[h, top(scores, list(scores), BUDGET)] = True
        return kept

    _, history = run_cache(sharp_llama, build_policy("keydiff", {"decode": decode_too}), PROMPT, DECODE, BUDGET)
    assert_same_history(history, simulate_keys(sharp_llama, PROMPT, DECODE, rule))
    held = [int(m.sum(-1).max()) for m in history[-1]]
    assert held == [BUDGET if decode_too else BUDGET + len(DECODE)] * sharp_llama.num_layers
    # not just the lowest key norms (knorm) nor a window
    _, knorm = run_cache(sharp_llama, build_policy("knorm"), PROMPT, [], BUDGET)
    assert not all(torch.equal(a, b) for a, b in zip(history[0], knorm[0], strict=True))
    assert not torch.equal(history[0][0][0], history[0][0][1])


def test_keydiff_leaves_a_padded_rows_padding_out_of_its_mean(sharp_llama):
    """In a left-padded batch each row keeps what it keeps alone: padding is no part of the mean key."""
    from kvbench.engine.session import Session
    from kvbench.engine.settings import RunSettings

    short, long, budget = random_ids(30, seed=1), random_ids(46, seed=2), 20
    batched = Session(sharp_llama, build_policy("keydiff"), RunSettings(budget=budget), 46,
                      left_padding=torch.tensor([16, 0]))
    batched.prefill(torch.tensor([[0] * 16 + short, long]))
    for row, prompt in enumerate([short, long]):
        alone = Session(sharp_llama, build_policy("keydiff"), RunSettings(budget=budget), len(prompt))
        alone.prefill(prompt)
        for mine, theirs in zip(batched.cache.layers, alone.cache.layers, strict=True):
            assert torch.equal(mine.live_positions()[row].sort(-1).values, theirs.live_positions()[0].sort(-1).values)


# --- LagKV --------------------------------------------------------------------------------------------------

def std(x: torch.Tensor) -> float:
    mean = sum(float(v) for v in x) / len(x)
    return (sum((float(v) - mean) ** 2 for v in x) / (len(x) - 1)) ** 0.5


def lag_scores(states: torch.Tensor, sink: int, lag: int, parts: int) -> list[torch.Tensor]:
    """Per scored partition, its tokens' softmax over the partition of the std over channels of the state
    normalised by the next partition's per-channel min and max. `states` `[n, d]` of one head."""
    scores = []
    for p in range(parts):
        reference = states[sink + (p + 1) * lag : sink + (p + 2) * lag]
        low, high = reference.min(dim=0).values, reference.max(dim=0).values
        spread = torch.tensor([std((states[sink + p * lag + t] - low) / (high - low)) for t in range(lag)])
        scores.append(spread.softmax(dim=0))
    return scores


def lagkv_reference(keys, values, sink: int, lag: int, budget: int, cross: bool) -> torch.Tensor:
    """LagKV's kept mask `[kv_heads, n]`: the sinks, the last whole partition and what follows it, and of
    each other partition an equal share of its best tokens by (key score + value score) / 2, the ones left
    over going to the latest partitions; with `cross`, the best of all partitions together."""
    heads, n, _ = keys.shape
    parts = (n - sink) // lag - 1
    end = sink + parts * lag
    assert parts >= 2 and budget > sink + n - end, "the test should score several partitions"
    room = budget - sink - (n - end)
    kept = torch.zeros(heads, n, dtype=torch.bool)
    kept[:, :sink] = kept[:, end:] = True
    for h in range(heads):
        scores = [(k + v) / 2 for k, v in zip(lag_scores(keys[h], sink, lag, parts),
                                                 lag_scores(values[h], sink, lag, parts), strict=True)]
        if cross:
            flat = torch.cat(scores)
            kept[h, [sink + i for i in top(flat, list(range(parts * lag)), room)]] = True
            continue
        share, extra = divmod(room, parts)
        for p in range(parts):
            count = share + (1 if p >= parts - extra else 0)
            kept[h, [sink + p * lag + t for t in top(scores[p], list(range(lag)), count)]] = True
    return kept


@pytest.mark.parametrize("sink,lag,cross", [(4, 8, False), (2, 12, False), (4, 8, True)])
def test_lagkv_keeps_each_partitions_best_by_lag_relative_spread(sharp_llama, sink, lag, cross):
    policy = build_policy("lagkv", {"sink_size": sink, "lag_size": lag, "cross_scoring": cross})
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    uneven = False
    for layer, (mask, (keys, values)) in enumerate(zip(history[0], stock_kv(sharp_llama, PROMPT), strict=True)):
        expected = lagkv_reference(keys, values, sink, lag, BUDGET, cross)
        assert torch.equal(mask, expected), f"layer {layer}"
        per_part = expected[:, sink : sink + lag * ((len(PROMPT) - sink) // lag - 1)].view(2, -1, lag).sum(-1)
        uneven |= bool(per_part.max() > per_part.min())
    assert uneven, "the shares should differ across partitions (leftovers; or cross-scoring)"
    for step, masks in enumerate(history[1:], start=1):  # prefill only
        assert all(torch.equal(m[:, : len(PROMPT)], first) for m, first in zip(masks, history[0], strict=True))
        assert all(m.shape[1] == len(PROMPT) + step and m[:, len(PROMPT) :].all() for m in masks)


@pytest.mark.parametrize("prompt,lag,budget", [(60, 32, 20), (96, 16, 24)])
def test_lagkv_keeps_sinks_and_recent_when_nothing_is_scored(sharp_llama, prompt, lag, budget):
    """Too short a prompt to score (kvpress's fallback), or a budget below the sinks plus the kept tail."""
    _, history = run_cache(sharp_llama, build_policy("lagkv", {"lag_size": lag}), PROMPT[:prompt], [], budget)
    expected = torch.zeros(sharp_llama.kv_heads, prompt, dtype=torch.bool)
    expected[:, :4] = expected[:, prompt - (budget - 4) :] = True
    assert all(torch.equal(mask, expected) for mask in history[0])


def test_lagkv_runs_a_chunked_prefill(sharp_llama):
    _, history = run_cache(sharp_llama, build_policy("lagkv", {"lag_size": 8}), PROMPT, [], BUDGET, chunk=32)
    for mask in history[0]:
        assert mask.sum(-1).tolist() == [BUDGET] * sharp_llama.kv_heads
        assert mask[:, :4].all() and mask[:, -12:].all()  # sinks, the last partition and the remainder


# --- ChunkKV ------------------------------------------------------------------------------------------------

def chunkkv_reference(scores: torch.Tensor, n: int, chunk: int, budget: int) -> torch.Tensor:
    """ChunkKV's kept mask `[kv_heads, n]` given the base's scores `[kv_heads, m]` of positions `0..m-1` (the
    base always keeps `m..n-1`): chunks of `chunk` positions ranked by their mean score summed over heads (the
    later of equal ones first) are kept whole, the last one taken only as far as the budget reaches."""
    heads, m = scores.shape
    chunks = [list(range(start, min(start + chunk, m))) for start in range(0, m, chunk)]
    value = [sum(float(scores[h, c].mean()) for h in range(heads)) for c in chunks]
    kept = torch.zeros(n, dtype=torch.bool)
    kept[m:] = True
    room = budget - (n - m)
    for i in sorted(range(len(chunks)), key=lambda i: (-value[i], -i)):
        take = chunks[i][: max(room, 0)]
        kept[take] = True
        room -= len(take)
    return kept.expand(heads, n)


@pytest.mark.parametrize("chunk", [10, 7])
@pytest.mark.parametrize("base", ["snapkv", "knorm"])
def test_chunkkv_keeps_whole_chunks_by_their_base_scores(sharp_llama, base, chunk):
    window = 8
    spec = {"name": "snapkv", "window": window, "kernel": 5} if base == "snapkv" else {"name": "knorm"}
    _, history = run_cache(sharp_llama, build_policy("chunkkv", {"base": spec, "chunk": chunk}), PROMPT, DECODE,
                           BUDGET)
    if base == "snapkv":
        scores = snapkv_reference(sharp_llama, PROMPT, window=window, kernel=5, pooling="max")
    else:
        scores = [-norms for norms in key_norms(sharp_llama, PROMPT)]
    _, alone = run_cache(sharp_llama, build_policy(base, {k: v for k, v in spec.items() if k != "name"}), PROMPT, [],
                         BUDGET)
    for layer, (mask, layer_scores) in enumerate(zip(history[0], scores, strict=True)):
        assert torch.equal(mask, chunkkv_reference(layer_scores, len(PROMPT), chunk, BUDGET)), f"layer {layer}"
        assert not torch.equal(mask, alone[0][layer]), "chunks should change the base's choice"
    for step, masks in enumerate(history[1:], start=1):  # the base's phases: prefill only
        assert all(torch.equal(m[:, : len(PROMPT)], first) for m, first in zip(masks, history[0], strict=True))
        assert all(m.shape[1] == len(PROMPT) + step for m in masks)


def kvpress_chunks_reference(scores: torch.Tensor, window: int, chunk: int, budget: int) -> torch.Tensor:
    """kvpress 0.5.5's ChunkKVPress over SnapKV, from its definition: the window scored as the layer's best prefix
    score + 1, a chunk's score the sum over heads of its mean, only whole chunks kept (the remainder a chunk of
    its own), int(chunks x budget / n) of them; `scores` `[heads, n - window]`."""
    heads, n = scores.shape[0], scores.shape[1] + window
    padded = torch.cat([scores, torch.full((heads, window), scores.max().item() + 1)], dim=1)
    chunks = [list(range(start, min(start + chunk, n))) for start in range(0, n, chunk)]
    value = [float(padded[:, c].mean(dim=1).sum()) for c in chunks]
    kept = torch.zeros(n, dtype=torch.bool)
    for i in sorted(range(len(chunks)), key=lambda i: -value[i])[: max(1, int(len(chunks) * budget / n))]:
        kept[chunks[i]] = True
    return kept.expand(heads, n)


@pytest.mark.parametrize("chunk", [10, 7])
def test_chunkkv_whole_chunks_is_kvpress_chunkkv(sharp_llama, chunk):
    window = 8
    base = {"name": "snapkv", "window": window, "kernel": 5, "pooling": "avg"}
    policy = build_policy("chunkkv", {"base": base, "chunk": chunk, "whole_chunks": True})
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    scores = snapkv_reference(sharp_llama, PROMPT, window=window, kernel=5, pooling="avg")
    for layer, (mask, layer_scores) in enumerate(zip(history[0], scores, strict=True)):
        assert torch.equal(mask, kvpress_chunks_reference(layer_scores, window, chunk, BUDGET)), f"layer {layer}"
    if chunk == 7:  # 5 whole chunks (of 7, or the last one of 5): 33 or 35 entries, not the budget of 40
        assert {int(mask.sum(-1).max()) for mask in history[0]} <= {33, 35}
    with pytest.raises(KvbenchError, match="whole_chunks compresses the prompt once"):
        build_policy("chunkkv", {"base": "h2o", "whole_chunks": True})


def test_chunkkv_takes_its_bases_schedule(sharp_llama):
    policy = build_policy("chunkkv", {"base": {"name": "knorm", "decode": True}, "chunk": 4})
    assert policy.schedule.when == "decode" and build_policy("chunkkv").schedule.when == "prefill"
    assert build_policy("chunkkv").describe() == {"name": "chunkkv", "base": "snapkv", "chunk": 10,
                                                  "whole_chunks": False}
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    assert all(int(m.sum(-1).max()) == BUDGET for step in history for m in step)


# --- slot order ---------------------------------------------------------------------------------------------

def fake_layer(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> SimpleNamespace:
    """A layer whose slots hold `positions` `[1, heads, n]` (not in order, as after evictions)."""
    return SimpleNamespace(live_keys=lambda: keys, values=values, length=keys.shape[2], owner=None,
                           live_positions=lambda: positions, padding=lambda: None)


class Flat:
    """A base policy scoring every entry 0 but protecting positions from `protect_from` on."""

    def __init__(self, protect_from: int) -> None:
        self.protect_from = protect_from

    def score(self, layer, budget):
        return torch.zeros(layer.live_positions().shape).masked_fill(layer.live_positions() >= self.protect_from,
                                                                     float("inf"))


@pytest.mark.parametrize("name,params", [("keydiff", {}), ("lagkv", {"sink_size": 2, "lag_size": 4}),
                                         ("lagkv", {"sink_size": 2, "lag_size": 4, "cross_scoring": True}),
                                         ("chunkkv", {"chunk": 4})])
def test_scores_follow_the_entries_not_the_slots(name, params):
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 2, 23, 8, generator=generator)
    order = torch.arange(23).expand(1, 2, 23)
    shuffle = torch.stack([torch.randperm(23, generator=generator) for _ in range(2)])[None]  # slot -> entry
    policy = build_policy(name, params)
    if name == "chunkkv":
        policy._stages = (Flat(protect_from=21),)  # ties everywhere: only the chunk order decides
    in_order = policy.score(fake_layer(keys, values, order), 12)
    moved = policy.score(fake_layer(keys.gather(2, shuffle[..., None].expand(-1, -1, -1, 8)),
                                    values.gather(2, shuffle[..., None].expand(-1, -1, -1, 8)), shuffle), 12)
    # keydiff: the mean over the 23 keys sums in another order, then a cosine over their 8 channels
    assert_close(moved, in_order.gather(-1, shuffle), roundings=sum_roundings(23 + 8))
    assert in_order.isfinite().sum() >= 12


def test_chunkkv_breaks_ties_toward_later_chunks_and_keeps_a_cut_chunks_first_entries():
    policy = build_policy("chunkkv", {"chunk": 4})
    policy._stages = (Flat(protect_from=10),)  # chunks 0-3, 4-7, 8-11 (10 and 11 protected), all tied
    positions = torch.arange(12).expand(1, 2, 12)
    scores = policy.score(fake_layer(torch.zeros(1, 2, 12, 8), torch.zeros(1, 2, 12, 8), positions), 7)
    assert scores.topk(7, dim=-1).indices.sort(-1).values[0].tolist() == [[4, 5, 6, 8, 9, 10, 11]] * 2


# --- parameters ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,budget,message", [
    ("keydiff", {"decode": "sometimes"}, 64, "keydiff' parameter 'decode'"),
    ("keydiff", {}, 0, "at least 1"),
    ("lagkv", {"sink_size": -1}, 64, "lagkv' parameter 'sink_size' must be >= 0"),
    ("lagkv", {"lag_size": 1}, 64, "lagkv' parameter 'lag_size' must be at least 2"),
    ("lagkv", {"sink_size": 8}, 8, "lagkv: budget 8 leaves no room beyond sink_size=8"),
    ("lagkv", {"storage": "quant"}, 64, "lagkv' scores the stored values; it takes no storage"),
    ("chunkkv", {"chunk": 0}, 64, "chunkkv' parameter 'chunk' must be at least 1"),
    ("chunkkv", {"base": "full"}, 64, "chunkkv': base 'full' must score entries"),
    ("chunkkv", {"base": "ada_kv"}, 64, "chunkkv': base 'ada_kv' must score entries"),
    ("chunkkv", {"base": "h3o"}, 64, "unknown policy 'h3o'"),
    ("chunkkv", {"base": {"name": "snapkv", "storage": "quant"}}, 64, "give storage to 'chunkkv' itself"),
    ("chunkkv", {}, 16, "snapkv: budget 16 must exceed the observation window"),
])
def test_bad_parameters_are_named(name, params, budget, message):
    with pytest.raises(KvbenchError, match=message):
        build_policy(name, params).check(Demand(budget=budget))
