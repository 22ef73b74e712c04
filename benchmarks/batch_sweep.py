"""What batching a sweep's samples buys: one needle grid swept at batch 1, 4 and 8 in one run.

    python benchmarks/batch_sweep.py [--model random:smollm2-135m] [--context 512] [--samples 8] [--repeats 1]

Each batch size runs the same cells on the same samples (one model, loaded once) through the sweep's own
`run_group`: the prompt's forward shared by a batch's cells, each cell's rows decoded together. Reported per batch
size: the sweep's wall time (model load excluded) and its decode tokens per second, from the records alone: every
record carries its batch's `decode_tok_s` (the tokens its rows decoded after the first over the batch's decode
time), so a record's share of that time is its tokens over it, and the grid's decode time is their sum. Ratios are
against batch 1 of the same repeat (`--repeats` interleaves the batch sizes): the median over the repeats, with its
[min, max]. The last column says whether every record's non-timing columns equal batch 1's (they must).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvbench.config.cells import expand
from kvbench.config.schema import SweepConfig
from kvbench.engine.models import load_model
from kvbench.runs.outcomes import CollectedOutcomes
from kvbench.runs.sweep import run_group

POLICIES: list[Any] = ["full", "window", {"name": "streaming_llm", "sinks": 4}, {"name": "h2o", "recent_ratio": 0.5},
                       {"name": "snapkv", "window": 32}]
BATCHES = (1, 4, 8)
# what a batch measures together: every other column of a record must not move with the batch size
TIMING = {"ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s", "batch_size", "mem_peak_alloc", "mem_peak_reserved",
          "mem_peak_device", "mem_group_peak_alloc", "mem_group_peak_reserved", "mem_group_peak_device",
          "mem_baseline", "mem_device_note"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:smollm2-135m", help="random:<shape> (Llama shapes) or any spec")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8, help="samples per cell (needle depths x samples)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per answer")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    config = SweepConfig.model_validate({
        "name": "batch_sweep", "model": {"id": args.model, "dtype": args.dtype, "device": args.device},
        "policies": POLICIES, "budgets": [args.budget], "context_lengths": [args.context],
        "tasks": [{"name": "niah", "depths": [0.25, 0.75]}], "samples": max(1, args.samples // 2),
        "max_new_tokens": args.tokens})
    cells = expand(config)
    spec = config.model
    lm = load_model(spec.id, dtype=spec.dtype, device=spec.device, seed=config.seed)
    walls: dict[int, list[float]] = {batch: [] for batch in BATCHES}
    speeds: dict[int, list[float]] = {batch: [] for batch in BATCHES}
    records: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for batch in BATCHES:
            outcomes = CollectedOutcomes()
            start = time.perf_counter()
            run_group(lm, cells, set(), outcomes, share=True, trace=False, stop=lambda: False, batch_size=batch)
            walls[batch].append(time.perf_counter() - start)
            run = [arguments[0] for kind, arguments in outcomes.events if kind == "record"]
            speeds[batch].append(decode_tokens_per_second(run))
            records[batch] = {(record["cell_id"], record["sample_id"]): record for record in run}

    samples = len(next(iter(records.values()))) // len(cells)
    print(f"model {args.model} ({lm.dtype}, {lm.device}, {torch.get_num_threads()} threads), {len(cells)} cells "
          f"({len(POLICIES)} policies, budget {args.budget}) x {samples} needle samples of {args.context} tokens, "
          f"{args.tokens} new tokens, shared prefill, median of {args.repeats}")
    print(f"{'batch':>5}{'wall s':>9}{'faster than batch 1':>22}{'decode tok/s':>14}{'vs batch 1':>22}  "
          "records as batch 1")
    for batch in BATCHES:
        faster = [one / wall for one, wall in zip(walls[1], walls[batch], strict=True)]
        more = [speed / one for one, speed in zip(speeds[1], speeds[batch], strict=True)]
        same = "yes" if same_records(records[batch], records[1]) else "NO"
        print(f"{batch:>5}{statistics.median(walls[batch]):>9.1f}{spread(faster):>22}"
              f"{statistics.median(speeds[batch]):>14.1f}{spread(more):>22}  {same}")


def spread(ratios: list[float]) -> str:
    """`2.42x [2.30, 2.51]`: the median ratio and its range over the repeats."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def decode_tokens_per_second(records: list[dict[str, Any]]) -> float:
    """Tokens decoded after each answer's first over the decode time, summed over every batch from its records:
    a record holds `generated_tokens - 1` of its batch's decoded tokens, so it stands for that share of the time."""
    decoded = [(record["generated_tokens"] - 1, record["decode_tok_s"]) for record in records
               if record.get("decode_tok_s") and record["generated_tokens"] > 1]
    return sum(tokens for tokens, _ in decoded) / sum(tokens / speed for tokens, speed in decoded)


def same_records(batched: dict[tuple[str, str], dict[str, Any]], alone: dict[tuple[str, str], dict[str, Any]]) -> bool:
    return batched.keys() == alone.keys() and all(
        {k: v for k, v in batched[key].items() if k not in TIMING} == {k: v for k, v in record.items()
                                                                      if k not in TIMING}
        for key, record in alone.items())


if __name__ == "__main__":
    main()
