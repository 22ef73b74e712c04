"""A shared prompt forward at one cache's cost: cells compress straight from the shared cache into buffers of their
own, leave it untouched, and cells that compress it alike share that too."""

from __future__ import annotations

import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from kvbench.engine.cache import LayerKV
from kvbench.engine.generation import generate
from kvbench.engine.measurements import cache_measurements
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.engine.sharing import shared_prefill
from kvbench.policies import POLICIES, build_policy
from tests.conftest import random_ids
from tests.helpers import NEEDED_PARAMS

PROMPT = random_ids(160, seed=21)
BUDGET = 64
# every registered policy that compresses a prompt (its defaults), and one with compressed storage
POLICY_SPECS = [(name, NEEDED_PARAMS.get(name, {})) for name in POLICIES.names()
                if POLICIES.get(name).schedule.evicts] + [
    ("h2o", {"storage": {"quant": {"bits": 4, "residual": 16}}}), ("snapkv", {"storage": {"think": {"recent": 8}}})]


def snapshot(cache) -> list[torch.Tensor]:
    """Copies of everything a layer of `cache` holds: entries, positions, per-slot statistics."""
    return [buffer[:, :, : layer.length].clone() for layer in cache.layers for buffer in layer._buffers()]


def session(lm, policy, budget=BUDGET, adds=4) -> Session:
    return Session(lm, policy, RunSettings(budget=budget), prompt_tokens=len(PROMPT), adds=adds)


@pytest.mark.parametrize(("name", "params"), POLICY_SPECS,
                         ids=["+".join([name, *params.get("storage", {})]) for name, params in POLICY_SPECS])
def test_a_cell_compresses_from_the_shared_cache_as_alone_and_leaves_it_untouched(sharp_llama, name, params):
    alone = session(sharp_llama, build_policy(name, params))
    alone.prefill(PROMPT)
    shared = shared_prefill(sharp_llama, PROMPT, [build_policy(name, params), build_policy("h2o")])
    before = snapshot(shared.cache)
    adopted = session(sharp_llama, build_policy(name, params))
    adopted.prefill(PROMPT, shared=shared)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(shared.cache), strict=True)), "shared cache written"
    for mine, theirs in zip(adopted.cache.layers, alone.cache.layers, strict=True):
        assert not mine.borrowed
        assert torch.equal(mine.live_positions(), theirs.live_positions())
        assert torch.equal(mine.live_keys(), theirs.live_keys()) and torch.equal(mine.live_values(),
                                                                                    theirs.live_values())
    assert adopted.cache.live_bytes() == alone.cache.live_bytes()
    for token in random_ids(3, seed=5):  # and it decodes on buffers of its own
        assert torch.equal(adopted.step(token), alone.step(token))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(shared.cache), strict=True))


class KVTensors:
    """The K/V buffers of every cache alive, counted as torch allocates and frees them: the real peak of a group."""

    def __init__(self, monkeypatch) -> None:
        self.live = self.peak = 0
        allocate = LayerKV._allocate_entries

        def counted(layer, capacity):
            allocate(layer, capacity)
            for tensor in (layer.keys, layer.values):
                self.live += tensor.nbytes
                weakref.finalize(tensor, self._free, tensor.nbytes)
            self.peak = max(self.peak, self.live)

        monkeypatch.setattr(LayerKV, "_allocate_entries", counted)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.mark.parametrize("with_full", [False, True])
