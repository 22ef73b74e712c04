"""`kvbench sweep --executor ray` on a local Ray cluster: the same records as a local sweep, a resume after the driver
is killed, a dead worker's unit run again (and failed after three deaths), and the bad options."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.analysis.summary import summarize
from kvbench.cli import app
from kvbench.config.cells import expand
from kvbench.config.schema import load_config
from kvbench.engine.estimate import wall_seconds
from kvbench.runs.run_folder import RunFolder
from kvbench.runs.work import token_work, work_units
from tests.test_sweep import ROOT, STABLE, records_by_key, write_config

ray = pytest.importorskip("ray")
runner = CliRunner()
CONFIG = {
    "name": "tiny-ray",
    "model": {"id": "random:tiny-llama", "dtype": "float32", "device": "cpu"},
    "policies": ["full", "window", {"name": "h2o", "recent_ratio": 0.5}, {"name": "snapkv", "window": 8}],
    "budgets": [32],
    "context_lengths": [250, 300],
    "tasks": [{"name": "niah", "depths": [0.5]}],
    "samples": 2,
    "max_new_tokens": 3,
}
CELLS, SAMPLES = 8, 2  # 4 policies x 2 context lengths, each sharing one prompt forward per sample
# what a record holds that does not depend on timing
RESULT = ("prediction", "scores", "kv_bytes_live", "kv_bytes_physical", "kv_bytes_peak", "kv_bytes_full",
          "kept_max_ever", "evictions", "generated_tokens", "prefill_shared", "dtype")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One local cluster for the module; its two GPUs are declared, not real (torch sees none), so the workers are
    scheduled one per GPU as on a GPU machine and run on the CPU. The address is for a driver in another process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_worker_niceness", "0")  # Ray's 15 would starve the workers on a machine shared with others
        ray.init(num_cpus=2, num_gpus=2, log_to_driver=False, logging_level=logging.WARNING)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[Path, Path]:
    """The config and a local sweep of it, to compare every Ray sweep against."""
    folder = tmp_path_factory.mktemp("local")
    config = write_config(folder, CONFIG)
    result = runner.invoke(app, ["sweep", str(config), "-o", str(folder / "run"), "-q"])
    assert result.exit_code == 0, result.output
    return config, folder / "run"


def ray_sweep(config: Path, output: Path, *extra: str, exit_code: int = 0):
    result = runner.invoke(app, ["sweep", str(config), "-o", str(output), "-q", "--executor", "ray", *extra])
    assert result.exit_code == exit_code, result.output
    return result


def assert_same_results(run: Path, local: Path) -> None:
    """Record for record (every field but timings and memory), and the summary's score and byte columns."""
    on_ray, here = records_by_key(run), records_by_key(local)
    assert on_ray.keys() == here.keys() and len(on_ray) == CELLS * SAMPLES
    for key, record in on_ray.items():
        for field in RESULT:
            assert record[field] == here[key][field], (key, field)
    columns = lambda folder: summarize(folder, write=False)[STABLE].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(columns(run), columns(local))


def test_a_ray_sweep_records_what_a_local_sweep_records(cluster, local_run, tmp_path):
    config, local = local_run
    result = ray_sweep(config, tmp_path / "run", "--workers", "2", "--trace", "--verbose")
    assert_same_results(tmp_path / "run", local)
    assert {s["status"] for s in RunFolder(tmp_path / "run").cells().values()} == {"ok"}
    assert len(list((tmp_path / "run" / "traces").glob("*.jsonl"))) == CELLS  # written by the driver too
    executor = json.loads((tmp_path / "run" / "manifest.json").read_text())["executor"]
    assert executor["name"] == "ray" and executor["workers"] == 2 and executor["gpus_per_worker"] == 1
    assert executor["gpus"] == 2 and executor["nodes"][0]["gpus"] == 2 and executor["nodes"][0]["cpus"] == 2
    # a line per unit as a worker takes it and as it comes back, naming the worker's GPU
    assert "GPU " in result.output and result.output.count(" done in ") == 2, result.output
    assert json.loads((local / "manifest.json").read_text())["executor"] == {"name": "local"}


def test_a_killed_driver_resumes_to_the_local_result(cluster, local_run, tmp_path):
    config, local = local_run
    run = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "sweep", str(config), "-o", str(run), "-q",
                               "--executor", "ray", "--address", cluster, "--workers", "1"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    records, deadline = run / "records.jsonl", time.time() + 300  # generous: a loaded machine starts slowly
    while time.time() < deadline and not (records.exists() and records.read_text().count("\n")):
        time.sleep(0.005)
    os.killpg(driver.pid, signal.SIGKILL)  # as the first unit's records are being written
    driver.wait()
    killed_at = records.read_text().count("\n")
    assert 0 < killed_at < CELLS * SAMPLES, "the kill should land mid-sweep"
    with records.open("a") as handle:  # what a kill during a write leaves behind
        handle.write('{"cell_id": "abc", "sample_')
    ray_sweep(config, run, "--workers", "2", "--gpus-per-worker", "0")  # the rerun on CPU workers
    assert_same_results(run, local)
    executor = json.loads((run / "manifest.json").read_text())["executor"]
    assert executor["gpus_per_worker"] == 0 and executor["cpus_per_worker"] == 1


