"""What sharing the prompt's forward saves: a 6-policy x 4-budget needle sweep run three ways, in one run:

  1. `kvbench sweep` (one prompt forward per sample, shared by every cell),
  2. `kvbench sweep --no-share` (same process, each cell runs the prompt itself),
  3. each cell on its own with `kvbench run` (a process per cell, as scripts around other tools do).

    python benchmarks/sweep_sharing.py [--model smollm2-135m] [--context 1024]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

POLICIES = ["full", "window", "streaming_llm", "h2o", "snapkv", "random"]
BUDGETS = [64, 128, 256, 0.5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    kvbench = [sys.executable, "-m", "kvbench.cli"]
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "sharing.yaml"
        config.write_text(yaml.safe_dump({
            "name": "sharing", "model": {"id": args.model}, "policies": POLICIES, "budgets": BUDGETS,
            "context_lengths": [args.context], "tasks": [{"name": "niah", "depths": [0.5]}], "samples": 1,
        }))
        subprocess.run([*kvbench, "validate", str(config)], check=True, capture_output=True)
        timings = {}
        for label, extra in (("kvbench sweep (shared prefill)", []), ("kvbench sweep --no-share", ["--no-share"])):
            start = time.perf_counter()
            subprocess.run([*kvbench, "sweep", str(config), "-q", "-o", str(Path(scratch) / label.split()[-1]), *extra],
                           check=True, capture_output=True)
            timings[label] = time.perf_counter() - start
        start = time.perf_counter()
        cells = 0
        for policy in POLICIES:
            for budget in BUDGETS[:1] if policy == "full" else BUDGETS:
                subprocess.run([*kvbench, "run", "-m", args.model, "-p", policy, "-b", str(budget), "-c",
                                str(args.context), "--depth", "0.5", "--json"], check=True, capture_output=True)
                cells += 1
        timings[f"{cells} x kvbench run"] = time.perf_counter() - start
    base = timings["kvbench sweep (shared prefill)"]
    print(f"{cells} cells ({len(POLICIES)} policies x {len(BUDGETS)} budgets, full once), model {args.model}, "
          f"needle at {args.context} tokens, one sample per cell, wall time including process start and model load")
    print(f"{'way':<36}{'seconds':>9}{'vs shared':>11}")
    for label, seconds in timings.items():
        print(f"{label:<36}{seconds:>9.1f}{seconds / base:>10.2f}x")


if __name__ == "__main__":
    main()
