"""ThinK (`think`): the key channels each head keeps against the paper's criterion computed here from a stock
forward, attention over the stored keys against a stock cache whose pruned channels are zeroed (what kvpress's
ThinKPress does), the bytes, and the composition with an eviction policy."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.checks.suite import kept_masks
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from tests.conftest import random_ids
from tests.helpers import assert_model_close

WINDOW = 16


def stock_queries_and_keys(lm, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the prompt's queries `[heads, n, D]` (after RoPE, recomputed from each attention's input) and
    keys `[kv_heads, n, D]` of a plain transformers forward with its own cache: nothing of kvbench's engine."""
    inputs = {}

    def capture(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    attentions = [layer.self_attn for layer in lm.model.model.layers]
    handles = [attention.register_forward_pre_hook(capture, with_kwargs=True) for attention in attentions]
    cache = DynamicCache()
    with torch.inference_mode():
        try:
            stock_forward(lm, prompt, cache)
        finally:
            for handle in handles:
                handle.remove()
        queries = []
        for index, attention in enumerate(attentions):
            hidden, (cos, sin) = inputs[index]
            q = attention.q_proj(hidden).view(1, len(prompt), -1, attention.head_dim).transpose(1, 2)
            queries.append(apply_rotary_pos_emb(q, q, cos, sin)[0][0])
    return queries, [layer.keys[0] for layer in cache.layers]


def stock_forward(lm, ids: list[int], cache: DynamicCache, start: int = 0) -> torch.Tensor:
    """The last position's logits of `ids` fed at `start` through transformers' own cache."""
    positions = torch.arange(start, start + len(ids))[None]
    return lm.model(input_ids=torch.tensor([ids]), position_ids=positions, use_cache=True,
                    **{lm.cache_arg: cache}).logits[0, -1]


def reference_channels(window_queries: torch.Tensor, key: torch.Tensor, ratio: float) -> list[set[int]]:
    """The paper's criterion for one layer, a plain loop per KV head and channel: channel c scores
    ||Q_window[:, c]||^2 / window (averaged over the head's query heads) x ||K[:, c]||^2 / n; the best
    head_dim - int(head_dim x ratio) channels are kept. `window_queries`: `[heads, window, D]`; `key`:
    `[kv_heads, n, D]`."""
    kv_heads, n, head_dim = key.shape
    heads, window, _ = window_queries.shape
    group = heads // kv_heads
    kept = head_dim - int(head_dim * ratio)
    channels = []
    for head in range(kv_heads):
        scores = []
        for c in range(head_dim):
            query_energy = sum(float(window_queries[head * group + g, :, c].pow(2).sum()) / window
                               for g in range(group)) / group
            key_energy = float(key[head, :, c].pow(2).sum()) / n
            scores.append(query_energy * key_energy)
        channels.append(set(sorted(range(head_dim), key=lambda c: scores[c], reverse=True)[:kept]))
    return channels


def think_session(lm, spec: dict, prompt: list[int], budget: int | None = None, adds: int = 8) -> Session:
    session = Session(lm, build_policy(spec.pop("name"), spec), RunSettings(budget=budget), prompt_tokens=len(prompt),
                      adds=adds)
    session.prefill(prompt)
    return session


def stored_channels(session: Session) -> list[list[set[int]]]:
    """Per layer and KV head, the key channels the cache stores for the prompt."""
    return [[set(head.tolist()) for head in layer.layout.tiers[-1].keys.channels[0]] for layer in session.cache.layers]


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_channels_follow_the_papers_criterion(sharp_llama, ratio):
    prompt = random_ids(200, seed=11)
    queries, keys = stock_queries_and_keys(sharp_llama, prompt)
    session = think_session(sharp_llama, {"name": "think", "ratio": ratio, "window": WINDOW}, prompt)
    expected = [reference_channels(q[:, -WINDOW:], k, ratio) for q, k in zip(queries, keys, strict=True)]
    assert stored_channels(session) == expected
    assert all(len(head) == 16 - int(16 * ratio) for layer in expected for head in layer)


def zero_pruned(cache: DynamicCache, channels: list[list[set[int]]], older_than: int) -> None:
    """kvpress's masking: the pruned key channels of the positions before `older_than` set to zero, in place."""
    for layer, kept in zip(cache.layers, channels, strict=True):
        for head, head_channels in enumerate(kept):
            pruned = [c for c in range(layer.keys.shape[-1]) if c not in head_channels]
            layer.keys[0, head, :older_than, pruned] = 0


@pytest.mark.parametrize("recent", [0, 8])
def test_attention_equals_a_stock_cache_with_the_pruned_channels_zeroed(tiny_llama, recent):
    """Logits of the prompt and of every decode step: the think cache against transformers' own cache whose pruned
    key channels are zeroed, except the newest `recent` tokens' (as they age out of the ring, theirs too)."""
    lm, prompt, steps = tiny_llama, random_ids(120, seed=12), random_ids(12, seed=13)
    session = think_session(lm, {"name": "think", "ratio": 0.5, "window": WINDOW, "recent": recent}, prompt,
                            adds=len(steps))
    channels = stored_channels(session)
    cache = DynamicCache()
    with torch.inference_mode():
        logits = stock_forward(lm, prompt, cache)
        assert_model_close(lm, session.logits[0], logits)
        seen = len(prompt)
        for token in steps:
            zero_pruned(cache, channels, seen - recent)
            ours = session.step(token)[0]
            logits = stock_forward(lm, [token], cache, start=seen)
            seen += 1
            assert_model_close(lm, ours, logits)
    # and the pruning changes something: a cache without it predicts otherwise
    whole = DynamicCache()
    with torch.inference_mode():
        unpruned = stock_forward(lm, prompt + steps, whole)
    assert (unpruned - ours).abs().max() > 1e-3


def test_bytes_fall_by_the_pruned_channels(tiny_llama):
    """Every token's key stored in kept = head_dim / 2 channels (values whole), the newest `recent` whole, plus
    each head's channel indices: the live bytes are that count, and the tensors hold it."""
    lm, tokens, recent = tiny_llama, 200, 8
    session = think_session(lm, {"name": "think", "ratio": 0.5, "recent": recent}, random_ids(tokens, seed=14),
                            adds=1)
    stats, dim, fp32 = session.cache.stats(), lm.head_dim, 4
    kept, heads = dim // 2, lm.kv_heads * lm.num_layers
    per_head = (tokens - recent) * (kept + dim) * fp32 + recent * 2 * dim * fp32 + kept * 8  # int64 indices
    assert stats.kv_bytes_live == per_head * heads
    assert stats.kv_bytes_full == tokens * 2 * dim * fp32 * heads
    assert stats.kv_bytes_live < 0.77 * stats.kv_bytes_full  # about 3/4 of the bytes at half the key channels
    stored = sum(t.untyped_storage().nbytes() for layer in session.cache.layers
                 for t in (*layer.fields.values(), *(b for ring in layer.rings for b in ring.values()),
                           layer.layout.tiers[-1].keys.channels))
    assert stats.kv_bytes_physical == stored
    assert all(field.shape[-1] == kept for layer in session.cache.layers
               for name, field in layer.fields.items() if name.startswith("keys."))


def test_composes_with_snapkv_scoring_its_survivors(sharp_llama):
    """snapkv + think keeps snapkv's positions, and the channels are the criterion over those survivors' keys."""
    lm, prompt, budget = sharp_llama, random_ids(200, seed=15), 64
    snapkv = {"name": "snapkv", "window": WINDOW, "kernel": 5, "pooling": "avg"}
    alone = think_session(lm, dict(snapkv), prompt, budget=budget)
    composed = think_session(lm, {**snapkv, "storage": {"think": {"ratio": 0.5, "window": WINDOW}}}, prompt,
                             budget=budget)
    kept = kept_masks(alone.cache)
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_masks(composed.cache), strict=True))
    queries, keys = stock_queries_and_keys(lm, prompt)
    group = queries[0].shape[0] // keys[0].shape[0]
    expected = [[reference_channels(query[head * group : (head + 1) * group, -WINDOW:],
                                    key[head : head + 1, held[head]], 0.5)[0]  # each head's own survivors
                 for head in range(key.shape[0])] for query, key, held in zip(queries, keys, kept, strict=True)]
    assert stored_channels(composed) == expected
    # and not the channels of the whole prompt: the survivors change the choice somewhere
    assert expected != [reference_channels(q[:, -WINDOW:], k, 0.5) for q, k in zip(queries, keys, strict=True)]
    # the bytes: a survivor among the newest `recent` positions whole, any other with half its key channels
    recent, dim, fp32 = 32, lm.head_dim, 4
    whole = sum(int(held[:, len(prompt) - recent :].sum()) for held in kept)
    entries = sum(int(held.sum()) for held in kept)
    tables = len(kept) * lm.kv_heads * dim // 2 * 8
    assert composed.cache.stats().kv_bytes_live == (whole * 2 * dim + (entries - whole) * (dim // 2 + dim)) * fp32 \
        + tables
    assert composed.cache.stats().kv_bytes_live < 0.9 * alone.cache.stats().kv_bytes_live


@pytest.mark.parametrize("params,culprit", [
    ({"ratio": 1.0}, "parameter 'ratio' (the share of key channels pruned) must be in [0, 1), got 1.0"),
    ({"ratio": -0.5}, "must be in [0, 1), got -0.5"),
    ({"window": 0}, "parameter 'window' must be positive"),
    ({"recent": -1}, "parameter 'recent' must be at least 0"),
])
def test_bad_parameters_are_one_line_errors(params, culprit):
    for name, spec in (("think", params), ("snapkv", {"storage": {"think": params}})):
        with pytest.raises(KvbenchError) as error:
            build_policy(name, spec)
        assert culprit in str(error.value) and "\n" not in str(error.value)


def test_a_wrapper_with_think_storage_observes_for_it(sharp_llama):
    """A wrapper's storage is one of its observers: hybrid (SnapKV, then H2O) with think stores SnapKV's survivors in
    the channels snapkv + think chooses, and H2O then evicts stored entries while decoding."""
    lm, prompt, storage = sharp_llama, random_ids(160, seed=16), {"think": {"ratio": 0.5, "window": WINDOW}}
    snapkv = think_session(lm, {"name": "snapkv", "storage": storage}, prompt, budget=64)
    hybrid = think_session(lm, {"name": "hybrid", "storage": storage}, prompt, budget=64)
    assert stored_channels(hybrid) == stored_channels(snapkv)
    for token in random_ids(6, seed=17):
        hybrid.step(token)
    assert hybrid.cache.stats().kept_max == 64 and hybrid.cache.evictions > 0
