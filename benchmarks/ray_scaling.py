"""What the Ray executor costs and gains: one small needle sweep run three ways, in one run, each in its own process
from start to summary (process start, Ray's local cluster, workers starting, model loads included):

  1. `kvbench sweep` (the local executor: one process, torch using every core),
  2. `kvbench sweep --executor ray --workers 1` (one worker holding every core),
  3. `kvbench sweep --executor ray --workers 2` (two workers, the cores split between them),

and, for scale, a Ray local cluster started and stopped with nothing to run. Every way must give the same summary
(scores and cache bytes), which it checks. Ray starts its workers at nice 15; the runs here set `RAY_worker_niceness=0`
so that, on a machine shared with other jobs, the workers get the local process's priority and the ratios measure the
executor rather than the scheduler.

    python benchmarks/ray_scaling.py [--model random:smollm2-135m] [--contexts 512 768 1024 1280]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

POLICIES = ["full", "window", "h2o", {"name": "snapkv", "window": 16}]
RESULT_COLUMNS = ["cell_id", "status", "n", "score", "cache_ratio", "kv_bytes_live", "kv_bytes_peak"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 768, 1024, 1280])
    args = parser.parse_args()
    kvbench = [sys.executable, "-m", "kvbench.cli"]
    environment = {**os.environ, "RAY_worker_niceness": "0"}
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "scaling.yaml"
        config.write_text(yaml.safe_dump({
            "name": "scaling", "model": {"id": args.model, "dtype": "float32", "device": "cpu"},
            "policies": POLICIES, "budgets": [128], "context_lengths": args.contexts,
            "tasks": [{"name": "niah", "depths": [0.25, 0.75]}], "samples": 1, "max_new_tokens": 8,
        }))
        subprocess.run([*kvbench, "validate", str(config)], check=True, capture_output=True)
        ways = {"local executor": [], "ray, 1 worker": ["--executor", "ray", "--workers", "1"],
                "ray, 2 workers": ["--executor", "ray", "--workers", "2"]}
        timings, summaries = {}, {}
        for label, extra in ways.items():
            output = Path(scratch) / label.replace(" ", "").replace(",", "")
            start = time.perf_counter()
            subprocess.run([*kvbench, "sweep", str(config), "-q", "-o", str(output), *extra], check=True,
                           capture_output=True, env=environment)
            timings[label] = time.perf_counter() - start
            summaries[label] = pd.read_csv(output / "summary.csv")[RESULT_COLUMNS]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import ray; ray.init(); ray.shutdown()"], check=True,
                       capture_output=True, env=environment)
        timings["ray start + stop, nothing run"] = time.perf_counter() - start
    same = all(frame.equals(summaries["local executor"]) for frame in summaries.values())
    base = timings["local executor"]
    print(f"{len(summaries['local executor'])} cells ({len(POLICIES)} policies x {len(args.contexts)} context lengths "
          f"{args.contexts}, needle at 2 depths), model {args.model}, {len(args.contexts)} sample groups; wall time "
          f"from process start to summary; same scores and bytes every way: {'yes' if same else 'NO'}")
    print(f"{'way':<34}{'seconds':>9}{'vs local':>10}")
    for label, seconds in timings.items():
        print(f"{label:<34}{seconds:>9.1f}{seconds / base:>9.2f}x")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
