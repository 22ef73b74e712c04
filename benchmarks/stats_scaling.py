"""Prefill cost of the attention statistics: time and extra peak memory of each attention-scored policy
(h2o, snapkv, tova, scissorhands) relative to `full`, at growing prompt lengths, in one run.

    python benchmarks/stats_scaling.py [--model random:smollm2-135m] [--layers 4] [--lengths 2048 4096 8192]

Every length runs each policy `--repeats` times, interleaved (full, h2o, ..., full, h2o, ...), on a random
prompt; the median prefill time is reported as a ratio over `full`'s, and the peak memory above the
session's start (GPU: torch's allocator peak; CPU: the process RSS peak, kvbench.measure.PeakMemory) as
extra MiB over `full`'s. `--layers` keeps the model's first layers only (0: all): at long context a layer's
attention, and its statistics, are most of the prefill, so the ratios barely depend on it.
Absolute times on a shared machine are noise; ratios measured together are not.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import torch

from kvbench.models import load_model
from kvbench.policies import build_policy
from kvbench.session import RunSettings, Session

POLICIES = ("full", "h2o", "snapkv", "tova", "scissorhands")


def release_freed_memory() -> None:
    """On Linux (glibc), serve large blocks from mmap and trim the heap, so memory a run frees leaves the
    RSS and every run's RSS peak starts from the same floor (else the first run's peak hides the next)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, fixed (glibc raises it as blocks are freed)
        libc.malloc_trim(0)


def prefill(lm, name: str, ids: list[int], budget: float) -> tuple[float, int]:
    """(prefill seconds, peak bytes above the start) of one prompt under `name`."""
    release_freed_memory()
    session = Session(lm, build_policy(name), RunSettings(budget=None if name == "full" else budget),
                      prompt_tokens=len(ids))
    with session:
        session.prefill(ids)
    return session.prefill_s, session.memory.peak_bytes - session.memory.baseline_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--layers", type=int, default=4, help="keep the first layers only (0: all)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=float, default=0.25, help="kept share of the prompt (or tokens if >= 1)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    lm = load_model(args.model)
    if args.layers:  # a Llama/Qwen2-style decoder: drop the later layers
        lm.model.model.layers = lm.model.model.layers[: args.layers]
        lm.model.config.num_hidden_layers = len(lm.model.model.layers)
    vocab = min(256, lm.model.config.vocab_size)
    prefill(lm, "h2o", torch.randint(vocab, (64,)).tolist(), args.budget)  # warm-up
    print(f"model {args.model}, {lm.num_layers} layers, budget {args.budget}, {torch.get_num_threads()} threads, "
          f"device {lm.device}, median of {args.repeats}")
    print(f"{'tokens':>7}{'policy':>14}{'prefill s':>11}{'vs full':>9}{'peak MiB':>10}{'extra MiB':>11}")
    for length in args.lengths:
        torch.manual_seed(length)
        ids = torch.randint(vocab, (length,)).tolist()
        seconds: dict[str, list[float]] = {name: [] for name in POLICIES}
        peaks: dict[str, list[int]] = {name: [] for name in POLICIES}
        for _ in range(args.repeats):
            for name in POLICIES:
                time_s, peak = prefill(lm, name, ids, args.budget)
                seconds[name].append(time_s)
                peaks[name].append(peak)
        base_s, base_peak = statistics.median(seconds["full"]), statistics.median(peaks["full"])
        for name in POLICIES:
            time_s, peak = statistics.median(seconds[name]), statistics.median(peaks[name])
            print(f"{length:>7}{name:>14}{time_s:>11.2f}{time_s / base_s:>8.2f}x{peak / 2**20:>10.0f}"
                  f"{(peak - base_peak) / 2**20:>+11.0f}", flush=True)


if __name__ == "__main__":
    main()
