"""What a service's decode step costs: B requests of different lengths in one joint step (kvbench/engine/joint.py: each
row's attention over its own cache), against the same B requests stepped one at a time and against one left-padded
B-row cache (the static batch of `generate_batch`, whose rows must start together).

    python benchmarks/joint_step.py [--model smollm2-135m] [--context 512] [--batches 1 4 8] [--steps 8]

Each (batch, way) runs `--repeats` times interleaved; the median seconds per step and the ratios measured in this
run are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvbench.engine.generation import left_padded
from kvbench.engine.models import load_model
from kvbench.engine.session import Session, step_together
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lm = load_model(args.model)
    generator = torch.Generator().manual_seed(0)
    print(f"{args.model}, prompts of {args.context}-{args.context + 8 * max(args.batches)} tokens, {args.steps} steps")
    for batch in args.batches:
        prompts = [torch.randint(10, 10_000, (args.context + 8 * row,), generator=generator).tolist()
                   for row in range(batch)]
        seconds: dict[str, list[float]] = {"joint": [], "one at a time": [], "left-padded": []}
        for _ in range(args.repeats):
            for way, run in (("joint", _joint), ("one at a time", _serial), ("left-padded", _padded)):
                seconds[way].append(run(lm, prompts, args.steps))
        median = {way: statistics.median(values) for way, values in seconds.items()}
        print(f"batch {batch}: joint {1000 * median['joint']:.0f} ms/step, one at a time "
              f"{1000 * median['one at a time']:.0f} ms, left-padded {1000 * median['left-padded']:.0f} ms; "
              f"joint / one at a time = {median['joint'] / median['one at a time']:.2f}x, "
              f"joint / left-padded = {median['joint'] / median['left-padded']:.2f}x")


def _sessions(lm, prompts: list[list[int]], steps: int) -> list[Session]:
    sessions = []
    for prompt in prompts:
        session = Session(lm, build_policy("full", {}), RunSettings(), prompt_tokens=len(prompt), adds=steps)
        session.prefill(prompt)
        sessions.append(session)
    return sessions


def _joint(lm, prompts: list[list[int]], steps: int) -> float:
    sessions = _sessions(lm, prompts, steps)
    tokens = [int(s.logits.argmax()) for s in sessions]  # type: ignore[union-attr]
    start = time.perf_counter()
    for _ in range(steps):
        tokens = step_together(sessions, tokens).argmax(-1).tolist()
    return (time.perf_counter() - start) / steps


def _serial(lm, prompts: list[list[int]], steps: int) -> float:
    sessions = _sessions(lm, prompts, steps)
    tokens = [int(s.logits.argmax()) for s in sessions]  # type: ignore[union-attr]
    start = time.perf_counter()
    for _ in range(steps):
        tokens = [int(s.step(t).argmax()) for s, t in zip(sessions, tokens, strict=True)]
    return (time.perf_counter() - start) / steps


def _padded(lm, prompts: list[list[int]], steps: int) -> float:
    ids, padding = left_padded(lm, prompts)
    session = Session(lm, build_policy("full", {}), RunSettings(), prompt_tokens=ids.shape[1], adds=steps,
                      left_padding=padding)
    session.prefill(ids)
    tokens = session.logits.argmax(-1)  # type: ignore[union-attr]
    start = time.perf_counter()
    for _ in range(steps):
        tokens = session.step(tokens).argmax(-1)
    return (time.perf_counter() - start) / steps


if __name__ == "__main__":
    main()
