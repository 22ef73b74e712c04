"""A compressed layer's decode step: it reads nothing back from the device, and the path taken while slots are in
position order (everything known to the host) decodes and stores exactly what the general path does."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvbench.cache import KVCache, Phase
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
    return KVCache(1, (1, 2, 32), build_policy(name, params), None, growth=8, phase=Phase.DECODE)


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
    assert layer.seen == 65 and layer.starts == sorted(layer.starts, reverse=True)


def test_after_an_eviction_only_a_step_that_ages_a_group_reads_the_device(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    cache = _cache("quant", {"bits": 4, "group_size": 8, "residual": 16})
    layer = cache.layers[0]
    layer.update(_token(generator, 45), _token(generator, 45))
    layer.evict(torch.tensor([[[3], [30]]]))
    for _ in range(20):
        ages = (layer.seen + 1 - 16) % 8 == 0  # the token completing a group beyond the residual ages the oldest
        with contextlib.nullcontext() if ages else nothing_read_back(monkeypatch):
            layer.update(_token(generator), _token(generator))


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