PLUGIN = '''
import os
import signal
import time
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path

import torch
from kvbench.policies import Policy, register

MARKER = Path({marker!r})


@register
@dataclass
class Stalls(Policy):
    """A window that, the first time it runs, tells its process id and waits to be killed."""
    name = "stalls"
    def score(self, layer, budget):
        if not MARKER.exists():
            MARKER.write_text(str(os.getpid()))
            time.sleep(60)
        return layer.live_positions().float()


@register
@dataclass
class Kills(Policy):
    """Kills the process running it, every time."""
    name = "kills"
    def score(self, layer, budget):
        os.kill(os.getpid(), signal.SIGKILL)


@register
@dataclass
class RunsOut(Policy):
    """Runs out of device memory (a name of its own: another test's plugin registers `oom` in this process)."""
    name = "runs_out"
    def score(self, layer, budget):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
'''


def test_a_dead_workers_unit_runs_again_until_the_third_death(cluster, tmp_path):
    plugins, marker = tmp_path / "plugins", tmp_path / "stalling-pid"
    plugins.mkdir()
    (plugins / "dying.py").write_text(textwrap.dedent(PLUGIN.format(marker=str(marker))))
    config = write_config(tmp_path, {**CONFIG, "policies": ["stalls", "kills", "runs_out"],
                                     "context_lengths": [250], "samples": 1})

    killed = []

    def kill_the_stalling_worker() -> None:  # from outside, mid-unit, by the process id the worker told
        deadline = time.time() + 300
        while time.time() < deadline and not (marker.exists() and marker.read_text()):
            time.sleep(0.01)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        killed.append(int(marker.read_text()))

    killer = threading.Thread(target=kill_the_stalling_worker, daemon=True)
    killer.start()
    # one cell per unit, so the units that die take no other cell with them; a third worker (each on 2/3 of a core)
    # takes a unit again while the one that died is replaced
    result = ray_sweep(config, tmp_path / "run", "--workers", "3", "--gpus-per-worker", "0", "--no-share",
                       "--plugins", str(plugins), exit_code=1)
    killer.join()
    assert killed, "the stalling worker was not killed"
    statuses = {s["cell"]["policy"]["name"]: s for s in RunFolder(tmp_path / "run").cells().values()}
    assert statuses["stalls"]["status"] == "ok"
    assert statuses["kills"]["status"] == "error" and "died 3 times" in statuses["kills"]["message"]
    assert statuses["runs_out"]["status"] == "oom" and "Tried to allocate 2.00 GiB" in statuses["runs_out"]["message"]
    assert [r["cell"]["policy"]["name"] for r in RunFolder(tmp_path / "run").records()] == ["stalls"]
    assert result.output.count("died running") == 3 and "sweep failed: 1 error, 1 ok, 1 oom" in result.output


@pytest.mark.parametrize("options,culprit", [
    (["--executor", "nope"], "--executor 'nope': choose local or ray"),
    (["--address", "auto"], "--address is an option of --executor ray"),
    (["--workers", "2"], "--workers is an option of --executor ray"),
    (["--gpus-per-worker", "0"], "--gpus-per-worker is an option of --executor ray"),
    (["--executor", "ray", "--workers", "0"], "--workers"),
    (["--executor", "ray", "--gpus-per-worker", "-1"], "--gpus-per-worker"),
])
def test_bad_executor_options_are_one_line_errors(tmp_path, options, culprit):
    result = runner.invoke(app, ["sweep", str(write_config(tmp_path, CONFIG)), "-o", str(tmp_path / "run"), *options])
    assert result.exit_code == 2 and culprit in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_more_gpus_per_worker_than_the_cluster_has(cluster, tmp_path):
    result = runner.invoke(app, ["sweep", str(write_config(tmp_path, CONFIG)), "-o", str(tmp_path / "run"),
                                 "--executor", "ray", "--gpus-per-worker", "3"])
    assert result.exit_code == 2 and "--gpus-per-worker 3: the Ray cluster has 2 GPUs" in result.output
    assert not (tmp_path / "run").exists()


def test_without_ray_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    result = runner.invoke(app, ["sweep", str(write_config(tmp_path, CONFIG)), "--executor", "ray"])
    assert result.exit_code == 2 and "--executor ray needs Ray: pip install 'kvbench[ray]'" in result.output


def test_units_run_longest_first_and_the_dry_run_estimates_the_wall_time(tmp_path):
    config = write_config(tmp_path, {**CONFIG, "context_lengths": [250, 600, 300]})
    units = work_units(expand(load_config(config)), share=True)
    assert [unit[0].description["context_length"] for unit in units] == [600, 300, 250]
    assert [len(unit) for unit in units] == [4, 4, 4] and token_work(units[0], True) > token_work(units[1], True)
    assert len(work_units(expand(load_config(config)), share=False)) == 12  # --no-share: a cell each
    assert wall_seconds([5, 4, 3, 2], workers=2) == 7 and wall_seconds([5, 4, 3], workers=1) == 12
    minutes = {}
    for workers in ("1", "2"):  # minutes of work: the embedded model's size, at longer contexts
        result = runner.invoke(app, ["sweep", str(config), "-o", str(tmp_path / "r"), "--dry-run", "--executor", "ray",
                                     "--workers", workers, "--set", "model.id=smollm2-135m", "--set", "samples=10",
                                     "--set", "context_lengths=[2000,6000,3000]"])
        output = " ".join(result.output.split())
        assert result.exit_code == 0 and f"on {workers} Ray workers" in output, output
        minutes[workers] = float(output.split("estimated time ~")[1].split(" min")[0])
    assert 0 < minutes["2"] < minutes["1"]
