from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from kvbench import __version__
from kvbench.cli import app

runner = CliRunner()
TINY = ["run", "-m", "random:tiny-llama", "-c", "300", "--max-new-tokens", "3"]


def test_version_and_help():
    assert __version__ in runner.invoke(app, ["--version"]).output
    result = runner.invoke(app, ["run", "--help"])
    assert result.exit_code == 0 and "--prefill" in result.output


def test_policies_lists_every_policy_with_phase_and_params():
    result = runner.invoke(app, ["policies"])
    assert result.exit_code == 0
    for name in ("full", "window", "streaming_llm", "h2o", "snapkv", "random", "recent_ratio", "decode",
                 "merge", "compression", "eviction"):
        assert name in result.output


def test_listings_as_json_and_as_plain_rows_when_piped():
    policies = json.loads(runner.invoke(app, ["policies", "--json"]).output)
    snapkv = next(entry for entry in policies if entry["name"] == "snapkv")
    assert snapkv["parameters"] == {"window": 32, "kernel": 7, "pooling": "max"} and snapkv["schedule"] == "prefill"
    tasks = json.loads(runner.invoke(app, ["tasks", "--json"]).output)
    assert "niah" in {entry["name"] for entry in tasks}
    plain = runner.invoke(app, ["policies"]).output.splitlines()  # the test runner's output is no terminal
    assert plain[0].split("\t")[:2] == ["name", "family"]
    assert any(line.startswith("expected_attention\teviction\t") for line in plain), "a long name is cut"


def bracketed(text: str) -> list[str]:
    import re

    return re.findall(r"\[[^\]]*\]", text or "")


def test_every_help_keeps_its_brackets():
    """Help texts are plain text: `pip install -e '.[ray]'` or `[fidelity]` must not be read as markup."""
    import typer.main

    group = typer.main.get_command(app)
    checked = 0
    for name, command in group.commands.items():
        shown = " ".join(runner.invoke(app, [name, "--help"]).output.split())
        texts = [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]
        for text in texts:
            for part in bracketed(text):
                assert " ".join(part.split()) in shown, f"kvbench {name} --help lost {part}"
                checked += 1
    assert checked >= 3


