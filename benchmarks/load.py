"""What a policy buys a service whose KV memory is full: the same Poisson trace served with the full cache and with
SnapKV at a quarter of the prompt, in a pool that holds about two full-cache requests, on the embedded model.

    python benchmarks/load.py [--model smollm2-135m] [--context 1024] [--tokens 64] [--requests 12] [--rate 0.4]
                              [--chunk 256]

`--chunk` feeds prompts in chunks of that many tokens between decode steps (`prefill: chunked`; SnapKV then
compresses after every chunk). Reports both services' goodput at the SLO, throughput, p99 TTFT and concurrency, the
goodput ratio measured in this one run, and whether every finished request's answer equals its unbatched run
(`generate`). Then the same setting's estimate for an 8B model (Llama-3.1-8B, bfloat16) on an 80 GB GPU: how many
requests each cache admits at once.
"""

from __future__ import annotations

import argparse

from kvbench.estimate import SHAPES
from kvbench.generation import Prompt, answer, generate
from kvbench.measure import PeakMemory
from kvbench.models import load_model
from kvbench.policies import build_policy
from kvbench.serving import Load, Service, pool_bytes, service_metrics
from kvbench.session import RunSettings
from kvbench.tasks import build_task
from kvbench.tasks.base import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.4)
    parser.add_argument("--ttft", type=float, default=10.0, help="SLO: seconds to the first token")
    parser.add_argument("--tpot", type=float, default=0.5, help="SLO: seconds per output token")
    parser.add_argument("--chunk", type=int, default=0, help="chunked prefill of this many tokens (0: full)")
    args = parser.parse_args()

    lm = load_model(args.model)
    task = build_task("niah", {"depths": [0.25, 0.5, 0.75]})
    samples = task.samples(lm.tokenizer, args.context, 4, 0)
    prompts = [Prompt(*encode_prompt(lm.tokenizer, samples[i % len(samples)]), args.tokens, ())
               for i in range(args.requests)]
    longest = max(len(p.context) + len(p.question) for p in prompts)
    pool = pool_bytes(lm, f"{2 * (longest + args.tokens)} tokens", None)
    load = Load(requests=args.requests, rate=args.rate, pool_bytes=pool, slo_ttft_s=args.ttft, slo_tpot_s=args.tpot)
    results = {}
    for name, budget in (("full", None), ("snapkv", 0.25)):
        settings = RunSettings(budget=budget, prefill="chunked" if args.chunk else "full",
                               prefill_chunk=args.chunk or 512)
        with PeakMemory(lm.devices) as memory:
            served = Service(lm, build_policy(name, {}), settings, prompts, load, memory).run()
        metrics = service_metrics(served, load)
        same = all(answer(lm, r.tokens, lm.eos_token_ids, ())[1] == generate(
            lm, build_policy(name, {}), r.prompt.context, r.prompt.question, settings, args.tokens).tokens
                   for r in served.requests if r.finished_s is not None)
        results[name] = metrics
        print(f"{name:7s} goodput {metrics['goodput']:.3f}/s  done {metrics['request_rate']:.3f}/s  "
              f"p99 TTFT {metrics['ttft_p99']:.1f} s  p50 TPOT {1000 * (metrics['tpot_p50'] or 0):.0f} ms  "
              f"running {metrics['concurrency_mean']:.1f} (peak {metrics['concurrency_peak']})  "
              f"rejected {metrics['rejected']}  preempted {metrics['preemptions']}  answers as alone: {same}")
    full, snap = results["full"]["goodput"], results["snapkv"]["goodput"]
    print(f"pool {pool / 2**20:.1f} MiB ({2 * (longest + args.tokens)} tokens), rate {args.rate} req/s, prefill "
          f"{f'in chunks of {args.chunk}' if args.chunk else 'whole'}, "
          f"SLO TTFT <= {args.ttft} s, TPOT <= {args.tpot} s: snapkv/full goodput = "
          f"{snap / full if full else float('inf'):.2f}x")
    _eight_b(args.context, args.tokens)


def _eight_b(context: int, tokens: int) -> None:
    """Requests admitted at once on an 80 GB GPU by an 8B model's full cache and by SnapKV at 0.25, at 8x this
    run's context (the pool: what the bfloat16 weights and 10% for activations leave)."""
    shape = SHAPES["llama-3.1-8b"]
    per_token = shape.bytes_per_token(2)
    pool = 80e9 * 0.9 - 2 * (shape.parameters or 0)
    prompt = 8 * context
    full, snap = prompt + tokens, 0.25 * prompt + tokens
    print(f"estimate, Llama-3.1-8B bf16 on 80 GB, {prompt}-token prompts + {tokens} tokens: pool "
          f"{pool / 2**30:.0f} GiB; full admits {int(pool // (full * per_token))} requests at once, snapkv at 0.25 "
          f"{int(pool // (snap * per_token))} (its prefill holds one prompt's full cache besides)")


if __name__ == "__main__":
    main()
