"""Names as users write them: a misspelt config key is named where it was written (a file's line, or the `--set`
that gave it) with the key it probably meant; dtypes by their short names wherever a dtype is taken."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.config.schema import load_config
from kvbench.errors import KvbenchError

runner = CliRunner()
GRID = "name: x\nmodel: {id: random:tiny-llama, dtype: float32}\npolicies: [full]\nbudgets: [64]\ntasks: [niah]\n"


def config(tmp_path, text: str, name: str = "sweep.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_misspelt_key_is_named_at_its_line_with_the_key_it_meant(tmp_path):
    path = config(tmp_path, GRID + "context_length: [512]\n")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert (f"{path}:6: context_length: unknown key 'context_length' (did you mean 'context_lengths'?)"
            in " ".join(result.output.split()))
    assert "missing key" not in result.output
    nested = config(tmp_path, GRID.replace("dtype: float32", "dtyp: float32") + "context_lengths: [512]\n")
    with pytest.raises(KvbenchError, match=r"sweep.yaml:2: model.dtyp: unknown key 'dtyp' \(did you mean 'dtype'\?\)"):
        load_config(nested)
    with pytest.raises(KvbenchError, match=r"unknown key 'inclde' \(did you mean 'include'\?\)"):
        load_config(config(tmp_path, GRID + "context_lengths: [512]\ninclde: base.yaml\n"))


def test_a_set_option_in_error_is_named_not_a_line_of_the_file(tmp_path):
    path = config(tmp_path, GRID + "context_lengths: [512]\n")
    for option, culprit in (("model.dtyp=bfloat16", "model.dtyp: unknown key 'dtyp' (did you mean 'dtype'?)"),
                            ("context_lengths=[-4]", "context_lengths: context lengths must be positive"),
                            ("policies.0=h3o", "policies[0].name: unknown policy 'h3o' (did you mean 'h2o'?)")):
        result = runner.invoke(app, ["validate", str(path), "--set", option])
        assert result.exit_code == 2, result.output
        assert f"error: --set {option}: {culprit}" in " ".join(result.output.split())
        assert "sweep.yaml" not in result.output


def test_short_dtype_names_in_a_config(tmp_path):
    path = config(tmp_path, GRID.replace("dtype: float32", "dtype: bf16") + "context_lengths: [512]\n")
    assert load_config(path).model.dtype == "bfloat16"
    assert load_config(path, ["model.dtype=fp16"]).model.dtype == "float16"
    crossed = config(tmp_path, GRID.replace(", dtype: float32", "") + "context_lengths: [512]\ndtypes: [fp32, bf16]\n",
                     "crossed.yaml")
    assert load_config(crossed).dtypes == ["float32", "bfloat16"]
    # a short name is the same model as its full name: the same cells, the same hash (and baselines)
    assert load_config(path).result_hash() == load_config(path, ["model.dtype=bfloat16"]).result_hash()


@pytest.mark.parametrize("command", [["run"], ["check"], ["capacity", "--context", "64", "--memory-limit", "1GiB"]])
def test_short_dtype_names_on_the_command_line(command, monkeypatch):
    import kvbench.engine.models

    asked = []

    def load_model(spec, dtype="auto", **kwargs):
        asked.append(dtype)
        raise KvbenchError("stop here")

    monkeypatch.setattr(kvbench.engine.models, "load_model", load_model)
    for short, full in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        result = runner.invoke(app, [*command, "-m", "random:tiny-llama", "--dtype", short])
        assert result.exit_code == 2 and "stop here" in result.output, result.output
        assert asked.pop() == full


def test_short_dtype_names_in_an_estimate():
    result = runner.invoke(app, ["estimate", "llama-3.1-8b", "--dtype", "bf16", "--dtype", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    assert [row["dtype"] for row in json.loads(result.stdout)["rows"]] == ["bfloat16", "float32"]
