"""The cache's storage: eviction keeps exactly the survivors, memory follows the budget."""

from __future__ import annotations

import pytest
import torch

import kvbench.engine.attention as attention
from kvbench.checks.tolerance import sum_roundings
from kvbench.engine.cache import CacheSettings, KVCache
from kvbench.engine.generation import generate
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from tests.conftest import random_ids
from tests.helpers import assert_close, run_cache

HEADS, DIM = 3, 4


CACHES = []  # a layer refers to its cache weakly: the caches of the layers under test stay alive here


def filled_layer(length: int):
    cache = KVCache(1, (1, HEADS, DIM), build_policy("window"), CacheSettings(budget=4, headroom=0))
    CACHES.append(cache)
    layer = cache.layers[0]
    # key/value content encodes (head, position) so survivors can be identified after slots move
    content = torch.arange(HEADS)[:, None] * 1000 + torch.arange(length)[None, :]
    keys = content[None, :, :, None].float().expand(1, HEADS, length, DIM)
    layer.update(keys, -keys)
    layer.slot_stat("score").copy_(content.float()[None] / 10)
    return layer


@pytest.mark.parametrize("length,evicted_count", [(12, 1), (20, 3), (20, 15), (64, 60), (9, 4)])
def test_evict_keeps_exactly_the_survivors_with_their_state(length, evicted_count):
    layer = filled_layer(length)
    generator = torch.Generator().manual_seed(length + evicted_count)
    evicted = torch.stack([torch.randperm(length, generator=generator)[:evicted_count] for _ in range(HEADS)])[None]
    layer.evict(evicted)
    assert layer.length == length - evicted_count
    for head in range(HEADS):
        expected = sorted(set(range(length)) - set(evicted[0, head].tolist()))
        positions = layer.live_positions()[0, head].tolist()
        assert sorted(positions) == expected
        keys = layer.live_keys()[0, head, :, 0]
        assert keys.tolist() == [head * 1000 + p for p in positions]  # K, V and state moved together
        assert layer.values[0, head, : layer.length, 0].tolist() == [-(head * 1000 + p) for p in positions]
        assert layer.slot_stat("score")[0, head].tolist() == pytest.approx([(head * 1000 + p) / 10 for p in positions])


def test_compressing_a_long_prompt_gives_memory_back():
    layer = filled_layer(400)
    assert layer.capacity >= 400
    layer.evict(torch.arange(396).expand(1, HEADS, 396))
    assert layer.length == 4 and layer.capacity == 4  # budget + reserve, not the prompt's 400


@pytest.mark.parametrize("name", ["window", "streaming_llm", "h2o", "random", "tova", "hybrid", "scissorhands"])
@pytest.mark.parametrize("evict_every", [1, 4])
def test_decode_time_policies_never_hold_more_than_budget_plus_slack(sharp_llama, name, evict_every):
    budget, prompt, decode = 36, random_ids(80, seed=21), random_ids(20, seed=22)  # above hybrid's snapkv window
    cache, history = run_cache(sharp_llama, build_policy(name), prompt, decode, budget, evict_every=evict_every)
    slot_bytes = 2 * sharp_llama.kv_heads * sharp_llama.head_dim * 4 * sharp_llama.num_layers
    assert cache.stats().kv_bytes_physical <= (budget + evict_every) * slot_bytes
    for masks in history:
        held = max(int(mask.sum(-1).max()) for mask in masks)
        assert held < budget + evict_every  # after each eviction step


@pytest.mark.parametrize("name", ["window", "h2o", "snapkv"])
def test_chunked_prefill_peak_is_budget_plus_chunk(tiny_llama, name):
    budget, chunk, prompt = 48, 64, random_ids(600, seed=23)
    settings = RunSettings(budget=budget, prefill="chunked", prefill_chunk=chunk)
    result = generate(tiny_llama, build_policy(name), prompt, [], settings, max_new_tokens=4, eos_token_ids=set())
    slot_bytes = 2 * tiny_llama.kv_heads * tiny_llama.head_dim * 4 * tiny_llama.num_layers
    m = result.measurements
    assert m["kv_bytes_peak"] <= (budget + chunk) * slot_bytes
    assert m["kept_max_ever"] <= budget + chunk
    assert m["kv_bytes_full"] == (len(prompt) + 3) * slot_bytes
    # full prefill of the same prompt holds it whole: the peak is the prompt
    full = generate(tiny_llama, build_policy(name), prompt, [], RunSettings(budget=budget), max_new_tokens=4,
                    eos_token_ids=set())
    assert full.measurements["kv_bytes_peak"] >= len(prompt) * slot_bytes


def test_ratio_budget_and_byte_accounting(tiny_llama):
    prompt = random_ids(400, seed=24)
    result = generate(tiny_llama, build_policy("window"), prompt, [], RunSettings(budget=0.25), max_new_tokens=5,
                      eos_token_ids=set())
    m = result.measurements
    assert m["budget_tokens"] == 100 and m["budget_scope"] == "decode"
    assert m["kv_bytes_live"] == 100 * 2 * 2 * 16 * 4 * 2  # tokens x K,V x kv_heads x head_dim x fp32 x layers
    assert m["cache_ratio"] == pytest.approx(100 / 404)
    assert m["kv_bytes_physical"] >= m["kv_bytes_live"]
    assert m["evictions"] == (404 - 100) * 2 * 2


def test_attention_probs_match_naive_softmax_in_small_chunks(monkeypatch):
    monkeypatch.setattr(attention, "MAX_CHUNK_ELEMENTS", 64)  # forces many chunks
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 6, 10, 8, generator=generator), torch.randn(1, 2, 25, 8, generator=generator)
    logits = query @ key.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.3
    causal = torch.arange(25)[None, :] <= (torch.arange(10) + 15)[:, None]
    naive = logits.masked_fill(~causal, float("-inf")).softmax(-1)  # [1, 6, 10, 25]
    rebuilt = torch.zeros(1, 2, 3, 10, 25)
    for start, probs in attention.attention_probs(query, key, 0.3):
        rebuilt[..., start : start + probs.shape[3], : probs.shape[-1]] = probs
    # a logit's 8 terms move a probability by its rounding at the logits' size, the softmax sums 25 slots
    size = float(logits.abs().max())
    assert_close(rebuilt.reshape(1, 6, 10, 25), naive, roundings=sum_roundings(8 + 25), floor=size)
    received = attention.attention_received(query, key, 0.3)  # then 10 queries summed, 3 query heads averaged
    assert_close(received, naive.sum(2).view(1, 2, 3, 25).mean(2), roundings=sum_roundings(8 + 25 + 10 + 3), floor=size)
