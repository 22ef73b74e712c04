"""Decode time per token: kvbench's own loop (with `full` and with evicting policies) versus
`model.generate` with the stock DynamicCache, on the same model and prompt, in one run.

    python benchmarks/decode_overhead.py [--model smollm2-135m] [--context 1024] [--tokens 32]

Per-token time is (time for N tokens - time for 1 token) / (N - 1), so prefill cancels out; each
variant runs `--repeats` times interleaved and the median is reported, with ratios against
`generate` (absolute times on a shared 2-core machine are noise; ratios measured together are not).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvbench.engine.generation import generate
from kvbench.engine.models import load_model
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from kvbench.tasks import build_task, encode_prompt


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    lm = load_model(args.model)
    task = build_task("niah", {"depths": [0.5]})
    context, question = encode_prompt(lm.tokenizer, task.samples(lm.tokenizer, args.context, 1, 0)[0])
    prompt = context + question
    inputs = torch.tensor([prompt], device=lm.device)

    def stock(n: int):
        lm.model.set_attn_implementation("sdpa")
        try:
            with torch.inference_mode():
                generate: Any = lm.model.generate  # transformers' stubs type it as a Tensor attribute
                generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=lm.tokenizer.eos_token_id)
        finally:
            lm.model.set_attn_implementation("kvbench")

    def ours(name: str, budget: int | None):
        def run(n: int):
            generate(lm, build_policy(name), prompt, [], RunSettings(budget=budget), max_new_tokens=n,
                     eos_token_ids=set())
        return run

    variants = {
        "model.generate (DynamicCache)": stock,
        "kvbench full": ours("full", None),
        f"kvbench window b={args.budget}": ours("window", args.budget),
        f"kvbench h2o b={args.budget}": ours("h2o", args.budget),
        f"kvbench snapkv b={args.budget}": ours("snapkv", args.budget),
    }
    per_token: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up
        fn(2)
    for _ in range(args.repeats):
        for name, fn in variants.items():
            one, many = timed(lambda fn=fn: fn(1)), timed(lambda fn=fn: fn(args.tokens))
            per_token[name].append((many - one) / (args.tokens - 1))

    base = statistics.median(per_token["model.generate (DynamicCache)"])
    print(f"model {args.model}, prompt {len(prompt)} tokens, {args.tokens} new tokens, "
          f"{torch.get_num_threads()} threads, device {lm.device}, median of {args.repeats}")
    print(f"{'variant':<34}{'ms/token':>10}{'vs generate':>13}")
    for name, times in per_token.items():
        median = statistics.median(times)
        print(f"{name:<34}{median * 1000:>10.1f}{median / base:>12.2f}x")


if __name__ == "__main__":
    main()
