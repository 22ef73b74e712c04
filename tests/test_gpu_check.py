"""benchmarks/gpu_check.sh's verdict (benchmarks/gpu/check.py) on fabricated output folders: a clean H200 run passes,
and each way a GPU run goes wrong fails it; the shipped configs and the script's time budget."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from kvbench.config.cells import expand
from kvbench.config.schema import load_config
from kvbench.engine.estimate import model_shape
from kvbench.runs.run_folder import RunFolder

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
H200 = 140 * GiB
LLAMA_3_8B = {"spec": "random:llama-3-8b", "dtype": "bfloat16", "parameters": 8_030_261_248}  # ~15 GiB of weights


def load_checker():
    """benchmarks/gpu/check.py, a script rather than a package's module."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


check = load_checker()


def cell(policy: str, memory: dict | None = None) -> dict:
    description = {"model": {"id": LLAMA_3_8B["spec"], "dtype": "bfloat16"}, "policy": {"name": policy, "params": {}},
                   "budget": None if policy == "full" else 1024, "context_length": 32768}
    return {**description, **({"memory": memory} if memory else {})}


def record(cell_id: str, alloc: int = 20 * GiB, device: int | None = 23 * GiB) -> dict:
    return {"cell_id": cell_id, "sample_id": "niah-32768-d0.5-s0", "mem_peak_alloc": alloc,
            "mem_peak_reserved": alloc + GiB, "mem_peak_device": device,
            "mem_device_note": None if device else "nvidia-ml-py is not installed", "prefill_tok_s": 9000.0,
            "decode_tok_s": 30.0, "decode_tok_s_spread": [30.0, 30.0]}


def write_run(out: Path, run: str, cells: dict[str, tuple[dict, str, list[dict]]], transformers: str = "5.17.0",
              exit_status: str | None = "0", service: dict | None = None) -> None:
    """A run folder as `kvbench sweep` leaves it: cells by id -> (description, final status, records); a status of
    None leaves the cell out of cells.jsonl, as a sweep that stopped before it."""
    folder = RunFolder(out / run)
    folder.path.mkdir(parents=True)
    folder.write_manifest({"cells": list(cells), "cell_descriptions": {i: c[0] for i, c in cells.items()},
                           "models": [LLAMA_3_8B],
                           "environment": {"device": "cuda:0", "device_name": "NVIDIA H200", "device_memory": H200,
                                           "torch": "2.13.0", "cuda": "12.8", "transformers": transformers}})
    for cell_id, (_, status, records) in cells.items():
        if status is not None:
            folder.add_cell({"cell_id": cell_id, "status": status, "samples": 1,
                             "message": "" if status == "ok" else "OutOfMemoryError: CUDA out of memory.",
                             **({"load": service} if service else {})})
        for row in records:
            folder.add_record(row)
    if exit_status is not None:
        (out / f"{run}.exit").write_text(exit_status + "\n")


def clean_run(out: Path) -> dict[str, dict]:
    """Every file of a GPU check that went right; returns the cells of both runs by id, to break one."""
    sweep = {f"s-{p}": (cell(p), "ok", [record(f"s-{p}")]) for p in ("full", "window", "h2o", "snapkv")}
    pressure = {"p-full-0.5": (cell("full", {"pressure": 0.5}), "ok", [record("p-full-0.5")]),
                "p-full-0.99": (cell("full", {"pressure": 0.99}), "oom", [])}
    load = {f"l-{p}": ({**cell(p), "load": {"rate": 4}}, "ok", [record(f"l-{p}")]) for p in ("full", "snapkv")}
    write_run(out, "sweep", sweep)
    write_run(out, "pressure", pressure)
    write_run(out, "load", load, service={"offered": 8, "finished": 7, "rejected": 1})
    (out / "facts.exit").write_text("0\n")
    (out / "check.exit").write_text("0\n")
    (out / "check.json").write_text(json.dumps({"checks": [
        {"name": "generate.long", "status": "pass", "detail": "16 of 16 tokens equal", "numbers": {}},
        {"name": "memory.oom", "status": "pass", "detail": "out of memory caught", "numbers": {}}]}))
    (out / "decode.exit").write_text("0\n")
    (out / "decode.json").write_text(json.dumps({"contexts": {"32768": {
        name: {"syncs": 0, "eager": 0.02, "compiled": 0.0075, "graphs": 1, "new": 0, "floor": 0.006}
        for name in ("full", "h2o")}}}))
    return {**sweep, **pressure, **load}


