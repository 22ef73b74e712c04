"""Compressed storage: codecs against their error bounds, byte accounting against the formula and the tensors
really allocated, tiers by age, and storage composed with eviction."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench.checks.tolerance import sum_roundings
from kvbench.engine.cache import KVCache
from kvbench.engine.codecs import ChannelQuant, LowRank, TokenQuant, pack, unpack
from kvbench.engine.generation import generate
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import POLICIES, Policy, build_policy
from tests.conftest import random_ids
from tests.helpers import assert_close, assert_model_close, run_cache, tiny_policy

NEW_TOKENS = 8


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip_and_size(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


def _everything(n: int) -> torch.Tensor:
    return torch.ones(1, 2, n, dtype=torch.bool)


def _round_trip(codec, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`x` encoded at `positions` (every slot kept) and decoded."""
    return codec.decode(codec.encode(x, positions, torch.ones_like(positions, dtype=torch.bool),
                                     int(positions.max())), positions)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_error_within_half_a_step(bits):
    x = torch.randn(1, 2, 64, 32) * 3
    positions = torch.arange(64).expand(1, 2, 64)
    per_token = TokenQuant(bits, group=8)
    got = _round_trip(per_token, x, positions)
    groups = x.unflatten(-1, (-1, 8))
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)  # each token's channel group's grid
    assert torch.all((got - x).abs().unflatten(-1, (-1, 8)) <= step[..., None] / 2 + 1e-5)
    per_channel = ChannelQuant(bits, group=16)
    got = _round_trip(per_channel, x, positions)
    blocks = x.unflatten(2, (-1, 16))  # [B, H, 4 token groups, 16, D]
    step = (blocks.amax(3) - blocks.amin(3)) / (2**bits - 1)
    assert torch.all((got - x).abs().unflatten(2, (-1, 16)) <= step[:, :, :, None] / 2 + 1e-5)


def test_keys_per_channel_keep_an_outlier_channel_from_spoiling_the_others():
    x = torch.randn(1, 1, 32, 16)
    x[..., 5] *= 100  # an outlier channel, as in real keys
    positions = torch.arange(32).expand(1, 1, 32)
    normal = [c for c in range(16) if c != 5]
    per_channel, per_token = ChannelQuant(4, group=32), TokenQuant(4, group=16)
    channel_error = (_round_trip(per_channel, x, positions) - x).abs()
    token_error = (_round_trip(per_token, x, positions) - x).abs()
    # per channel: the other channels keep their own fine grid; per token: the outlier's range sets every step
    assert channel_error[..., normal].max() < 0.5 < token_error[..., normal].mean()
    # and per token is the right axis for values with an outlier token
    x = torch.randn(1, 1, 32, 16)
    x[:, :, 7] *= 100
    normal_tokens = [t for t in range(32) if t != 7]
    channel_error = (_round_trip(per_channel, x, positions) - x).abs()
    token_error = (_round_trip(per_token, x, positions) - x).abs()
    assert token_error[:, :, normal_tokens].max() < 0.5 < channel_error[:, :, normal_tokens].mean()


def test_lowrank_at_full_rank_reconstructs_exactly():
    x = torch.randn(1, 2, 40, 16)
    positions = torch.arange(40).expand(1, 2, 40)
    codec = LowRank(rank=16)
    # the basis is an SVD of the 40 x 16 entries, then a product over head_dim each way
    assert_close(_round_trip(codec, x, positions), x, roundings=sum_roundings(40 * 16 + 2 * 16))
    low = LowRank(rank=4)
    error = (_round_trip(low, x, positions) - x).norm()
    assert 0 < error < x.norm()


def ours(lm, policy, prompt, **settings):
    return generate(lm, policy, prompt, [], RunSettings(**settings), max_new_tokens=NEW_TOKENS, eos_token_ids=set())


@pytest.mark.parametrize("spec", [{"bits": 16}, {"bits": 4, "residual": 512}])
def test_nothing_quantized_is_identical_to_full(tiny_llama, spec):
    prompt = random_ids(300, seed=4)
    full = ours(tiny_llama, build_policy("full"), prompt)
    stored = ours(tiny_llama, build_policy("quant", spec), prompt)
    assert stored.tokens == full.tokens and torch.equal(stored.last_logits, full.last_logits)


def test_low_bits_stay_close_to_full(tiny_llama):
    prompt = random_ids(300, seed=4)
    full = ours(tiny_llama, build_policy("full"), prompt).last_logits
    errors = {bits: (ours(tiny_llama, build_policy("quant", {"bits": bits, "residual": 0, "group_size": 16}),
                          prompt).last_logits - full).abs().max().item() for bits in (8, 4, 2)}
    assert errors[8] < 1e-3 * full.abs().max()  # stated tolerance: 0.1% of the largest logit
    assert errors[8] < errors[4] < errors[2]
    exact = ours(tiny_llama, build_policy("lowrank", {"rank": tiny_llama.head_dim, "values": True}), prompt)
    assert_model_close(tiny_llama, exact.last_logits, full)


