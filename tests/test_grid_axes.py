"""`models:` and `dtypes:` as grid axes: cells, one load per model, records, summary, figures, recommend, resume."""

from __future__ import annotations

import json
import signal
import sys
import weakref
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from kvbench.analysis.summary import summarize
from kvbench.cli import app
from kvbench.config.cells import expand
from kvbench.config.schema import load_config
from kvbench.runs.run_folder import RunFolder
from tests.helpers import assert_rejected_in_one_line

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
LLAMA, QWEN = "random:tiny-llama", "random:tiny-qwen2"
GRID = {
    "name": "axes",
    "models": [{"id": LLAMA, "device": "cpu"}, {"id": QWEN, "device": "cpu"}],
    "dtypes": ["float32", "bfloat16"],
    "policies": ["full", "window"],
    "budgets": [32],
    "context_lengths": [300],
    "tasks": [{"name": "niah", "depths": [0.5]}],
    "samples": 1,
    "max_new_tokens": 3,
}
SINGLE = {**{k: v for k, v in GRID.items() if k not in ("models", "dtypes")},
          "model": {"id": LLAMA, "dtype": "float32", "device": "cpu"}}
VARIANTS = {(LLAMA, "float32"), (LLAMA, "bfloat16"), (QWEN, "float32"), (QWEN, "bfloat16")}