def test_a_clean_gpu_run_passes_with_one_table(tmp_path, capsys):
    clean_run(tmp_path)
    assert check.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "GPU check PASSED" in printed and "problem" not in printed and "warning" not in printed
    assert "device NVIDIA H200 (140.00 GiB)" in printed and "transformers 5.17.0" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| sweep") or line.startswith("| pressure")]
    assert len(rows) == 6 and all(row.endswith("| ok |") for row in rows)
    assert "| sweep | h2o b=1024 L=32768 | - | ok | 9000 | 30.0 [30.0, 30.0] | 20.00 / 21.00 / 23.00 | ok |" in rows
    assert any("| pressure | full L=32768 | pressure 0.99 | oom" in row for row in rows)


def rewrite(out: Path, run: str, cells: dict[str, tuple[dict, str, list[dict]]], **kwargs) -> None:
    for path in [*(out / run).iterdir(), out / f"{run}.exit"]:
        path.unlink(missing_ok=True)
    (out / run).rmdir()
    write_run(out, run, cells, **kwargs)


def run_cells(cells: dict, prefix: str) -> dict:
    return {i: c for i, c in cells.items() if i.startswith(prefix)}


def nvml_below_allocator(out, cells):
    sweep = run_cells(cells, "s-")
    sweep["s-h2o"] = (sweep["s-h2o"][0], "ok", [record("s-h2o", alloc=20 * GiB, device=19 * GiB)])
    rewrite(out, "sweep", sweep)


def no_nvml_peak(out, cells):
    sweep = run_cells(cells, "s-")
    sweep["s-full"] = (sweep["s-full"][0], "ok", [record("s-full", device=None)])
    rewrite(out, "sweep", sweep)


def pressure_cell_that_should_oom_ran(out, cells):
    pressure = run_cells(cells, "p-")
    pressure["p-full-0.99"] = (pressure["p-full-0.99"][0], "ok", [record("p-full-0.99")])
    rewrite(out, "pressure", pressure)


def sweep_exited_non_zero(out, cells):
    (out / "sweep.exit").write_text("1\n")


def sweep_ran_out_of_time(out, cells):
    (out / "sweep.exit").write_text("124\n")


def sweep_never_finished(out, cells):
    (out / "pressure.exit").unlink()


def load_loses_a_request(out, cells):
    rewrite(out, "load", run_cells(cells, "l-"), service={"offered": 8, "finished": 6, "rejected": 1})


def sweep_cell_ends(cell_id: str, status: str | None, name: str):
    """A breakage: the sweep's cell `cell_id` ends in `status` (None: not in the run folder) with no record."""
    def breakage(out, cells):
        sweep = run_cells(cells, "s-")
        sweep[cell_id] = (sweep[cell_id][0], status, [])
        rewrite(out, "sweep", sweep)
    breakage.__name__ = name
    return breakage


cells_missing = sweep_cell_ends("s-snapkv", None, "cells_missing")
cell_in_error = sweep_cell_ends("s-window", "error", "cell_in_error")
oom_outside_pressure = sweep_cell_ends("s-full", "oom", "oom_outside_pressure")
ok_without_its_record = sweep_cell_ends("s-full", "ok", "ok_without_its_record")


def no_run_folder(out, cells):
    rewrite(out, "pressure", {})
    (out / "pressure" / "manifest.json").unlink()


def a_self_check_failed(out, cells):
    report = json.loads((out / "check.json").read_text())
    report["checks"][1].update(status="fail", detail="131072 tokens ran under a cap of 17.00 GiB: no out-of-memory")
    (out / "check.json").write_text(json.dumps(report))
    (out / "check.exit").write_text("1\n")


def self_check_ran_out_of_time(out, cells):
    (out / "check.json").unlink()
    (out / "check.exit").write_text("124\n")


def pynvml_missing(out, cells):
    (out / "facts.exit").write_text("1\n")


def a_step_that_recompiles_and_waits(out, cells):
    report = json.loads((out / "decode.json").read_text())
    report["contexts"]["32768"]["h2o"].update(new=3, syncs=2)
    (out / "decode.json").write_text(json.dumps(report))