def _tensor_bytes(cache: KVCache) -> int:
    """What the cache's storage tensors really occupy (positions and policy statistics aside)."""
    total = 0
    for layer in cache.layers:
        tensors = [*layer.fields.values(), *(b for ring in layer.rings for b in ring.values())]
        for tier in layer.layout.tiers:
            for codec in (tier.keys, tier.values):
                tensors += [t for t in (getattr(codec, "low", None), getattr(codec, "scale", None),
                                        getattr(codec, "basis", None)) if t is not None]
        total += sum(t.untyped_storage().nbytes() for t in tensors)
    return total


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("tokens", [20, 100, 257])
def test_quant_bytes_equal_the_formula_and_the_tensors(tiny_llama, bits, tokens):
    group, residual, lm = 8, 24, tiny_llama
    cache, _ = run_cache(lm, build_policy("quant", {"bits": bits, "group_size": group, "residual": residual}),
                         random_ids(tokens, seed=1), [], budget=None)
    stats, dim = cache.stats(), lm.head_dim
    quantized = max(0, (tokens - residual) // group * group)  # whole groups beyond the residual
    per_head = (quantized * (2 * dim * bits // 8 + 2 * (dim // group) * 4)  # codes + value scales, zero-points
                + quantized // group * 2 * dim * 4  # key scales and zero-points: one row per token group
                + (tokens - quantized) * 2 * dim * 4)  # the full-precision residual
    assert stats.kv_bytes_live == per_head * lm.kv_heads * lm.num_layers
    assert stats.kv_bytes_physical == _tensor_bytes(cache)
    if tokens > 200:  # beyond the fixed residual ring, storage really shrinks (head_dim 16: scales weigh a lot)
        assert stats.kv_bytes_physical < stats.kv_bytes_full * (0.6 if bits < 8 else 0.8)
        assert stats.kv_bytes_peak >= stats.kv_bytes_physical  # plus one layer decoded for attention


def test_mixed_precision_tiers_by_age(tiny_llama):
    lm, dim, tokens = tiny_llama, tiny_llama.head_dim, 150
    policy = build_policy("mixed_precision", {"recent": 16, "bits": 8, "middle": 32, "old_bits": 4, "group_size": 8})
    cache, _ = run_cache(lm, policy, random_ids(tokens, seed=2), [], budget=None)

    def quantized(bits):
        return 2 * (dim * bits // 8 + 2 * (dim // 8) * 4)
    per_head = 16 * 2 * dim * 4 + 32 * quantized(8) + (tokens - 48) * quantized(4)
    assert cache.stats().kv_bytes_live == per_head * lm.kv_heads * lm.num_layers
    assert cache.stats().kv_bytes_physical == _tensor_bytes(cache)


def test_evicted_slots_carry_their_compressed_entries():
    policy = build_policy("window", {"storage": {"quant": {"bits": 4, "group_size": 4, "residual": 4}}})
    cache = KVCache(1, (1, 2, 8), policy)
    layer = cache.layers[0]
    keys, values = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    layer.update(keys, values)
    before = {int(p): k for p, k in zip(layer.live_positions()[0, 1], layer.live_keys()[0, 1], strict=True)}
    assert (layer.live_keys()[0, 1] - keys[0, 1]).abs().max() > 0  # really quantized
    layer.evict(torch.tensor([[[3, 9, 17, 30], [0, 5, 6, 21]]]))
    after = dict(zip(layer.live_positions()[0, 1].tolist(), layer.live_keys()[0, 1], strict=True))
    assert sorted(after) == sorted(set(range(40)) - {0, 5, 6, 21})
    assert all(torch.equal(after[p], before[p]) for p in after)


def test_eviction_with_nothing_quantized_is_the_eviction_alone(sharp_llama):
    prompt, decode = random_ids(120, seed=5), random_ids(20, seed=6)
    for name in ("h2o", "window"):
        plain, plain_history = run_cache(sharp_llama, build_policy(name), prompt, decode, budget=48)
        stored, stored_history = run_cache(
            sharp_llama, build_policy(name, {"storage": {"quant": {"bits": 16}}}), prompt, decode, budget=48)
        assert all(torch.equal(a, b) for step_a, step_b in zip(plain_history, stored_history, strict=True)
                   for a, b in zip(step_a, step_b, strict=True))


def test_hybrid_holds_fewer_bytes_than_its_eviction(tiny_llama):
    prompt = random_ids(300, seed=4)
    h2o = ours(tiny_llama, build_policy("h2o"), prompt, budget=96).measurements
    hybrid_policy = build_policy("h2o", {"storage": {"quant": {"bits": 4, "residual": 16, "group_size": 16}}})
    assert hybrid_policy.kind == "hybrid" and build_policy("quant").kind == "compression"
    hybrid = ours(tiny_llama, hybrid_policy, prompt, budget=96).measurements
    assert hybrid["kept_mean"] == h2o["kept_mean"] == 96
    assert hybrid["kv_bytes_live"] < 0.5 * h2o["kv_bytes_live"]
    assert math.isclose(hybrid["cache_ratio"], hybrid["kv_bytes_live"] / hybrid["kv_bytes_full"])


@pytest.mark.parametrize("name,params,culprit", [
    ("h2o", {"storage": {"zip": {}}}, "unknown policy 'zip'"),
    ("h2o", {"storage": "window"}, "storage 'window' is not a storage policy"),
    ("h2o", {"storage": {"quant": {"bits": 3}}}, "parameter 'bits'=3"),
    ("full", {"storage": "quant"}, "keeps every entry as is"),
    ("quant", {"storage": "quant"}, "is a storage itself"),
    ("merge", {"storage": "quant"}, "takes no storage"),
])
def test_bad_storage_is_a_one_line_error(name, params, culprit):
    with pytest.raises(KvbenchError, match=culprit):
        build_policy(name, params)


def test_storage_needs_a_fitting_head_dim(tiny_llama):
    with pytest.raises(KvbenchError, match="rank must be in"):
        ours(tiny_llama, build_policy("lowrank", {"rank": 1000}), random_ids(20))


def test_run_takes_a_storage_per_policy():
    from typer.testing import CliRunner

    from kvbench.cli import app

    result = CliRunner().invoke(app, ["run", "-m", "random:tiny-llama", "-c", "300", "-b", "64", "-p", "h2o", "-p",
                                      "quant", "--param", "h2o.storage={quant: {bits: 4, group_size: 16}}",
                                      "--param", "quant.residual=16", "--max-new-tokens", "2", "--json",
                                      "--no-reference"])
    assert result.exit_code == 0, result.output
    records = {r["family"]: r for r in map(json.loads, result.output.strip().splitlines())}
    assert set(records) == {"hybrid", "compression"}
    assert records["hybrid"]["policy"]["storage"] == {"quant": {"bits": 4, "group_size": 16}}
    assert records["hybrid"]["kv_bytes_live"] < records["compression"]["kv_bytes_live"]


# merge averages entries and lagkv reads the values, both in the model dtype, and kvzip (and kvzip_plus) forgets its
# reconstruction from plain slots: they take no storage
EVICTION = sorted(n for n in POLICIES.names()
                  if POLICIES.get(n).schedule.evicts and POLICIES.get(n).layout is Policy.layout
                  and n not in ("merge", "lagkv", "kvzip", "kvzip_plus"))


@pytest.mark.parametrize("name", EVICTION)
def test_every_eviction_policy_composes_with_a_storage(tiny_llama, name):
    prompt = random_ids(300, seed=8)
    plain = ours(tiny_llama, tiny_policy(name), prompt, budget=96).measurements
    stored = ours(tiny_llama, tiny_policy(name, {"storage": {"quant": {"bits": 4, "group_size": 8, "residual": 16}}}),
                  prompt, budget=96).measurements
    assert stored["kept_mean"] == plain["kept_mean"] and stored["evictions"] == plain["evictions"]
    # head_dim 16: scales weigh a lot; a policy keeping scattered tokens pays a whole key-scale row for few of them
    assert stored["kv_bytes_live"] < 0.8 * plain["kv_bytes_live"]


def test_key_scale_rows_of_evicted_groups_are_given_back(tiny_llama):
    codec = ChannelQuant(4, group=8)
    x, positions = torch.randn(1, 2, 64, 16), torch.arange(64).expand(1, 2, 64)
    fields = codec.encode(x, positions, _everything(64), 63)
    before = codec.decode(fields, positions)
    codec.forget_before(40)  # groups 0-4 are gone: 5 of 8 rows dropped, the rest decode as before
    assert codec.low.shape[2] == 3 and codec.first == 5
    kept = {name: field[:, :, 40:] for name, field in fields.items()}
    assert torch.equal(codec.decode(kept, positions[:, :, 40:]), before[:, :, 40:])
    # a window over a long generation keeps its table at the size of what it holds, not of what it saw
    policy = build_policy("window", {"storage": {"quant": {"bits": 4, "group_size": 8, "residual": 8}}})
    cache, _ = run_cache(tiny_llama, policy, random_ids(40, seed=9), random_ids(600, seed=10), budget=32)
    rows = [layer.layout.tiers[-1].keys.low.shape[2] for layer in cache.layers]
    assert max(rows) <= 16 and cache.layers[0].seen == 640  # 80 groups seen
