"""Decode throughput against batch size: `generate_batch` (left-padded rows in one cache) at batch 1, 2,
4 and 8, full cache and a window, on the same prompts in one run.

    python benchmarks/batch_throughput.py [--model smollm2-135m] [--context 512] [--tokens 16]

Rows are distinct stretches of the embedded corpus of slightly different lengths (so padding is
exercised). Each (policy, batch) runs `--repeats` times interleaved; the median decode tokens/s over the
whole batch is reported with its ratio to batch 1 of the same policy.
"""

from __future__ import annotations

import argparse
import statistics

from kvbench.engine.generation import generate_batch
from kvbench.engine.models import load_model
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from kvbench.tasks.corpus import load_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    lm = load_model(args.model)
    ids = lm.tokenizer(load_corpus("embedded")[: args.context * 200], add_special_tokens=False).input_ids
    prompts = [ids[row * 997 : row * 997 + args.context - 7 * row] for row in range(8)]
    variants = [(name, budget, batch) for name, budget in (("full", None), ("window", args.budget))
                for batch in (1, 2, 4, 8)]
    speeds: dict[tuple, list[float]] = {variant: [] for variant in variants}
    for _ in range(args.repeats):
        for name, budget, batch in variants:
            _, measured = generate_batch(lm, build_policy(name), prompts[:batch], RunSettings(budget=budget),
                                         max_new_tokens=args.tokens, eos_token_ids=set())
            speeds[(name, budget, batch)].append(measured["decode_tok_s"])
    print(f"model {args.model}, prompts ~{args.context} tokens, {args.tokens} new tokens, device {lm.device}, "
          f"median of {args.repeats}")
    print(f"{'policy':<14}{'batch':>6}{'decode tok/s':>14}{'vs batch 1':>12}")
    for name, budget, batch in variants:
        median = statistics.median(speeds[(name, budget, batch)])
        base = statistics.median(speeds[(name, budget, 1)])
        label = name if budget is None else f"{name} b={budget}"
        print(f"{label:<14}{batch:>6}{median:>14.1f}{median / base:>11.2f}x")


if __name__ == "__main__":
    main()
