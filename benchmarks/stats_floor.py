"""How low H2O's prefill can go on this machine: one decoder layer's prefill against the attention statistics H2O
adds to it, and against the part of them no exact method avoids (every logit of the causal triangle), in one run.

    python benchmarks/stats_floor.py [--model smollm2-135m] [--tokens 8192] [--repeats 3]
    python benchmarks/stats_floor.py --model random:llama-3-8b --tokens 8192

Per layer, on the model's head shape with random queries and keys (the times do not depend on the values):
  layer       the model's first decoder layer alone, prefilled by `full` (stats_scaling.py's one-layer model)
  sdpa        torch's attention over the prompt (`F.scaled_dot_product_attention`, causal), what the layer runs
  statistics  `attention.attention_received`: what H2O adds to the layer on this device
  logits      the statistics' matmuls alone, chunk by chunk as `attention.attention_probs` runs them, with their
              GFLOP/s: no exact statistic of H2O's does less
The floor is (layer + logits) / layer: H2O's prefill over full's if its statistics cost only their logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from stats_scaling import load_layers, prefill, settled

from kvbench.engine import attention
from kvbench.engine.models import LoadedModel


def timed(run: Callable[[], object], repeats: int, lm: LoadedModel) -> float:
    """Median seconds of `repeats` calls of `run` on `lm`'s device, after one unmeasured."""
    run()
    times = []
    for _ in range(repeats):
        settled(lm)
        start = time.perf_counter()
        run()
        settled(lm)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def logits_only(query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
    """`attention_probs`' matmuls with nothing else: each chunk's queries against the keys they may see."""
    batch, heads, queries, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    keys_t = key.float().transpose(-1, -2)
    chunk = min(queries, attention.queries_per_chunk(batch, heads, queries, slots, key.device))
    buffer = torch.empty(batch * heads * chunk * slots, dtype=torch.float32, device=key.device)
    for start in range(0, queries, chunk):
        stop = min(queries, start + chunk)
        size, visible = stop - start, slots - queries + stop
        rows = query[:, :, start:stop].float().mul(scaling).reshape(batch, kv_heads, -1, dim)
        torch.matmul(rows, keys_t[..., :visible], out=buffer[: batch * heads * size * visible].view(
            batch, kv_heads, heads // kv_heads * size, visible))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (embedded), random:llama-3-8b, ...")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: a GPU if there is one)")
    args = parser.parse_args()

    lm = load_layers(args.model, 1, device=args.device)
    config = lm.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    ids = torch.randint(min(256, config.vocab_size), (args.tokens,)).tolist()
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, args.tokens, dim, generator=generator).to(lm.device, lm.dtype)
    key = torch.randn(1, kv_heads, args.tokens, dim, generator=generator).to(lm.device, lm.dtype)
    value = torch.randn(1, kv_heads, args.tokens, dim, generator=generator).to(lm.device, lm.dtype)
    scaling = dim**-0.5

    times = {
        "layer": timed(lambda: prefill(lm, "full", ids, 1.0, "wall"), args.repeats, lm),
        "sdpa": timed(lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                             enable_gqa=True), args.repeats, lm),
        "statistics": timed(lambda: attention.attention_received(query, key, scaling), args.repeats, lm),
        "logits": timed(lambda: logits_only(query, key, scaling), args.repeats, lm),
    }
    flops = 2 * heads * dim * args.tokens * (args.tokens + 1) / 2  # q.k over the causal triangle
    print(f"model {args.model} (heads {heads}, KV heads {kv_heads}, head dim {dim}), {args.tokens} tokens, "
          f"{lm.dtype}, device {lm.device}, {torch.get_num_threads()} threads, median of {args.repeats}")
    for name, seconds in times.items():
        print(f"{name:>11} {seconds:8.3f} s {seconds / times['layer']:6.2f}x the layer")
    print(f"logits at {flops / times['logits'] / 1e9:.0f} GFLOP/s ({flops / 1e9:.1f} GFLOP); floor "
          f"{(times['layer'] + times['logits']) / times['layer']:.2f}x full's prefill, H2O's statistics now "
          f"{(times['layer'] + times['statistics']) / times['layer']:.2f}x")


if __name__ == "__main__":
    main()
