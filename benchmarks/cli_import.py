"""What `kvbench --help` pays before it prints: `import kvbench.cli`, timed in fresh interpreters, this checkout
against a git revision, alternated so that both see the same machine; and which modules each loads.

    python benchmarks/cli_import.py --baseline HEAD~1 --repeats 7

Each tree is laid out as it installs (`policies/` and `tasks/` inside `kvbench/`) in a temporary folder and put first
on PYTHONPATH, so the checkout's editable install does not answer for the baseline."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import json, sys, time; start = time.perf_counter(); import kvbench.cli; "
         "seconds = time.perf_counter() - start; "
         "print(json.dumps({'seconds': seconds, 'modules': sorted(m for m in sys.modules if m.startswith('kvbench')), "
         "'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}))")


def lay_out(source: Path, target: Path) -> Path:
    """`source`'s kvbench package as a wheel installs it, under `target`."""
    shutil.copytree(source / "kvbench", target / "kvbench", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("policies", "tasks"):
        shutil.copytree(source / folder, target / "kvbench" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def probe(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env, cwd=tree)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old_source = Path(scratch) / "source"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old_source), args.baseline],
                       check=True)
        try:
            trees = {"baseline": lay_out(old_source, Path(scratch) / "old"),
                     "this checkout": lay_out(ROOT, Path(scratch) / "new")}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_source)], check=True)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):  # alternated: a slow moment of the machine falls on both
            for name, tree in trees.items():
                runs[name].append(probe(tree))
    medians = {name: statistics.median(run["seconds"] for run in found) for name, found in runs.items()}
    for name, found in runs.items():
        last = found[-1]
        policies = [m.removeprefix("kvbench.policies.") for m in last["modules"] if m.startswith("kvbench.policies.")]
        print(f"{name:14s} import kvbench.cli {medians[name]:.2f} s (median of {args.repeats}), "
              f"{len(last['modules'])} kvbench modules, policies: {', '.join(policies)}; "
              f"torch {'yes' if last['torch'] else 'no'}, transformers {'yes' if last['transformers'] else 'no'}")
    print(f"baseline / this checkout: {medians['baseline'] / medians['this checkout']:.2f}x")


if __name__ == "__main__":
    main()