BREAKAGES = [  # (how a run goes wrong, the problem check.py must report)
    (nvml_below_allocator, "sweep: h2o b=1024 L=32768 (-) niah-32768-d0.5-s0: NVML device peak 19.00 GiB below the "
                           "allocator's 20.00 GiB"),
    (no_nvml_peak, "sweep: full L=32768 (-) niah-32768-d0.5-s0: no NVML device peak (nvidia-ml-py is not installed)"),
    (pressure_cell_that_should_oom_ran, "pressure: full L=32768 (pressure 0.99): should have run out of memory: its "
                                        "cap 1.40 GiB is below the weights' 14.96 GiB"),
    (sweep_exited_non_zero, "sweep: kvbench sweep exited 1"),
    (sweep_ran_out_of_time, "sweep: kvbench sweep ran out of its time budget (exit 124)"),
    (sweep_never_finished, "pressure: kvbench sweep did not finish"),
    (cells_missing, "sweep: snapkv b=1024 L=32768 (-): missing from the run folder: the sweep stopped before it"),
    (cell_in_error, "sweep: window b=1024 L=32768 (-): error: OutOfMemoryError"),
    (oom_outside_pressure, "sweep: full L=32768 (-): out of memory outside a pressure cell"),
    (ok_without_its_record, "sweep: full L=32768 (-): ok with 0 of its 1 samples recorded"),
    (no_run_folder, "pressure: no run folder"),
    (load_loses_a_request, "load: full L=32768 (-): a load cell that does not account for every request"),
    (a_self_check_failed, "check: memory.oom: 131072 tokens ran under a cap of 17.00 GiB: no out-of-memory"),
    (self_check_ran_out_of_time, "check: kvbench check ran out of its time budget (exit 124)"),
    (pynvml_missing, "facts: importing torch, transformers and nvidia-ml-py exited 1"),
    (a_step_that_recompiles_and_waits, "decode: h2o at 32768: 2 host syncs"),
]


@pytest.mark.parametrize(("breakage", "problem"), BREAKAGES, ids=[breakage.__name__ for breakage, _ in BREAKAGES])
def test_each_way_a_gpu_run_goes_wrong_fails_the_check(tmp_path, capsys, breakage, problem):
    breakage(tmp_path, clean_run(tmp_path))
    assert check.main([str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    problems = [line.removeprefix("problem: ") for line in printed.splitlines() if line.startswith("problem: ")]
    assert any(line.startswith(problem) for line in problems), problems
    assert "GPU check FAILED" in printed


def test_another_transformers_is_a_warning_not_a_failure(tmp_path, capsys):
    cells = clean_run(tmp_path)
    rewrite(tmp_path, "sweep", run_cells(cells, "s-"), transformers="5.24.0")
    assert check.main([str(tmp_path)]) == 0
    assert "warning: sweep: transformers 5.24.0, not the GPU machines' 5.17.x" in capsys.readouterr().out


def test_a_speed_short_of_its_target_is_a_warning_not_a_failure(tmp_path, capsys):
    cells = clean_run(tmp_path)
    sweep = run_cells(cells, "s-")
    sweep["s-h2o"] = (sweep["s-h2o"][0], "ok", [{**record("s-h2o"), "prefill_tok_s": 4500.0}])
    rewrite(tmp_path, "sweep", sweep)
    assert check.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "against the targets: prefill snapkv at 32768: 1.00x full's tokens/s (target at least 0.9x): met" in printed
    assert "against the targets: decode full at 32768, compiled: 7.5 ms, 1.25x its floor (target at most 1.3x): met" \
        in printed
    assert "warning: speed: prefill h2o at 32768: 0.50x full's tokens/s, short of its target 0.6x" in printed


def test_the_shipped_configs_cover_llama_3_8b_at_32k_and_a_level_that_must_run_out_of_memory():
    sweep = expand(load_config(ROOT / "benchmarks" / "gpu" / "sweep.yaml"))
    assert {c.description["policy"]["name"] for c in sweep} == {"full", "window", "h2o", "snapkv"}
    assert all(c.description["model"] == {"id": "random:llama-3-8b", "dtype": "bfloat16"} for c in sweep)
    assert all(c.description["context_length"] == 32768 for c in sweep)
    assert all(c.description["timing"] == {"warmup": 1, "repeats": 1} for c in sweep)
    pressure = expand(load_config(ROOT / "benchmarks" / "gpu" / "pressure.yaml"))
    weights = model_shape("llama-3-8b").parameters * 2
    h200 = 139 * GiB  # what the GPU machine reports, about
    caps = sorted({check.memory_cap(c.description["memory"], h200) for c in pressure})
    assert caps[0] < weights < caps[-1]  # one level check.py must see out of memory, one with room for it all


def test_the_script_runs_every_step_check_py_judges_within_10_minutes():
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    budgets = dict(re.findall(r"^\s*step (\w+) (\d+) ", script, flags=re.M))
    assert set(budgets) == {check.FACTS_STEP, *check.RUNS, check.SELF_CHECK, check.DECODE_STEP}
    # + the estimate and check.py; the machine's start takes some of its 15 minutes
    assert sum(int(seconds) for seconds in budgets.values()) + 30 <= 10 * 60
    assert 'benchmarks/gpu/check.py "$out"' in script and 'tee "$out/check.log"' in script
