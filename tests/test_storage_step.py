"""A compressed layer's decode step: it reads nothing back from the device, and the path taken while slots are in
position order (everything known to the host) decodes and stores exactly what the general path does."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvbench.engine.cache import CacheSettings, KVCache, Phase
from kvbench.policies import build_policy

STORAGES = [("quant", {"bits": bits, "group_size": 8, "residual": 16}) for bits in (2, 4, 8)] + [
    ("mixed_precision", {"recent": 8, "bits": 8, "middle": 16, "old_bits": 4, "group_size": 8}),
    ("lowrank", {"rank": 8, "values": True}),
]


def _reads_back(*args, **kwargs):
    raise AssertionError("a decode step read a value back from the device")


def _no_boolean_index(original):
    def checked(self, index):
        indices = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            _reads_back()  # a boolean mask selects a number of entries only the device knows
        return original(self, index)
    return checked


@contextlib.contextmanager
def nothing_read_back(monkeypatch):
    """Every way a tensor's value reaches the host (and so waits for the device) raises inside the block."""
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__index__", "__float__"):
            patch.setattr(torch.Tensor, name, _reads_back)
        for name in ("nonzero", "equal", "masked_select"):
            patch.setattr(torch, name, _reads_back)
        patch.setattr(torch.Tensor, "__getitem__", _no_boolean_index(torch.Tensor.__getitem__))
        yield


def _cache(name: str, params: dict) -> KVCache:
    return KVCache(1, (1, 2, 32), build_policy(name, params), CacheSettings(growth=8), phase=Phase.DECODE)


def _token(generator: torch.Generator, count: int = 1) -> torch.Tensor:
    return torch.randn(1, 2, count, 32, generator=generator)


@pytest.mark.parametrize("name,params", STORAGES)
def test_a_decode_step_reads_nothing_back_from_the_device(monkeypatch, name, params):
    generator = torch.Generator().manual_seed(0)
    cache = _cache(name, params)  # a layer refers to its cache weakly
    layer = cache.layers[0]
    layer.update(_token(generator, 45), _token(generator, 45))
    with nothing_read_back(monkeypatch):
        for _ in range(20):  # groups of 8 age from tier to tier on the way
            layer.update(_token(generator), _token(generator))
            layer.live_bytes()  # what an adaptive policy asks at every step until it switches
    assert layer.seen == 65 and layer.starts == sorted(layer.starts, reverse=True)


def _table_grows(layer, newest: int) -> bool:
    return any(codec.frees_rows and not codec.has_row(newest) for codec in (layer.final.keys, layer.final.values))


@pytest.mark.parametrize("name,params", STORAGES)
def test_after_evictions_no_step_reads_back_and_survivors_decode_as_stored(monkeypatch, name, params):
    """The steady state of an eviction policy with a storage: one entry per head evicted at every step, groups ageing
    on the way. No step reads the device back (only one where a key-scale table must grow, to give evicted groups'
    rows back first), and every survivor decodes as on a layer that evicted nothing: a per-token code depends on the
    token alone (KIVI's per-channel keys on which tokens of their group are left, so only their values compare)."""
    generator, choices = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    caches = _cache(name, params), _cache(name, params)  # a layer refers to its cache weakly
    evicting, kept_all = (cache.layers[0] for cache in caches)
    prompt = _token(generator, 45), _token(generator, 45)
    evicting.update(*prompt)
    kept_all.update(*prompt)
    quiet = 0
    for _ in range(40):
        token = _token(generator), _token(generator)
        kept_all.update(*token)
        gone = torch.randint(evicting.length, (1, 2, 1), generator=choices)
        grows = _table_grows(evicting, evicting.seen) and (evicting.seen + 1) % 8 == 0  # a group of 8 ages
        with contextlib.nullcontext() if grows else nothing_read_back(monkeypatch):
            evicting.evict(gone)
            evicting.update(*token)
        quiet += not grows
    assert quiet >= 38 and not evicting.in_order and evicting.length == 45
    positions = evicting.live_positions()
    for stored, reference in zip((evicting.live_values(), evicting.live_keys()),
                                 (kept_all.live_values(), kept_all.live_keys()), strict=False):
        assert torch.equal(stored, reference.gather(2, positions[..., None].expand_as(stored)))
        if name == "quant":
            break


@pytest.mark.parametrize("name,params", STORAGES)
def test_slots_in_order_decode_and_store_as_the_general_path(name, params):
    """Forcing the general path (slots found on the device) on an identical layer gives bit-identical keys, values
    and bytes at every step: the host's bookkeeping of the in-order case is exact."""
    generator = torch.Generator().manual_seed(2)
    caches = _cache(name, params), _cache(name, params)
    host, general = (cache.layers[0] for cache in caches)
    prompt = _token(generator, 45), _token(generator, 45)
    host.update(*prompt)
    general.update(*prompt)
    general.in_order = False
    for step in range(30):
        token = _token(generator, 3 if step == 11 else 1), _token(generator, 3 if step == 11 else 1)
        ours, theirs = host.update(*token), general.update(*token)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), step
        assert (host.live_bytes(), host.physical_bytes()) == (general.live_bytes(), general.physical_bytes())
    assert host.in_order and torch.equal(host.live_keys(), general.live_keys())