def test_run_json_records():
    result = runner.invoke(app, [*TINY, "-p", "full", "-p", "h2o", "-b", "64", "-b", "0.5", "--depth", "0.5",
                                 "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["policy"]["name"], r["budget"]) for r in records] == [("full", None), ("h2o", 64), ("h2o", 0.5)]
    for record in records:
        for field in ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s", "kv_bytes_live", "kv_bytes_physical",
                      "kv_bytes_peak", "kv_bytes_full", "cache_ratio", "mem_peak_alloc", "evictions", "prediction",
                      "references", "scores", "sample_id", "question", "prefill"):
            assert field in record
    assert records[1]["budget_tokens"] == 64 and records[2]["budget_tokens"] == 150


def test_run_table():
    result = runner.invoke(app, [*TINY, "-p", "window", "-b", "64", "--prefill", "chunked", "--prefill-chunk", "64",
                                 "--question", "agnostic"])
    assert result.exit_code == 0, result.output
    assert "window" in result.output and "cache ratio" in result.output


@pytest.mark.parametrize("args,culprit", [
    (["-p", "windo"], "unknown policy 'windo'"),
    (["-p", "h2o", "--param", "window=3"], "parameter 'window'"),
    (["-p", "snapkv", "--param", "pooling=mean"], "pooling"),
    (["-p", "window", "-b", "lots"], "budget 'lots'"),
    (["-p", "window", "-b", "-5"], "budget"),
    (["-p", "snapkv", "-b", "16"], "observation window"),
    (["-m", "./no/such/model"], "model path not found"),
    (["-m", "random:huge"], "unknown random model shape 'huge'"),
    (["--task-param", "corpus=/no/such/file.txt"], "corpus not found"),
    (["--prefill", "sideways"], "prefill mode"),
    (["-t", "niah2"], "unknown task"),
    (["--device", "tpu"], "device"),
])
def test_bad_input_is_one_line_naming_the_culprit_exit_2(args, culprit):
    result = runner.invoke(app, [*TINY, *args])
    assert result.exit_code == 2, result.output
    assert culprit in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_plugin_policy_from_a_folder(tmp_path):
    (tmp_path / "oldest.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from kvbench.policies import Policy, register

        @register
        @dataclass
        class KeepOldest(Policy):
            """Keeps the oldest entries (a plugin example)."""
            name = "keep_oldest"

            def score(self, layer, budget):
                return -layer.live_positions().float()
    '''))
    listed = runner.invoke(app, ["policies", "--plugins", str(tmp_path)])
    assert "keep_oldest" in listed.output
    result = runner.invoke(app, [*TINY, "--plugins", str(tmp_path), "-p", "keep_oldest", "-b", "32", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0])["kv_bytes_live"] > 0


def test_local_model_folder_loads_and_runs(tmp_path):
    from kvbench.engine.models import load_model

    source = load_model("random:tiny-qwen2", dtype="float32", device="cpu")
    source.model.save_pretrained(tmp_path)
    source.tokenizer.save_pretrained(tmp_path)
    result = runner.invoke(app, ["run", "-m", str(tmp_path), "-c", "300", "--max-new-tokens", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0])["model"] == str(tmp_path)


def test_the_prepared_gpu_configs_stay_valid():
    from pathlib import Path

    for name in ("sweep.yaml", "pressure.yaml"):
        path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / name
        result = runner.invoke(app, ["validate", str(path)])
        assert result.exit_code == 0, result.output


def test_error_text_is_printed_as_is(monkeypatch):
    """An error that names an extra (`.[data]`) must not lose it to rich's markup."""
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    result = runner.invoke(app, ["run", "-m", "random:tiny-llama", "-t", "perplexity", "--task-param",
                                 "corpus=hf:nothing-such", "-c", "300"])
    assert result.exit_code == 2 and "pip install -e '.[data]' in the kvbench checkout" in result.output


def test_kvbench_help_lists_every_command_with_a_whole_sentence():
    """`kvbench --help` shows each command's first sentence, cut to fit: each must be short enough to be whole."""
    import typer.main

    listed = " ".join(runner.invoke(app, ["--help"]).output.split())
    group = typer.main.get_command(app)
    fits = 80 - 6 - max(map(len, group.commands))  # Click's room beside the names on an 80-column terminal
    for name, command in group.commands.items():
        short = command.get_short_help_str(fits)
        assert short.endswith(".") and not short.endswith("...") and short in listed, f"kvbench {name}: {short}"


@pytest.mark.parametrize("command", [["policies"], ["tasks"], ["estimate", "llama-3.1-8b", "-b", "0.5"],
                                     [*TINY, "-p", "window", "-b", "64"]])
def test_json_is_stdout_with_json_and_a_file_with_json_out(command, tmp_path):
    """`--json` and `--json-out PATH` mean the same on every command that has a JSON form (check's is in
    tests/test_check.py)."""
    path = tmp_path / "out" / "listing.json"
    printed = runner.invoke(app, [*command, "--json"])
    written = runner.invoke(app, [*command, "--json-out", str(path)])
    assert printed.exit_code == written.exit_code == 0, printed.output + written.output
    assert "{" not in written.stdout.split("\n")[0]  # the human output stays
    lines = path.read_text().splitlines()
    as_json = [json.loads(line) for line in lines] if command[0] == "run" else json.loads(path.read_text())
    shown = [json.loads(line) for line in printed.stdout.splitlines()] if command[0] == "run" else \
        json.loads(printed.stdout)
    if command[0] == "run":  # timings differ between two runs; what ran does not
        as_json, shown = [(r["policy"], r["budget"], r["prediction"]) for r in as_json], \
            [(r["policy"], r["budget"], r["prediction"]) for r in shown]
    assert as_json == shown
