"""One decode step per policy: what it dispatches, whether it waits for the host, whether it compiles to one graph,
and what it costs eager and compiled, beside what it must read.

    python benchmarks/decode_step.py                       # Llama-3-8B's attention, 2 layers, 8k tokens, on the CPU
    python benchmarks/decode_step.py --contexts 8192 32768 --layers 0 --model random:llama-3-8b --device cuda \\
        --dtype bfloat16 --budget 1024                                  # what benchmarks/gpu_check.sh runs

Each context's prompt is fed once, gathering every policy's statistics (a sweep's shared prefill); each policy then
compresses it to `--budget` tokens per layer and KV head and decodes `--steps` tokens, one step at a time:

- `ops/layer`: aten ops dispatched by one step (its forward and its eviction), per layer; `+full` the difference to
  `full`'s, which is the model's own work. Counted, so it does not depend on the machine.
- `syncs`: reads of device values by the host in that step (`.item()`, `.tolist()`, `.cpu()`, a tensor's truth,
  `nonzero`, boolean indexing): each one stalls a GPU's queue.
- `graphs`, `new`: the graphs `torch.compile(fullgraph=True)` made for the step (a graph break is an error there),
  and how many more appeared after the first 8 steps (recompiles while the cache evicts).
- `eager ms`, `compiled ms`: the median step over the last `--steps - 8`, and both against `full`'s eager step.
- `floor ms`: the bytes a step must read (the weights, and the K/V its attention reads, `kv_bytes_read`) over the
  device's copy bandwidth measured here; `x floor`: the compiled step against it (eager where it does not compile).

A policy whose decode step cannot run on static buffers yet runs eager on the dynamic layout (`kvbench policies`
says why); its compiled columns say so. CPU times are noisy: read the ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from stats_scaling import load_layers

from kvbench.engine.cache import step_blocker
from kvbench.engine.instruments import StepWork, synchronize
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.engine.sharing import shared_prefill
from kvbench.policies import build_policy

POLICIES = {"full": ("full", {}), "window": ("window", {}), "streaming_llm": ("streaming_llm", {}),
            "snapkv": ("snapkv", {}), "h2o": ("h2o", {}), "tova": ("tova", {}), "ada_kv": ("ada_kv", {}),
            "quant-4": ("quant", {"bits": 4})}
WARM = 8


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a copy of 256 MiB moves on `device` (it reads and writes each byte: twice its size)."""
    source = torch.empty(1 << 26, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    synchronize(device)
    return 5 * 2 * source.nbytes / (time.perf_counter() - start)


def timed_steps(session: Session, steps: int) -> tuple[list[float], int, int]:
    """Decode `steps` tokens one step at a time; each step's seconds after the first `WARM`, and the graphs the
    compiler made by then and at the end."""
    from torch._dynamo.utils import counters

    device, token = session.lm.device, torch.tensor([7], device=session.lm.device)
    times, warm = [], 0
    for step in range(steps):
        synchronize(device)
        start = time.perf_counter()
        token = session.step(token).argmax(-1)
        synchronize(device)
        if step >= WARM:
            times.append(time.perf_counter() - start)
        if step == WARM - 1:
            warm = counters["stats"]["unique_graphs"]
    return times, warm, counters["stats"]["unique_graphs"]


def measure(lm, shared, ids, name: str, budget: int, steps: int) -> dict:
    """One policy's row: its step's ops and syncs, eager and compiled times, the K/V bytes its step reads."""
    settings = RunSettings(budget=None if name in ("full", "quant-4") else budget)
    policy_name, params = POLICIES[name]
    session = Session(lm, build_policy(policy_name, params), settings, len(ids), adds=2 * steps + 1)
    with session:
        session.prefill(ids, shared=shared)
    eager, compiled = session.fork(), session.fork()
    with eager:
        for _ in range(WARM):
            eager.step(7)
        with StepWork() as work:
            eager.step(7)
        eager_times, _, _ = timed_steps(eager, steps)
    row = {"ops": work.ops / lm.num_layers, "syncs": sum(work.syncs.values()),
           "eager": statistics.median(eager_times), "kv_read": eager.measurements()["kv_bytes_read"],
           "blocker": step_blocker(session.policy)}
    if row["blocker"] is None:
        from torch._dynamo.utils import counters

        counters.clear()
        lm.compile = True
        try:
            with compiled:
                times, warm, graphs = timed_steps(compiled, steps + WARM)
        finally:
            lm.compile = False
        row.update(compiled=statistics.median(times), graphs=graphs, new=graphs - warm)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3-8b-heads")
    parser.add_argument("--layers", type=int, default=2, help="keep the first layers only (0: all)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured per policy and mode")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json-out", type=Path, help="also write the rows as JSON (benchmarks/gpu/check.py reads it)")
    args = parser.parse_args()

    lm = load_layers(args.model, args.layers, device=args.device, dtype=args.dtype)
    bandwidth = copy_bandwidth(lm.device)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    print(f"model {args.model} ({lm.num_layers} layers, {lm.kv_heads} KV heads x {lm.head_dim}, {lm.dtype}), "
          f"device {lm.device}, {torch.get_num_threads()} threads; budget {args.budget}; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; weights {weights / 2**20:.0f} MiB")
    report: dict = {"model": args.model, "layers": lm.num_layers, "dtype": str(lm.dtype), "device": str(lm.device),
                    "budget": args.budget, "bandwidth": bandwidth, "weights": weights, "contexts": {}}
    for context in args.contexts:
        generator = torch.Generator().manual_seed(context)
        ids = torch.randint(100, lm.model.config.vocab_size, (context,), generator=generator).tolist()
        observers = [build_policy(*POLICIES[name]) for name in args.policies]
        start = time.perf_counter()
        shared = shared_prefill(lm, ids, observers)
        print(f"\ncontext {context}: shared prefill {time.perf_counter() - start:.0f} s")
        rows = {name: measure(lm, shared, ids, name, args.budget, args.steps)  # full too: the ratios' base
                for name in dict.fromkeys(["full", *args.policies])}
        for row in rows.values():
            row["floor"] = (weights + row["kv_read"]) / bandwidth
        report["contexts"][context] = rows
        full = rows["full"]
        print(f"{'policy':<14}{'ops/layer':>10}{'+full':>7}{'syncs':>6}{'graphs':>7}{'new':>4}{'eager ms':>10}"
              f"{'x full':>7}{'compiled ms':>12}{'x full':>7}{'floor ms':>9}{'x floor':>8}")
        for name, row in rows.items():
            floor = row["floor"]
            best = row.get("compiled", row["eager"])
            compiled = f"{row['compiled'] * 1e3:12.2f}{row['compiled'] / full['eager']:7.2f}" if "compiled" in row \
                else f"{'(eager: ' + row['blocker'][:10] + ')':>19}"
            print(f"{name:<14}{row['ops']:10.1f}{row['ops'] - full['ops']:+7.1f}{row['syncs']:6d}"
                  f"{row.get('graphs', '-'):>7}{row.get('new', '-'):>4}{row['eager'] * 1e3:10.2f}"
                  f"{row['eager'] / full['eager']:7.2f}{compiled}{floor * 1e3:9.2f}{best / floor:8.2f}")

    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
