"""Cost of the attention statistics: prefill time and extra peak memory of each attention-scored policy
(h2o, snapkv, tova, scissorhands) relative to `full` at growing prompt lengths, and one decode step's time at a
long cache, in one run.

    python benchmarks/stats_scaling.py [--model smollm2-135m] [--layers 4] [--lengths 2048 4096 8192 16384]
    python benchmarks/stats_scaling.py --model random:llama-3-8b --layers 2
    python benchmarks/stats_scaling.py --policies full h2o --lengths 8192 16384 --repeats 5 --decode-length 0
    python benchmarks/stats_scaling.py --model random:llama-3-8b --layers 8 --device cuda --dtype bfloat16 \
        --policies full h2o snapkv --lengths 32768 --repeats 3 --decode-length 0

Every length runs each policy `--repeats` times, interleaved (full, h2o, ..., full, h2o, ...), on a random
prompt; the median prefill time is reported as a ratio over `full`'s, and the peak memory above the
session's start (GPU: torch's allocator peak; CPU: the process RSS peak, kvbench.engine.instruments.PeakMemory) as
extra MiB over `full`'s. `--layers` keeps the model's first layers only (0: all): at long context a layer's
attention, and its statistics, are most of the prefill, so the ratios barely depend on it; a `random:` model
is built with only those layers (an 8B shape at full depth does not fit a small machine).
The decode table prefills `--decode-length` tokens with a budget of as many tokens, so every cache attends
the same number of entries and a decode-time policy evicts one entry per step, as in its steady state; it
reports the median of `--decode-steps` one-token steps against `full`'s (snapkv scores the prompt only).
Absolute times on a shared machine are noise; ratios measured together are not, until the machine is
oversubscribed: then `--clock cpu` with `OMP_NUM_THREADS=1` counts the process's CPU seconds instead of wall
seconds (the work each policy does, whatever share of a core it was given).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbench.engine.models import RANDOM_SHAPES, LoadedModel, load_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy

POLICIES = ("full", "h2o", "snapkv", "tova", "scissorhands")


def release_freed_memory() -> None:
    """On Linux (glibc), serve large blocks from mmap and trim the heap, so memory a run frees leaves the
    RSS and every run's RSS peak starts from the same floor (else the first run's peak hides the next)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, fixed (glibc raises it as blocks are freed)
        libc.malloc_trim(0)


def load_layers(spec: str, layers: int, **load: Any) -> LoadedModel:
    """`spec` with its first `layers` decoder layers only (0: all); `load`: `load_model`'s device and dtype."""
    shape = spec.removeprefix("random:")
    if layers and spec.startswith("random:") and shape in RANDOM_SHAPES:
        model_type, params = RANDOM_SHAPES[shape]
        RANDOM_SHAPES[shape] = (model_type, {**params, "num_hidden_layers": layers})  # never build the rest
        return load_model(spec, **load)
    lm = load_model(spec, **load)
    if layers:  # a Llama/Qwen2-style decoder: drop the later layers
        lm.model.model.layers = lm.model.model.layers[:layers]
        lm.model.config.num_hidden_layers = len(lm.model.model.layers)
    return lm


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def settled(lm: LoadedModel) -> None:
    """Wait for the GPU's queued work, so that a clock read after it times the work, not its launch."""
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def prefill(lm: LoadedModel, name: str, ids: list[int], budget: float, clock: str) -> tuple[float, int]:
    """(prefill seconds, peak bytes above the start) of one prompt under `name`."""
    release_freed_memory()
    session = Session(lm, build_policy(name), RunSettings(budget=None if name == "full" else budget),
                      prompt_tokens=len(ids))
    with session:
        settled(lm)
        start = CLOCKS[clock]()
        session.prefill(ids)
        settled(lm)
        seconds = CLOCKS[clock]() - start
    memory = session.memory
    assert memory is not None, "a session measures its memory over `with session:`"
    return seconds, memory.peak_bytes - memory.baseline_bytes


