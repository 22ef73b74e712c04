"""Merging: evicted entries are folded into kept ones by token-weighted averages; every token stays counted."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.cache import CacheSettings, KVCache
from kvbench.engine.generation import generate
from kvbench.engine.settings import RunSettings
from kvbench.policies import Demand, build_policy
from tests.conftest import random_ids
from tests.helpers import run_cache

HEADS, DIM = 2, 3


def by_position(layer, values: torch.Tensor) -> dict[int, list[float]]:
    return {int(p): values[0, 0, i].tolist() for i, p in enumerate(layer.live_positions()[0, 0])}


def test_pooling_by_hand():
    policy = build_policy("merge", {"recent": 2, "sinks": 0})
    cache = KVCache(1, (1, HEADS, DIM), policy, CacheSettings(budget=4, headroom=1))
    layer = cache.layers[0]
    keys = torch.arange(7.0)[None, None, :, None].expand(1, HEADS, 7, DIM).contiguous()  # key of token t = t
    layer.update(keys[:, :, :6], -keys[:, :, :6])
    cache.compress()
    # 6 tokens into 4 entries: tokens 0 and 1 (lightest, oldest) fold into the next kept entry, token 2
    held = by_position(layer, layer.live_keys())
    assert sorted(held) == [2, 3, 4, 5] and held[2] == [1.0] * DIM  # (0 + 1 + 2) / 3
    assert by_position(layer, layer.values[:, :, : layer.length])[2] == [-1.0] * DIM
    cache.phase = "decode"
    layer.update(keys[:, :, 6:7], -keys[:, :, 6:7])
    cache.compress()
    # token 3 is now the lightest old entry (token 2's entry holds 3 tokens): it folds into token 4's
    held = by_position(layer, layer.live_keys())
    assert sorted(held) == [2, 4, 5, 6] and held[4] == [3.5] * DIM and held[2] == [1.0] * DIM
    weights = 1 + layer.slot_stat(policy.state_key)
    assert int(weights.sum()) == HEADS * 7  # every token seen is in some entry


@pytest.mark.parametrize("target", ["pool", "similar"])
def test_every_token_stays_represented_in_a_real_model(tiny_llama, target):
    policy = build_policy("merge", {"recent": 8, "sinks": 2, "target": target})
    generation = generate(tiny_llama, policy, random_ids(120, seed=3), [], RunSettings(budget=32), max_new_tokens=6,
                          eos_token_ids=set())
    stats = generation.measurements
    assert stats["kept_mean"] == 32 and stats["evictions"] > 0
    # (the cache object is gone; run the same prefill by hand to read the weights)
    cache, _ = run_cache(tiny_llama, policy, random_ids(120, seed=3), [], budget=32)
    for layer in cache.layers:
        assert layer.length == 32
        assert torch.all((1 + layer.slot_stat(policy.state_key)).sum(-1) == 120)


def test_merge_needs_room_beyond_its_recent_window():
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError, match="must exceed recent"):
        build_policy("merge", {"recent": 32}).check(Demand(budget=36))


def test_sinks_stay_unmerged():
    policy = build_policy("merge", {"recent": 2, "sinks": 1})
    cache = KVCache(1, (1, HEADS, DIM), policy, CacheSettings(budget=4, headroom=1))
    layer = cache.layers[0]
    keys = torch.arange(6.0)[None, None, :, None].expand(1, HEADS, 6, DIM).contiguous()
    layer.update(keys, -keys)
    cache.compress()
    held = by_position(layer, layer.live_keys())
    assert sorted(held) == [0, 3, 4, 5] and held[0] == [0.0] * DIM and held[3] == [2.0] * DIM  # (1 + 2 + 3) / 3