def test_a_shared_group_peaks_at_the_shared_cache_plus_its_largest_cell(tiny_llama, monkeypatch, with_full):
    names = ["snapkv", "h2o", "window", "tova"] + (["full"] * with_full)
    budgets = {"snapkv": 40, "h2o": 48, "window": 40, "tova": 24}
    kv = KVTensors(monkeypatch)
    shared = shared_prefill(tiny_llama, PROMPT, [build_policy(name) for name in names])
    full_bytes = kv.live
    own = []
    for name in names:  # as the sweep runs a sample's cells: one after the other, the shared cache alive
        generation = generate(tiny_llama, build_policy(name), PROMPT, [], RunSettings(budget=budgets.get(name)),
                              max_new_tokens=4, eos_token_ids=set(), shared=shared)
        own.append(generation.measurements["kv_bytes_peak_own"])
        assert generation.measurements["kv_bytes_peak"] >= full_bytes  # as alone: the prompt's full cache counted
    assert kv.peak == full_bytes + max(own)
    if not with_full:  # not two full caches: the largest cell keeps 48 of 160 tokens (and decodes 4)
        assert kv.peak < 1.5 * full_bytes


def test_cells_that_compress_alike_compress_once(tiny_llama, monkeypatch):
    from kvbench.engine.cache import KVCache

    compressions = []
    compress = KVCache.compress

    def slow_compress(cache):
        compressions.append(cache)
        time.sleep(0.3)
        return compress(cache)

    monkeypatch.setattr(KVCache, "compress", slow_compress)
    policies = [build_policy("snapkv"), build_policy("snapkv"), build_policy("snapkv", {"window": 16})]
    # 0.25 of the prompt and 40 tokens are one budget: the first two cells compress alike
    settings = [RunSettings(budget=0.25), RunSettings(budget=40), RunSettings(budget=40)]
    shared = shared_prefill(tiny_llama, PROMPT, policies, settings)
    compressions.clear()
    alike = [generate(tiny_llama, policy, PROMPT, [], setting, max_new_tokens=4, eos_token_ids=set(), shared=shared)
             for policy, setting in zip(policies, settings, strict=True)]
    assert len(compressions) == 2 and not shared.compressed  # the second took the first's; nothing is left held
    alone = generate(tiny_llama, build_policy("snapkv"), PROMPT, [], RunSettings(budget=40), max_new_tokens=4,
                     eos_token_ids=set())
    for generation in alike[:2]:
        assert generation.tokens == alone.tokens
        for column in ("kv_bytes_live", "kv_bytes_physical", "evictions", "kept_max_ever"):
            assert generation.measurements[column] == alone.measurements[column], column
    # charged the compression it copied, as the cell that ran it
    assert alike[1].measurements["ttft_s"] >= shared.seconds_for(policies[1]) + 0.3


def memory(baseline: int, peak: int) -> SimpleNamespace:
    return SimpleNamespace(baseline_bytes=baseline, peak_bytes=peak, baseline_reserved=baseline + 10,
                           peak_reserved=peak + 10, baseline_device=None, peak_device=None, device_note="no GPU")


def test_a_shared_cell_reports_its_own_peak_beside_the_group_s(tiny_llama):
    shared = shared_prefill(tiny_llama, PROMPT, [build_policy("snapkv")])
    shared.memory = memory(baseline=1000, peak=5000)  # weights 1000; the shared forward peaked at 5000
    cell = session(tiny_llama, build_policy("snapkv"))
    cell.prefill(PROMPT, shared=shared)
    # entered with the shared cache alive (4000 in all), grew by 300 (its compressed cache, its decode)
    columns = cache_measurements(cell.cache, memory(baseline=4000, peak=4300), shared=shared)
    assert columns["mem_peak_alloc"] == 1000 + 300 and columns["mem_group_peak_alloc"] == 5000
    assert columns["mem_peak_reserved"] == 1010 + 300 and columns["mem_group_peak_reserved"] == 5010
    assert columns["mem_peak_device"] is None and columns["prefill_shared"]
    # a fork of that cell grows from where its parent was: both growths count
    fork = cache_measurements(cell.cache, memory(baseline=4250, peak=4400), [memory(4000, 4300)], shared=shared)
    assert fork["mem_peak_alloc"] == 1000 + 400
    alone = cache_measurements(cell.cache, memory(baseline=1000, peak=4300))
    assert alone["mem_peak_alloc"] == 4300 and "mem_group_peak_alloc" not in alone
