"""Judge what benchmarks/gpu_check.sh left in its output folder: one table, then exit 1 if anything is wrong.

Wrong is:
  - a step that did not finish or exited non-zero (gpu_check.sh writes each step's exit status to OUT/<step>.exit;
    124 is its time budget running out);
  - a failed line of `kvbench check` (OUT/check.json: full against model.generate, the policies against their
    references, the memory readings, a cap below the weights, an out-of-memory caught and released, the sampler);
  - a cell of the run's grid missing from its run folder (the sweep stopped), or recorded as `error`;
  - a load cell whose finished and rejected requests are not every request it was offered;
  - a cell out of memory without a memory condition, or a pressure cell that ran although its cap is below the
    model's weights (the cap was not applied);
  - a record without an allocator or NVML device peak, or whose NVML device peak is below the allocator's (NVML
    can only see more than the allocator holds: less means it measured another GPU).
A transformers other than 5.17.x, the GPU machines' version, is a warning: the check ran, but not on that version.
So is a speed short of its target (`PREFILL_TARGETS`, `FLOOR_TARGET`): slow is not wrong, but the line says by how much.

usage: python benchmarks/gpu/check.py OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.runs.run_folder import RunFolder

FACTS_STEP = "facts"  # torch, transformers and nvidia-ml-py import
DECODE_STEP = "decode"  # benchmarks/decode_step.py, its rows in OUT/decode.json
RUNS = ("sweep", "pressure", "load")  # the run folders gpu_check.sh writes under OUT, each with its OUT/<run>.exit
SELF_CHECK = "check"  # `kvbench check`, its report in OUT/check.json
EXPECTED_TRANSFORMERS = "5.17."
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GiB = 2**30
# the engine's targets on a GPU (Llama-3-8B shape, 32k tokens, batch 1): a policy's prefill tokens/s at least this
# share of full's, and every decode step within this multiple of its bandwidth floor (what it reads over the
# device's copy bandwidth), compiled where it compiles
PREFILL_TARGETS = {"h2o": 0.6, "snapkv": 0.9}
FLOOR_TARGET = 1.3


@dataclass
class Verdict:
    """The table's rows, the problems (each one fails the check), the warnings and what the load cells sustained."""

    rows: list[list[str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sustained: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def step_status(out: Path, step: str) -> str | None:
    """What went wrong with a step of gpu_check.sh (None: it exited 0)."""
    path = out / f"{step}.exit"
    if not path.exists():
        return "did not finish (no exit status: killed, or the script stopped before it)"
    status = path.read_text().strip()
    if status == "0":
        return None
    return "ran out of its time budget (exit 124)" if status == "124" else f"exited {status}"


def memory_cap(memory: dict[str, Any], device_memory: int) -> float:
    """The bytes a pressure cell's process may allocate (kvbench.engine.instruments.memory_pressure)."""
    if memory.get("limit_bytes") is not None:
        return memory["limit_bytes"]
    return (1 - memory["pressure"]) * device_memory


def weight_bytes(manifest: dict[str, Any], cell: dict[str, Any]) -> int | None:
    """The bytes of the cell's model's weights, from the manifest's description of it."""
    for model in manifest.get("models", []):
        if model["spec"] == cell["model"]["id"] and model["dtype"] in DTYPE_BYTES:
            return model["parameters"] * DTYPE_BYTES[model["dtype"]]
    return None


def describe_memory(memory: dict[str, Any] | None) -> str:
    if memory is None:
        return "-"
    return f"pressure {memory['pressure']:g}" if "pressure" in memory else f"limit {gib(memory['limit_bytes'])} GiB"


def cell_label(cell: dict[str, Any]) -> str:
    budget = "" if cell.get("budget") is None else f" b={cell['budget']}"
    return f"{cell['policy']['name']}{budget} L={cell['context_length']}"


def speeds(record: dict[str, Any]) -> tuple[str, str]:
    """Prefill tokens/s, and decode tokens/s with the [min, max] of the timed repeats."""
    prefill, decode, spread = (record.get(k) for k in ("prefill_tok_s", "decode_tok_s", "decode_tok_s_spread"))
    decoded = "-" if decode is None else f"{decode:.1f}" + (f" [{spread[0]:.1f}, {spread[1]:.1f}]" if spread else "")
    return ("-" if prefill is None else f"{prefill:.0f}"), decoded


def record_problems(record: dict[str, Any]) -> list[str]:
    """What is wrong with one record's memory peaks on a GPU."""
    alloc, device = record.get("mem_peak_alloc"), record.get("mem_peak_device")
    if alloc is None:
        return ["no allocator peak"]
    if device is None:
        return [f"no NVML device peak ({record.get('mem_device_note') or 'no note'})"]
    if device < alloc:
        return [f"NVML device peak {gib(device)} GiB below the allocator's {gib(alloc)} GiB (another GPU measured?)"]
    return []


def check_run(out: Path, run: str, verdict: Verdict) -> None:
    """Add one run folder's rows, problems and warnings to `verdict`."""
    status = step_status(out, run)
    if status:
        verdict.problems.append(f"{run}: kvbench sweep {status}")
    folder = RunFolder(out / run)
    manifest = folder.manifest()
    if manifest is None:
        verdict.problems.append(f"{run}: no run folder ({folder.path}/manifest.json missing)")
        return
    environment = manifest.get("environment", {})
    transformers = environment.get("transformers", "unknown")
    if not str(transformers).startswith(EXPECTED_TRANSFORMERS):
        verdict.warnings.append(f"{run}: transformers {transformers}, not the GPU machines' {EXPECTED_TRANSFORMERS}x "
                                f"(PYTHON=<a venv with transformers==5.17.0> bash benchmarks/gpu_check.sh)")
    statuses = folder.cells()
    records: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in folder.records():
        records[record["cell_id"]].append(record)
    for cell_id in manifest["cells"]:
        cell = manifest["cell_descriptions"][cell_id]
        memory = describe_memory(cell.get("memory"))
        where = f"{run}: {cell_label(cell)} ({memory})"
        state = statuses.get(cell_id, {"status": "missing", "message": ""})
        problems = cell_problems(cell, state, records[cell_id], manifest)
        verdict.problems.extend(f"{where}: {problem}" for problem in problems)
        service = state.get("load") or {}
        if "sustained_rate" in service:
            verdict.sustained.append(f"{where}: sustains {service['sustained_rate']} req/s (missed "
                                     f"{service.get('missed_rate')}), pool rows {service.get('pool_rows')}, step "
                                     f"{service.get('pool_step')}")
        if state["status"] != "ok":
            verdict.rows.append([run, cell_label(cell), memory, f"{state['status']} {state['message'][:60]}".strip(),
                                 "-", "-", "", "FAIL" if problems else "ok"])
        for record in records[cell_id] if state["status"] == "ok" else []:
            own = record_problems(record)
            verdict.problems.extend(f"{where} {record['sample_id']}: {problem}" for problem in own)
            peaks = " / ".join(gib(record.get(k)) for k in ("mem_peak_alloc", "mem_peak_reserved", "mem_peak_device"))
            verdict.rows.append([run, cell_label(cell), memory, "ok", *speeds(record), peaks,
                                 "FAIL" if problems or own else "ok"])


def cell_problems(cell: dict[str, Any], state: dict[str, Any], records: list[dict[str, Any]],
                  manifest: dict[str, Any]) -> list[str]:
    """What is wrong with one cell's final status (`missing`: none recorded) and the records it left."""
    memory = cell.get("memory")
    if state["status"] == "missing":
        return ["missing from the run folder: the sweep stopped before it"]
    if state["status"] == "error":
        return [f"error: {state['message']}"]
    if state["status"] == "oom":
        return [] if memory is not None else [f"out of memory outside a pressure cell: {state['message']}"]
    service = state.get("load")
    if "load" in cell and (service is None or service["finished"] + service["rejected"] != service["offered"]):
        return [f"a load cell that does not account for every request it was offered: {service}"]
    expected = state.get("samples", 1)
    problems = [] if len(records) >= expected else [f"ok with {len(records)} of its {expected} samples recorded"]
    # the weights all on the one GPU the environment describes: a random model is never spread with device_map
    device_memory, weights = manifest.get("environment", {}).get("device_memory"), weight_bytes(manifest, cell)
    if memory is not None and device_memory and weights is not None and memory_cap(memory, device_memory) < weights:
        problems.append(f"should have run out of memory: its cap {gib(memory_cap(memory, device_memory))} GiB is "
                        f"below the weights' {gib(weights)} GiB")
    return problems


def check_self(out: Path, verdict: Verdict) -> None:
    """`kvbench check`'s lines (OUT/check.json): a row each, a problem for each failed one."""
    status = step_status(out, SELF_CHECK)
    if status and status != "exited 1":  # exit 1: some check failed, each one said below
        verdict.problems.append(f"{SELF_CHECK}: kvbench check {status}")
    path = out / f"{SELF_CHECK}.json"
    if not path.exists():
        verdict.problems.append(f"{SELF_CHECK}: no report ({path} missing)")
        return
    for line in json.loads(path.read_text())["checks"]:
        if line["status"] == "fail":
            verdict.problems.append(f"{SELF_CHECK}: {line['name']}: {line['detail']}")
        verdict.rows.append([SELF_CHECK, line["name"], "-", line["status"], "-", "-", "",
                             "FAIL" if line["status"] == "fail" else "ok"])


def check_decode(out: Path, verdict: Verdict) -> None:
    """benchmarks/decode_step.py's rows (OUT/decode.json): each policy's step eager and compiled against its
    bandwidth floor; a problem for a step that waits for the host or is compiled again after warm-up."""
    status = step_status(out, DECODE_STEP)
    if status:
        verdict.problems.append(f"{DECODE_STEP}: decode_step.py {status}")
    path = out / f"{DECODE_STEP}.json"
    if not path.exists():
        verdict.problems.append(f"{DECODE_STEP}: no report ({path} missing)")
        return
    for context, rows in json.loads(path.read_text())["contexts"].items():
        for name, row in rows.items():
            wrong = [f"{row['syncs']} host syncs"] if row["syncs"] else []
            wrong += [f"{row['new']} graphs after warm-up"] if row.get("new") else []
            verdict.problems += [f"{DECODE_STEP}: {name} at {context}: {what}" for what in wrong]
            compiled = f"{row['compiled'] * 1e3:.1f} ms compiled" if "compiled" in row else "not compiled"
            verdict.rows.append([DECODE_STEP, f"{name} L={context}", "-", f"{row['eager'] * 1e3:.1f} ms eager",
                                 compiled, f"floor {row['floor'] * 1e3:.1f} ms", "", "FAIL" if wrong else "ok"])
            step, how = (row["compiled"], "compiled") if "compiled" in row else (row["eager"], "eager")
            target(verdict, f"decode {name} at {context}, {how}: {step * 1e3:.1f} ms, {step / row['floor']:.2f}x its "
                            f"floor", step / row["floor"], FLOOR_TARGET, at_least=False)


def check_prefill_targets(out: Path, verdict: Verdict) -> None:
    """Each policy with a prefill target: its prefill tokens/s in the sweep over full's at the same length."""
    folder = RunFolder(out / "sweep")
    manifest = folder.manifest()
    if manifest is None:
        return
    prefill: dict[tuple[str, Any], float] = {}
    for record in folder.records():
        cell = manifest["cell_descriptions"][record["cell_id"]]
        if record.get("prefill_tok_s"):
            prefill[cell["policy"]["name"], cell.get("context_length")] = record["prefill_tok_s"]
    for (policy, context), speed in sorted(prefill.items(), key=str):
        full = prefill.get(("full", context))
        if policy in PREFILL_TARGETS and full:
            target(verdict, f"prefill {policy} at {context}: {speed / full:.2f}x full's tokens/s", speed / full,
                   PREFILL_TARGETS[policy], at_least=True)


def target(verdict: Verdict, line: str, value: float, bound: float, at_least: bool) -> None:
    """`line` against its target, met or missed; a miss is a warning (slow is not wrong)."""
    met = value >= bound if at_least else value <= bound
    verdict.targets.append(f"{line} (target {'at least' if at_least else 'at most'} {bound}x): "
                           f"{'met' if met else 'missed'}")
    if not met:
        verdict.warnings.append(f"speed: {line}, short of its target {bound}x")


def check(out: Path) -> Verdict:
    """The verdict on everything gpu_check.sh left in `out`."""
    verdict = Verdict()
    status = step_status(out, FACTS_STEP)
    if status:
        verdict.problems.append(f"{FACTS_STEP}: importing torch, transformers and nvidia-ml-py {status}")
    check_self(out, verdict)
    for run in RUNS:
        check_run(out, run, verdict)
    check_decode(out, verdict)
    check_prefill_targets(out, verdict)
    return verdict


def environment_line(out: Path) -> str:
    for run in RUNS:
        manifest = RunFolder(out / run).manifest()
        if manifest:
            env = manifest.get("environment", {})
            return (f"device {env.get('device_name')} ({gib(env.get('device_memory'))} GiB), torch {env.get('torch')}, "
                    f"CUDA {env.get('cuda')}, driver {env.get('driver')}, transformers {env.get('transformers')}")
    return "no run folder to read the environment from"


def table(rows: list[list[str]]) -> str:
    header = ["run", "cell", "memory", "status", "prefill tok/s", "decode tok/s [min, max]",
              "alloc / reserved / device peak GiB", "check"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder gpu_check.sh wrote")
    out = parser.parse_args(argv).out
    verdict = check(out)
    print(f"\n{environment_line(out)}\n\n{table(verdict.rows)}\n")
    for line in verdict.sustained:
        print(f"under load: {line}")
    for line in verdict.targets:
        print(f"against the targets: {line}")
    for warning in verdict.warnings:
        print(f"warning: {warning}")
    for problem in verdict.problems:
        print(f"problem: {problem}")
    print(f"GPU check {'PASSED' if verdict.passed else f'FAILED: {len(verdict.problems)} problems'} ({out})")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
