"""Cost of one decode-time eviction step, against the attention it serves, on a Llama-3-8B-shaped
cache (32 layers, 8 KV heads, head_dim 128) held at `--budget` entries per layer and KV head.

    python benchmarks/eviction_step.py [--budget 4096] [--device cpu|cuda] [--dtype bfloat16]

Each step appends one token to every layer and evicts one entry per KV head (window and H2O
scoring). It is compared with (a) the same step done by gathering every survivor into place (what
a cache that reorders or re-concatenates per step pays), and (b) one decode token's SDPA over the
same cache, the least a decode step must spend on attention. All in one run; ratios are what count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvbench.engine.cache import CacheSettings, KVCache, Phase
from kvbench.engine.instruments import synchronize
from kvbench.engine.models import resolve_device, resolve_dtype
from kvbench.policies import build_policy

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 32, 8, 32, 128


def median_ms(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def parse_args(description: str, size: str, default: int) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """`--<size>`, `--device`, `--dtype`, `--repeats`: the options of a cache-step benchmark, resolved."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(f"--{size}", type=int, default=default)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = resolve_device(args.device)
    return args, device, resolve_dtype(args.dtype, device)


def main() -> None:
    args, device, dtype = parse_args(__doc__.splitlines()[0], "budget", 4096)

    def filled(policy_name: str) -> KVCache:
        cache = KVCache(LAYERS, (1, KV_HEADS, HEAD_DIM), build_policy(policy_name),
                        CacheSettings(budget=args.budget, headroom=1), phase=Phase.DECODE)
        prompt = torch.randn(1, KV_HEADS, args.budget, HEAD_DIM, dtype=dtype, device=device)
        for layer in cache.layers:
            layer.update(prompt, prompt)
            if policy_name == "h2o":
                layer.slot_stat("h2o").uniform_()
        return cache

    token = torch.randn(1, KV_HEADS, 1, HEAD_DIM, dtype=dtype, device=device)

    def step(cache: KVCache):
        def run():
            for layer in cache.layers:
                layer.update(token, token)
            cache.compress()
        return run

    def gather_all(cache: KVCache):
        def run():
            for layer in cache.layers:
                keys, values = layer.update(token, token)
                keep = layer.live_positions().argsort(dim=-1)[..., 1:].unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM)
                layer.keys[:, :, : args.budget] = keys.gather(2, keep)
                layer.values[:, :, : args.budget] = values.gather(2, keep)
                layer.positions[:, :, : args.budget] = layer.live_positions().sort(dim=-1).values[..., 1:]
                layer.length = args.budget
        return run

    query = torch.randn(1, HEADS, 1, HEAD_DIM, dtype=dtype, device=device)
    keys = torch.randn(1, KV_HEADS, args.budget, HEAD_DIM, dtype=dtype, device=device)

    def attention():
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(query, keys, keys, enable_gqa=True)

    rows = {
        "evict 1/head, window (kvbench)": median_ms(step(filled("window")), device, args.repeats),
        "evict 1/head, h2o scores (kvbench)": median_ms(step(filled("h2o")), device, args.repeats),
        "gather all survivors (baseline)": median_ms(gather_all(filled("window")), device, args.repeats),
        "decode-token SDPA, all layers": median_ms(attention, device, args.repeats),
    }
    base = rows["decode-token SDPA, all layers"]
    print(f"cache {LAYERS} layers x {KV_HEADS} KV heads x {args.budget} tokens x {HEAD_DIM} ({dtype}, {device}), "
          f"median of {args.repeats}")
    print(f"{'step':<38}{'ms':>9}{'vs SDPA':>10}")
    for name, ms in rows.items():
        print(f"{name:<38}{ms:>9.2f}{ms / base:>9.2f}x")


if __name__ == "__main__":
    main()
