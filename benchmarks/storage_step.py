"""Cost of one decode step's cache work with compressed storage, against a plain cache, on one layer of a
Llama-3-8B-shaped cache (8 KV heads, head_dim 128) holding `--tokens` entries.

    python benchmarks/storage_step.py [--tokens 2048] [--device cpu|cuda] [--dtype bfloat16]

A step appends one token and returns the layer's keys and values for attention: a plain layer returns views of
its buffers; a compressed one decodes every entry (no fused kernel) and encodes the new token. Both are compared
with one decode token's SDPA over the same entries, the least a step spends on attention. All in one run.

"quant-4 evicted" has had one entry evicted after the prompt, as under an eviction policy: its slots are out of
position order, so every slot is decoded with its key-scale row gathered (in order, a row serves its group of
slots by broadcasting), and the step in 32 where a group ages finds its slots on the device (nothing read back).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from eviction_step import median_ms, parse_args  # this folder's sibling script

from kvbench.engine.cache import CacheSettings, KVCache, Phase
from kvbench.policies import build_policy

KV_HEADS, HEADS, HEAD_DIM = 8, 32, 128
STORAGES = {"plain (full)": ("full", {}), "quant-8": ("quant", {"bits": 8}), "quant-4": ("quant", {"bits": 4}),
            "quant-2": ("quant", {"bits": 2}), "mixed 8/4": ("mixed_precision", {"middle": 512}),
            "lowrank 32": ("lowrank", {"rank": 32}), "quant-4 evicted": ("quant", {"bits": 4})}


def main() -> None:
    args, device, dtype = parse_args(__doc__.splitlines()[0], "tokens", 2048)
    prompt = torch.randn(1, KV_HEADS, args.tokens, HEAD_DIM, dtype=dtype, device=device)
    token = torch.randn(1, KV_HEADS, 1, HEAD_DIM, dtype=dtype, device=device)
    query = torch.randn(1, HEADS, 1, HEAD_DIM, dtype=dtype, device=device)
    layers = {}
    for label, (name, params) in STORAGES.items():
        cache = KVCache(1, (1, KV_HEADS, HEAD_DIM), build_policy(name, params),
                        CacheSettings(growth=3 * args.repeats + 8), phase=Phase.DECODE)
        cache.layers[0].update(prompt, prompt)
        if label.endswith("evicted"):  # slot 0 of each head goes; the last slot fills it
            cache.layers[0].evict(torch.zeros(1, KV_HEADS, 1, dtype=torch.long, device=device))
        layers[label] = cache
    steps: dict[str, list[float]] = {label: [] for label in layers}
    for _ in range(args.repeats):  # interleaved, so a noisy moment hits every storage alike
        for label, cache in layers.items():
            steps[label].append(median_ms(lambda c=cache: c.layers[0].update(token, token), device, 1))
    rows = []
    for label, cache in layers.items():
        keys, values = cache.layers[0].update(token, token)
        attention = median_ms(lambda k=keys, v=values: F.scaled_dot_product_attention(
            query, k, v, enable_gqa=True), device, args.repeats)
        stats = cache.stats()
        rows.append((label, statistics.median(steps[label]), attention, stats.kv_bytes_live / stats.kv_bytes_full))
    print(f"{args.tokens} tokens, {KV_HEADS} KV heads x head_dim {HEAD_DIM}, {dtype}, {device}; median of "
          f"{args.repeats} interleaved rounds")
    print(f"{'storage':<16} {'step ms':>9} {'SDPA ms':>8} {'step / SDPA':>12} {'bytes ratio':>12}")
    for label, step, attention, ratio in rows:
        print(f"{label:<16} {step:9.3f} {attention:8.3f} {step / attention:12.1f} {ratio:12.3f}")

if __name__ == "__main__":
    main()