def decode_steps(lm: LoadedModel, name: str, ids: list[int], steps: int, clock: str) -> list[float]:
    """Seconds of each of `steps` one-token steps after prefilling `ids`, with a budget of len(ids) tokens."""
    release_freed_memory()
    session = Session(lm, build_policy(name), RunSettings(budget=None if name == "full" else len(ids)),
                      prompt_tokens=len(ids))
    seconds = []
    with session:
        session.prefill(ids)
        for token in ids[:steps]:
            settled(lm)
            start = CLOCKS[clock]()
            session.step(token)
            settled(lm)
            seconds.append(CLOCKS[clock]() - start)
    return seconds


def prefill_table(lm: LoadedModel, policies: list[str], lengths: list[int], budget: float, repeats: int, vocab: int,
                  clock: str) -> None:
    print(f"{'tokens':>7}{'policy':>14}{'prefill s':>11}{'vs full':>9}{'peak MiB':>10}{'extra MiB':>11}")
    for length in lengths:
        torch.manual_seed(length)
        ids = torch.randint(vocab, (length,)).tolist()
        seconds: dict[str, list[float]] = {name: [] for name in policies}
        peaks: dict[str, list[int]] = {name: [] for name in policies}
        for _ in range(repeats):
            for name in policies:
                time_s, peak = prefill(lm, name, ids, budget, clock)
                seconds[name].append(time_s)
                peaks[name].append(peak)
        base_s, base_peak = statistics.median(seconds["full"]), statistics.median(peaks["full"])
        for name in policies:
            median_s, median_peak = statistics.median(seconds[name]), statistics.median(peaks[name])
            print(f"{length:>7}{name:>14}{median_s:>11.2f}{median_s / base_s:>8.2f}x{median_peak / 2**20:>10.0f}"
                  f"{(median_peak - base_peak) / 2**20:>+11.0f}", flush=True)


def decode_table(lm: LoadedModel, policies: list[str], length: int, steps: int, repeats: int, vocab: int,
                 clock: str) -> None:
    torch.manual_seed(length)
    ids = torch.randint(vocab, (length,)).tolist()
    step_s: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name in policies:
            step_s[name].extend(decode_steps(lm, name, ids, steps, clock))
    base_ms = statistics.median(step_s["full"]) * 1e3
    print(f"decode at {length} tokens, median of {steps} steps x {repeats}")
    print(f"{'policy':>14}{'ms/step':>9}{'vs full':>9}")
    for name in policies:
        step_ms = statistics.median(step_s[name]) * 1e3
        print(f"{name:>14}{step_ms:>9.1f}{step_ms / base_ms:>8.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (embedded), random:llama-3-8b, ...")
    parser.add_argument("--layers", type=int, default=4, help="keep the first layers only (0: all)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                        help="full and some of the others (ratios are over full's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--budget", type=float, default=0.25, help="kept share of the prompt (or tokens if >= 1)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--decode-length", type=int, default=8192, help="cache length of the decode table (0: none)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: the process's CPU seconds")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: a GPU if there is one)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, ... (auto: as kvbench run picks it)")
    args = parser.parse_args()
    policies = ["full", *(name for name in args.policies if name != "full")]

    lm = load_layers(args.model, args.layers, device=args.device, dtype=args.dtype)
    vocab = min(256, lm.model.config.vocab_size)
    prefill(lm, "h2o", torch.randint(vocab, (64,)).tolist(), args.budget, args.clock)  # warm-up
    print(f"model {args.model}, {lm.num_layers} layers, budget {args.budget}, {torch.get_num_threads()} threads, "
          f"device {lm.device}, {args.clock} clock, median of {args.repeats}")
    prefill_table(lm, policies, args.lengths, args.budget, args.repeats, vocab, args.clock)
    if args.decode_length:
        decode_table(lm, policies, args.decode_length, args.decode_steps, args.repeats, vocab, args.clock)


if __name__ == "__main__":
    main()
