"""Capacity search: the exact boundary in O(log n) probes, and on a real (tiny) model under a KV limit."""

from __future__ import annotations

import math

import pytest

from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.tasks.capacity_search import capacity, largest_fitting


@pytest.mark.parametrize("threshold", [1, 2, 3, 37, 64, 65, 1000])
def test_search_finds_the_exact_boundary_in_log_probes(threshold):
    """A fake runner whose out-of-memory threshold is known: sizes up to `threshold` fit."""
    search = largest_fitting(lambda n: {"n": n} if n <= threshold else None, start=1, bound=4096)
    assert search.size == threshold and search.measurements == {"n": threshold}
    assert len(search.probes) <= 2 * math.ceil(math.log2(threshold + 1)) + 1
    assert all(fit == (n <= threshold) for n, fit in search.probes)


def test_search_edges():
    assert largest_fitting(lambda n: None, start=1, bound=64).size == 0  # nothing fits
    everything = largest_fitting(lambda n: {}, start=1, bound=100)
    assert everything.size == 100 and everything.probes[-1] == (100, True)


def test_a_window_fits_more_rows_than_the_full_cache(tiny_llama):
    # 512 bytes per token on tiny-llama; 64 KiB of KV: full holds 128 tokens, so 1 row of 100
    chunked = RunSettings(budget=16, prefill="chunked", prefill_chunk=16)
    full = capacity(tiny_llama, build_policy("full"), RunSettings(), "batch", context=100, batch=1,
                    decode_steps=2, limit_bytes=64 * 1024, bound=64)
    window = capacity(tiny_llama, build_policy("window"), chunked, "batch", context=100, batch=1, decode_steps=2,
                      limit_bytes=64 * 1024, bound=64)
    assert full.size == 1 and window.size > 2 * full.size
    assert window.measurements["batch"] == window.size and window.measurements["decode_tok_s"] > 0
    longest = capacity(tiny_llama, build_policy("full"), RunSettings(), "context", context=0, batch=2,
                       decode_steps=2, limit_bytes=64 * 1024, bound=4096)
    assert 40 <= longest.size <= 64  # 2 rows x (n + growth) x 512 bytes within 64 KiB
    with pytest.raises(KvbenchError, match="memory limit"):
        capacity(tiny_llama, build_policy("full"), RunSettings(), "batch", 100, 1, 2)


def test_capacity_as_a_sweep_task(tmp_path):
    from tests.test_sweep import TINY, summarize, sweep, write_config

    config = {**TINY, "policies": ["full", "window"], "budgets": [16], "context_lengths": [100],
              "prefill": {"mode": "chunked", "chunk": 16},
              "tasks": [{"name": "capacity", "memory_limit": "128KiB", "decode_steps": 2, "max": 64}]}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    frame = summarize(tmp_path / "run").set_index("policy")
    # chunks of 16 into a growing full cache: old and new buffers coexist while it grows (~100 KB at 100 tokens)
    assert frame.loc["full", "score"] == 1 and frame.loc["window", "score"] >= 4