def write_config(folder: Path, config: dict | str, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    return path


def cells_of(folder: Path, config: dict, name: str = "sweep.yaml"):
    return expand(load_config(write_config(folder, config, name)))


def sweep(config: Path, output: Path, *extra: str, code: int = 0):
    result = runner.invoke(app, ["sweep", str(config), "-o", str(output), "-q", *extra])
    assert result.exit_code == code, result.output
    return result


@pytest.fixture
def loads(monkeypatch) -> list[tuple[str, str]]:
    """Every model load of a sweep, as (spec, dtype); each load first checks that no model loaded before it is
    still alive (the sweep holds one model at a time)."""
    import kvbench.runs.sweep

    real, seen, alive = kvbench.runs.sweep.load_model, [], []

    def load_model(spec, dtype="auto", **kwargs):
        assert all(ref() is None for ref in alive), "a model was still in memory when the next one loaded"
        seen.append((spec, dtype))
        lm = real(spec, dtype=dtype, **kwargs)
        alive.append(weakref.ref(lm.model))
        return lm

    monkeypatch.setattr(kvbench.runs.sweep, "load_model", load_model)
    return seen


@pytest.fixture(autouse=True)
def close_figures():
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


def test_a_single_model_keeps_the_cell_ids_and_hash_of_its_baseline(tmp_path):
    gate = load_config(ROOT / "configs" / "gate.yaml")
    baseline = json.loads((ROOT / "baselines" / "gate.json").read_text())
    assert gate.result_hash() == baseline["config_hash"]
    assert {cell.id for cell in expand(gate)} == set(baseline["cells"])
    # the same model spelled as a one-item `models:` or with `dtypes:` is the same cell
    one = {cell.id for cell in cells_of(tmp_path, SINGLE)}
    listed = {k: v for k, v in SINGLE.items() if k != "model"}
    assert {cell.id for cell in cells_of(tmp_path, {**listed, "models": [LLAMA], "dtypes": ["float32"]})} == one
    assert {cell.id for cell in cells_of(tmp_path, {**listed, "models": [{"id": LLAMA, "dtype": "float32"}]})} == one


def test_models_and_dtypes_cross_into_cells_with_distinct_ids(tmp_path):
    cells = cells_of(tmp_path, GRID)
    assert len(cells) == len({cell.id for cell in cells}) == 4 * 2
    assert {cell.model for cell in cells} == VARIANTS
    assert [cell.model for cell in cells][::2] == [(LLAMA, "float32"), (LLAMA, "bfloat16"), (QWEN, "float32"),
                                                   (QWEN, "bfloat16")]  # config order: models, then dtypes
    assert len({cell.group for cell in cells}) == 4  # a model's samples are its own: no prompt shared across models
    twice = {**GRID, "models": [LLAMA, QWEN, LLAMA], "dtypes": ["float32", "bfloat16", "float32"]}
    assert {cell.id for cell in cells_of(tmp_path, twice)} == {cell.id for cell in cells}  # listed twice: once
    assert load_config(write_config(tmp_path, GRID)).result_hash() != \
        load_config(write_config(tmp_path, {**GRID, "dtypes": ["float32"]})).result_hash()


def test_a_two_model_two_dtype_sweep_loads_each_once_and_every_output_carries_them(tmp_path, loads):
    config, run = write_config(tmp_path, GRID), tmp_path / "run"
    sweep(config, run)
    assert sorted(loads) == sorted(VARIANTS)  # each (model, dtype) loaded once, one at a time
    records = pd.read_json(run / "records.jsonl", lines=True)
    assert records.groupby(["model", "dtype"]).size().to_dict() == {variant: 2 for variant in VARIANTS}
    # the dtype took effect: a bfloat16 cache holds half the bytes of a float32 one
    full = records[records["policy"].map(lambda p: p["name"]) == "full"].set_index(["model", "dtype"])
    assert full.loc[(LLAMA, "bfloat16"), "kv_bytes_peak"] * 2 == full.loc[(LLAMA, "float32"), "kv_bytes_peak"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert {(m["spec"], m["dtype"]) for m in manifest["models"]} == VARIANTS and "model" not in manifest

    summary = pd.read_csv(run / "summary.csv")
    assert len(summary) == 8 and summary.groupby(["model", "dtype"])["policy"].apply(set).to_dict() == \
        {variant: {"full", "window"} for variant in VARIANTS}
    assert summary["delta_vs_full"].notna().sum() == 4  # each window cell paired with its own model's full
    text = (run / "summary.md").read_text()
    assert f"models `{LLAMA} (bfloat16)`, `{LLAMA} (float32)`, `{QWEN} (bfloat16)`" in text
    for model, dtype in VARIANTS:
        assert f"## {model} ({dtype}): niah, 300 tokens, question aware, prefill full" in text

    recommend = runner.invoke(app, ["recommend", str(run), "--max-drop", "100"])
    assert recommend.exit_code == 0, recommend.output
    titles = [line.strip() for line in recommend.output.splitlines() if "smallest cache within" in line]
    assert titles == [f"{model} ({dtype}): smallest cache within 100 points of full (95% CI low end)"
                      for model, dtype in sorted(VARIANTS)]  # a table per model and dtype
    assert recommend.output.count("│ niah │") == 4 and recommend.output.count("window") == 4
    printed = runner.invoke(app, ["sweep", str(config), "-o", str(run)])  # all done: the tables, per model
    assert printed.exit_code == 0 and printed.output.count("axes, random:tiny-") == 4, printed.output

    pytest.importorskip("matplotlib")
    from kvbench.analysis.plot import figures, plot_run

    drawn = figures(run)
    for model, dtype in VARIANTS:
        facet = f"{model} ({dtype})"
        assert {f"score_vs_ratio_niah {facet}", f"pareto {facet}"} <= set(drawn)
        assert drawn[f"pareto {facet}"].get_suptitle() == facet
    assert "score_vs_ratio_niah" not in drawn
    written = {path.name for path in plot_run(run)}
    assert "score_vs_ratio_niah_random_tiny-qwen2_bfloat16.png" in written


@pytest.mark.parametrize("config", [SINGLE, {**{k: v for k, v in SINGLE.items() if k != "model"},
                                             "models": [{"id": LLAMA, "device": "cpu"}], "dtypes": ["float32"]}])
def test_single_model_outputs_are_unchanged(tmp_path, loads, config):
    run = tmp_path / "run"
    sweep(write_config(tmp_path, config), run)
    assert loads == [(LLAMA, "float32")]
    text = (run / "summary.md").read_text()
    assert f"model `{LLAMA}` on" in text and "## niah, 300 tokens, question aware, prefill full" in text
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["model"]["spec"] == LLAMA and manifest["models"] == [manifest["model"]]
    recommend = runner.invoke(app, ["recommend", str(run)])
    assert recommend.exit_code == 0 and recommend.output.count("smallest cache within 2 points of full (95% CI "
                                                               "low end)") == 1, recommend.output
    assert "random:" not in recommend.output.split("\n")[0]
    pytest.importorskip("matplotlib")
    from kvbench.analysis.plot import figures

    assert "score_vs_ratio_niah" in figures(run)


def test_an_interrupted_sweep_resumes_without_reloading_a_finished_model(tmp_path, loads, monkeypatch):
    import kvbench.runs.sweep

    real, calls = kvbench.runs.sweep.evaluate, []

    def evaluate(lm, *args, **kwargs):
        calls.append(lm.spec)
        if len(calls) == 3:  # Ctrl-C during the third sample: the second model's first cell
            signal.raise_signal(signal.SIGINT)
        return real(lm, *args, **kwargs)

    monkeypatch.setattr(kvbench.runs.sweep, "evaluate", evaluate)
    config, run = write_config(tmp_path, GRID), tmp_path / "run"
    stopped = sweep(config, run, code=130)
    assert "run the same command again to resume" in stopped.output
    assert len(RunFolder(run).records()) == 3 and loads == [(LLAMA, "float32"), (LLAMA, "bfloat16")]
    loads.clear()
    sweep(config, run)
    assert loads == [(LLAMA, "bfloat16"), (QWEN, "float32"), (QWEN, "bfloat16")]  # the finished model: not loaded
    assert len(calls) == 8  # 3 before the interrupt, each of the other 5 once after it
    records = RunFolder(run).records()
    assert len({(r["cell_id"], r["sample_id"]) for r in records}) == len(records) == 8
    assert {cell.id for cell in cells_of(tmp_path, GRID, "again.yaml")} == set(RunFolder(run).cells())
    manifest = json.loads((run / "manifest.json").read_text())
    assert {(m["spec"], m["dtype"]) for m in manifest["models"]} == VARIANTS  # the first run's model kept
    loads.clear()
    sweep(config, run)
    assert loads == []  # all done: nothing loads


def test_shards_of_a_model_grid_merge_with_every_model_described(tmp_path, loads):
    config = write_config(tmp_path, GRID)
    for index in range(2):
        sweep(config, tmp_path / f"s{index}", "--shard", f"{index}/2")
        assert len(loads) == len(set(loads))  # within a shard, each model once
        loads.clear()
    merged = runner.invoke(app, ["merge", str(tmp_path / "merged"), str(tmp_path / "s0"), str(tmp_path / "s1")])
    assert merged.exit_code == 0, merged.output
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert {(m["spec"], m["dtype"]) for m in manifest["models"]} == VARIANTS
    assert len(summarize(tmp_path / "merged", write=False)) == 8


def test_a_model_that_fails_to_load_fails_its_cells_and_the_others_run(tmp_path):
    config = write_config(tmp_path, {**GRID, "models": [{"id": LLAMA, "device": "cpu"}, "random:no-such-shape"],
                                     "dtypes": ["float32"]})
    result = sweep(config, tmp_path / "run", code=1)
    assert "sweep failed: 2 error, 2 ok" in result.output
    statuses = RunFolder(tmp_path / "run").cells().values()
    assert {s["status"] for s in statuses if s["cell"]["model"]["id"] == LLAMA} == {"ok"}
    assert all("unknown random model shape 'no-such-shape'" in s["message"] for s in statuses if s["status"] != "ok")
    # the first model to run loads before the run folder is written: a bad one there is a plain input error
    first_bad = write_config(tmp_path, {**GRID, "models": ["random:no-such-shape", LLAMA]}, "first.yaml")
    result = sweep(first_bad, tmp_path / "never", code=2)
    assert "unknown random model shape" in result.output and not (tmp_path / "never").exists()


def test_the_example_config_validates():
    result = runner.invoke(app, ["validate", str(ROOT / "configs" / "robustness.yaml")])
    assert result.exit_code == 0 and "52 cells" in result.output, result.output


def test_dry_run_and_set_overrides_on_a_model_grid(tmp_path):
    config = write_config(tmp_path, {**GRID, "models": [LLAMA, QWEN]})
    result = runner.invoke(app, ["sweep", str(config), "-o", str(tmp_path / "r"), "--dry-run"])
    assert result.exit_code == 0 and "8 cells, 4 sample groups" in result.output, result.output
    assert "estimated time ~" in result.output
    loaded = load_config(config, ["models.1.device=cpu", "dtypes=[bfloat16]"])
    assert [(m.id, m.dtype, m.device) for m in loaded.model_grid()] == [(LLAMA, "bfloat16", "auto"),
                                                                         (QWEN, "bfloat16", "cpu")]


HEAD = "name: x\npolicies: [full]\nbudgets: [8]\ncontext_lengths: [9]\ntasks: [niah]\n"
BAD = [
    (HEAD + "models: [m]\ndtypes: [float32, float64]\n", ":7: dtypes: unknown dtype 'float64' (use auto, float32"),
    (HEAD + "dtypes: half\n", ":6: dtypes: Input should be a valid list"),
    (HEAD + "dtypes: []\n", ":6: dtypes: List should have at least 1 item"),
    (HEAD + "model: {id: m, dtype: fp8}\n", ":6: model.dtype: unknown dtype 'fp8'"),
    (HEAD + "models: []\n", ":6: models: List should have at least 1 item"),
    (HEAD + "models: m\n", ":6: models: Input should be a valid list"),
    (HEAD + "models: [m, {id: n, dtyp: float32}]\n", ":6: models[1].dtyp: unknown key 'dtyp'"),
    (HEAD + "model: m\nmodels: [m, n]\n", ":7: models: give 'model' or 'models', not both"),
    (HEAD + "models: [m, {id: n, dtype: float32}]\ndtypes: [bfloat16]\n",
     ":6: models[1].dtype: dtype 'float32' conflicts with 'dtypes' (which crosses every model)"),
    (HEAD + "model: {id: m, dtype: float32}\ndtypes: [bfloat16]\n", ":6: model.dtype: dtype 'float32' conflicts"),
]


@pytest.mark.parametrize("text,culprit", BAD)
def test_bad_models_and_dtypes_are_one_line_errors_with_exit_2(tmp_path, text, culprit):
    path = write_config(tmp_path, text, "bad.yaml")
    assert_rejected_in_one_line(path, culprit, tmp_path / "run")
