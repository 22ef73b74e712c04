"""`kvbench estimate`: the KV-cache formula, GQA and MHA, budgets, and the built-in shapes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.engine.estimate import SHAPES, SPEEDS, estimate, estimate_seconds, model_shape, parse_bytes
from kvbench.errors import KvbenchError

runner = CliRunner()


def test_the_formula_for_gqa_and_mha():
    # Llama-2-70B (GQA, 8 KV heads): 2 x 80 layers x 8 x 128 x 4096 tokens x 2 bytes
    (row,) = estimate(SHAPES["llama-2-70b"], [4096], [1], ["bfloat16"], [None])
    assert row["bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680
    assert row["cache_bytes"] == row["full_cache_bytes"] == 1_342_177_280
    # Llama-2-7B (MHA, 32 KV heads), batch 8, float32, and two budgets
    full, ratio, tokens, roomy = estimate(SHAPES["llama-2-7b"], [2000], [8], ["float32"], [None, 0.25, 512, 9000])
    assert full["cache_bytes"] == 2 * 32 * 32 * 128 * 2000 * 8 * 4
    assert ratio["cache_bytes"] == 2 * 32 * 32 * 128 * 500 * 8 * 4
    assert tokens["cache_bytes"] == 2 * 32 * 32 * 128 * 512 * 8 * 4
    assert roomy["cache_bytes"] == full["cache_bytes"]  # a budget above the context keeps everything
    qwen = estimate(SHAPES["qwen2.5-7b"], [32768], [1], ["float16"], [None])[0]
    assert qwen["cache_bytes"] == 2 * 28 * 4 * 128 * 32768 * 2


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b", "qwen2.5-7b", "mistral-7b-v0.3", "smollm2-135m"])
def test_built_in_shapes_match_the_configs(name):
    assert model_shape(name) == model_shape(f"random:{name}")  # parameters counted on the meta device


def test_device_memory_and_bad_input():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("24 GB") == 24_000_000_000 and parse_bytes("8e9") == 8e9
    rows = estimate(SHAPES["llama-2-70b"], [4096], [1], ["bfloat16"], [None], device_memory=parse_bytes("80GiB"))
    assert rows[0]["fits"] is False and rows[0]["total_bytes"] == 68_976_648_192 * 2 + 1_342_177_280
    with pytest.raises(KvbenchError, match="memory size"):
        parse_bytes("lots")
    with pytest.raises(KvbenchError, match="unknown dtype 'fp7'"):
        estimate(SHAPES["llama-2-7b"], [1], [1], ["fp7"], [None])


def test_cli():
    result = runner.invoke(app, ["estimate", "llama-2-70b", "--context", "4096", "--dtype", "bfloat16",
                                 "--budget", "0.25", "--device-memory", "160GiB"])
    assert result.exit_code == 0, result.output
    assert "320.0 KiB" in result.output and "1.2 GiB" in result.output and "320.0 MiB" in result.output
    small = runner.invoke(app, ["estimate", "llama-2-70b", "--device-memory", "80GiB"])
    assert small.exit_code == 0 and "NO" in small.output and "warning" in small.output
    bad = runner.invoke(app, ["estimate", "llama-2-7b", "--dtype", "fp7"])
    assert bad.exit_code == 2 and "unknown dtype 'fp7'" in bad.output


def test_a_sweeps_time_estimate_is_prompt_flops_plus_decode_steps_bound_by_their_reads(tmp_path):
    """One cell by hand: a 1000-token prompt's FLOPs (the weights' and the causal attention's), then 16 decode
    steps, each reading the bfloat16 weights and the row's cache (an 8B model on a GPU is bound by its reads)."""
    import yaml

    from kvbench.config.cells import expand
    from kvbench.config.schema import load_config
    from kvbench.runs.work import cell_work

    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"name": "e", "model": "random:llama-3-8b", "policies": ["full"],
                                      "budgets": [64], "context_lengths": [1000], "max_new_tokens": 16,
                                      "tasks": [{"name": "niah", "depths": [0.5]}], "samples": 1}))
    (cell,) = expand(load_config(config))
    shape, gpu = SHAPES["llama-3-8b"], SPEEDS["cuda"]
    prompt = (2 * shape.parameters * 1000 + 2 * 32 * 32 * 128 * 1000**2) / gpu.flops
    step = (shape.parameters * 2 + 1000 * shape.bytes_per_token(2)) / gpu.bandwidth
    assert step > 2 * shape.parameters / gpu.flops  # a decode step waits on memory, not on arithmetic
    assert estimate_seconds(cell_work([cell], share=True), shape, 2, gpu) == pytest.approx(prompt + 16 * step)


@pytest.fixture
def offline(monkeypatch):
    """No hub: any config fetch fails as it does without a network."""
    import transformers

    def refuse(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


def test_a_hub_id_naming_a_built_in_shape_is_estimated_offline(offline):
    from kvbench.engine.estimate import offline_shape

    assert model_shape("meta-llama/Llama-3.1-8B-Instruct") == SHAPES["llama-3.1-8b"]
    assert offline_shape("meta-llama/Llama-3.1-8B-Instruct") == SHAPES["llama-3.1-8b"]  # as a dry run sizes it
    result = runner.invoke(app, ["estimate", "meta-llama/Llama-3.1-8B-Instruct", "-c", "1024", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layers"] == 32


def test_mistral_7b_instruct_v0_3_is_its_own_shape_offline(offline):
    """v0.3's vocabulary of 32768 (v0.1 and v0.2: 32000) is its own built-in shape, resolved by the hub id's version;
    another version of the same base falls back to the base's shape."""
    from kvbench.engine.estimate import offline_shape

    assert model_shape("mistralai/Mistral-7B-Instruct-v0.3") == SHAPES["mistral-7b-v0.3"]
    assert offline_shape("mistralai/Mistral-7B-Instruct-v0.3").parameters == 7_248_023_552
    assert model_shape("mistralai/Mistral-7B-Instruct-v0.2") == SHAPES["mistral-7b"]
    result = runner.invoke(app, ["estimate", "mistralai/Mistral-7B-Instruct-v0.3", "-c", "32768", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert (shown["layers"], shown["kv_heads"], shown["head_dim"]) == (32, 8, 128)
    assert shown["rows"][0]["full_cache_bytes"] == 4 * 2**30  # 128 KiB a token in bf16, 32k tokens


def test_a_model_unknown_offline_is_one_line_listing_the_built_in_shapes(offline):
    result = runner.invoke(app, ["estimate", "acme/unheard-of-7b", "-c", "1024"])
    assert result.exit_code == 2, result.output
    assert "acme/unheard-of-7b" in result.output and "llama-3.1-8b" in result.output
    assert len(result.output.strip().splitlines()) == 1
