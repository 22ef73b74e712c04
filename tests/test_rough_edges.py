"""Issue 21's rough edges: one-line usage errors, `estimate` offline and as JSON, percent budgets and the
ratio-like warning, `plugins:` in sweep configs and entry-point plugins."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.config.schema import budget_from_text, load_config
from kvbench.engine.estimate import SHAPES, estimate
from kvbench.errors import KvbenchError

runner = CliRunner()


def assert_one_line_error(result, culprit: str) -> None:
    assert result.exit_code == 2, result.output
    assert culprit in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "╭" not in result.output and "Traceback" not in result.output


# --- usage errors -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,culprit", [
    (["run", "-c", "abc"], "'--context'"),
    (["run", "--samples", "0"], "'--samples'"),
    (["run", "--budget"], "'--budget'"),
    (["capacity", "--pressure", "2"], "'--pressure'"),
    (["estimate"], "Missing argument 'model'"),
    (["sweep"], "Missing argument 'config'"),
    (["gate"], "Missing argument"),
    (["no-such-command"], "'no-such-command'"),
    (["--no-such-option"], "--no-such-option"),
])
def test_usage_errors_are_one_line_exit_2(args, culprit):
    assert_one_line_error(runner.invoke(app, args), culprit)


def test_an_unknown_option_is_one_line_for_every_command():
    commands = typer.main.get_command(app).commands
    for name in sorted(set(commands) - {"lm-eval"}):  # lm-eval hands every option to lm-eval's own parser
        result = runner.invoke(app, [name, "--no-such-option"])
        assert_one_line_error(result, "--no-such-option")
        assert f" {name} --help" in result.output  # the hint names the command


def test_help_without_a_command_is_still_help():
    result = runner.invoke(app, [])
    assert "Usage" in result.output and "error:" not in result.output


# --- estimate ---------------------------------------------------------------------------------------------------

def test_estimate_of_an_unknown_model_offline_is_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    result = runner.invoke(app, ["estimate", "nosuchmodel"])
    assert_one_line_error(result, "model 'nosuchmodel': no local config, and the hub's could not be fetched")


def test_estimate_silences_the_hubs_retries(monkeypatch, caplog):
    """Without a network the hub logs each of its retries before raising; only the one-line error may show."""
    import transformers

    def unreachable_hub(*args, **kwargs):
        for attempt in range(1, 6):
            logging.getLogger("huggingface_hub.utils._http").warning(f"Retrying in {attempt}s [Retry {attempt}/5].")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable_hub)
    with caplog.at_level(logging.WARNING):
        result = runner.invoke(app, ["estimate", "nosuchmodel"])
    assert_one_line_error(result, "We couldn't connect")
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]
    assert logging.getLogger("huggingface_hub").level != logging.ERROR  # restored afterwards


def test_estimate_json_is_one_object_with_the_tables_rows():
    result = runner.invoke(app, ["estimate", "llama-2-70b", "-c", "4096", "-c", "1000", "-b", "25%", "-b", "512",
                                 "--device-memory", "160GiB", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["model"], report["layers"], report["kv_heads"], report["head_dim"]) == ("llama-2-70b", 80, 8, 128)
    assert report["device_memory_bytes"] == 160 * 2**30
    expected = estimate(SHAPES["llama-2-70b"], [4096, 1000], [1], ["bfloat16"], [None, 0.25, 512], 160 * 2**30)
    assert report["rows"] == expected and len(expected) == 6
    assert [r["budget"] for r in report["rows"][:3]] == [None, 0.25, 512]


# --- percent budgets and the ratio-like warning -----------------------------------------------------------------

def test_budget_text():
    assert budget_from_text("25%") == 0.25 and budget_from_text("100%") == 1.0 and budget_from_text("12.5%") == 0.125
    assert budget_from_text("128") == 128 and isinstance(budget_from_text("128"), int)
    assert budget_from_text("0.25") == 0.25
    for bad, reason in (("0%", r"\(0%, 100%\]"), ("150%", r"\(0%, 100%\]"), ("lots", "not a number"),
                        ("%", "not a number"), ("-5", "positive")):
        with pytest.raises(KvbenchError, match=reason):
            budget_from_text(bad)


def write_config(folder: Path, body: str, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


GRID = textwrap.dedent("""
    name: rough
    model: random:tiny-llama
    context_lengths: [256]
    tasks: [niah]
""")


def test_percent_budgets_in_configs_and_overrides(tmp_path):
    config = write_config(tmp_path, GRID + "policies: [full, {name: window, budget: 50%}]\nbudgets: [25%, 64]\n")
    cfg = load_config(config)
    assert cfg.budgets == [0.25, 64] and cfg.policies[1].budgets == [0.5]
    assert load_config(config, ["budgets=[10%]"]).budgets == [0.1]
    same = write_config(tmp_path, GRID + "policies: [full, {name: window, budget: 0.5}]\nbudgets: [0.25, 64]\n",
                        "same.yaml")
    assert load_config(same).result_hash() == cfg.result_hash()  # 25% is 0.25, for baselines too
    with pytest.raises(KvbenchError, match=r"--set budgets=\[150%\]: budgets: budget '150%'"):
        load_config(config, ["budgets=[150%]"])


def test_percent_budget_on_the_command_line():
    result = runner.invoke(app, ["estimate", "llama-2-7b", "-c", "2000", "-b", "25%", "--json"])
    full, quarter = json.loads(result.stdout)["rows"]
    assert quarter["budget"] == 0.25 and quarter["cache_bytes"] == full["cache_bytes"] / 4


def ratio_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not a ratio of the prompt" in r.getMessage()]


def test_a_small_integer_budget_warns(tmp_path, caplog):
    config = write_config(tmp_path, GRID + "policies: [window]\nbudgets: [1, 1.0, 64, 25%]\n")
    with caplog.at_level(logging.WARNING):
        assert load_config(config).budgets == [1, 1.0, 64, 0.25]
    assert ratio_warnings(caplog) == ["warning: budget 1 is 1 token per layer and KV head, not a ratio of the prompt "
                                      "(a ratio is written 0.25 or 25%, the whole prompt 1.0 or 100%)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(KvbenchError, match="unknown key 'budgetz'"):
        load_config(config, ["budgetz=1"])
    assert not ratio_warnings(caplog)  # a config in error ends in its error line alone
    with caplog.at_level(logging.WARNING):
        result = runner.invoke(app, ["estimate", "llama-2-7b", "-b", "8", "-b", "16", "-b", "0.5"])
    assert result.exit_code == 0, result.output
    assert [m.split(" is ")[0] for m in ratio_warnings(caplog)] == ["warning: budget 8"]


def test_the_warning_is_one_line_on_stderr_not_an_error(tmp_path):
    config = write_config(tmp_path, GRID + "policies: [window]\nbudgets: [4]\n")
    done = subprocess.run([sys.executable, "-m", "kvbench.cli", "validate", str(config)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["kvbench: warning: budget 4 is 4 tokens per layer and KV head, not a ratio "
                                        "of the prompt (a ratio is written 0.25 or 25%, the whole prompt 1.0 or 100%)"]
    assert "ok, 1 cells" in done.stdout


# --- plugins: in a sweep config ---------------------------------------------------------------------------------

PLUGIN_POLICY = '''
from dataclasses import dataclass
from kvbench.policies import Policy, register

@register
@dataclass
class {cls}(Policy):
    """Keeps the oldest entries (a plugin example)."""
    name = "{name}"

    def score(self, layer, budget):
        return -layer.live_positions().float()
'''


@pytest.fixture(scope="module")
def plugin_tree(tmp_path_factory) -> Path:
    """A folder holding `plugins/oldest.py`, which registers the policy `config_plugin_oldest`."""
    root = tmp_path_factory.mktemp("configs")
    (root / "plugins").mkdir()
    (root / "plugins" / "oldest.py").write_text(PLUGIN_POLICY.format(cls="ConfigPluginOldest",
                                                                     name="config_plugin_oldest"))
    return root


def test_plugins_in_a_config_are_relative_to_it(plugin_tree, monkeypatch, tmp_path):
    config = write_config(plugin_tree, GRID + "plugins: [plugins]\npolicies: [config_plugin_oldest]\nbudgets: [64]\n")
    monkeypatch.chdir(tmp_path)  # elsewhere: the folder is found from the config file, not the working directory
    result = runner.invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    assert load_config(config).plugins == [str(plugin_tree / "plugins")]


def test_plugins_add_up_over_includes(plugin_tree, tmp_path):
    (tmp_path / "more").mkdir()
    write_config(plugin_tree, GRID + "plugins: [../plugins]\npolicies: [config_plugin_oldest]\nbudgets: [64]\n",
                 "parts/grid.yaml")
    top = write_config(plugin_tree, f"include: parts/grid.yaml\nplugins: [{tmp_path / 'more'}]\n", "top.yaml")
    assert load_config(top).plugins == [str(plugin_tree / "parts" / "../plugins"), str(tmp_path / "more")]


def test_a_missing_plugin_folder_names_the_config_line(tmp_path):
    config = write_config(tmp_path, GRID + "policies: [full]\nbudgets: [64]\nplugins: [nowhere]\n")
    result = runner.invoke(app, ["validate", str(config)])
    assert_one_line_error(result, f"sweep.yaml:8: plugins: plugin folder not found: {tmp_path / 'nowhere'}")



def test_a_plugin_the_contract_refuses_is_named_and_left_unloaded(tmp_path):
    """A plugin class that defines a kind's method without the kind is a one-line error naming the file and the
    kind; nothing of the file stays loaded, so the file fixed loads in the same process."""
    from kvbench.policies import POLICIES
    from kvbench.registry import load_plugins

    plugin = tmp_path / "folding.py"
    plugin.write_text(PLUGIN_POLICY.format(cls="Folding", name="plugin_folding")
                      + "\n    def fold(self, layer, evicted):\n        pass\n")
    with pytest.raises(KvbenchError, match=rf"^plugin {plugin}: policy class Folding defines `fold`, which kvbench "
                                           r"asks only of a Merging \(kvbench.policies.base.Merging\): subclass it$"):
        load_plugins(tmp_path)
    plugin.write_text(PLUGIN_POLICY.format(cls="Folding", name="plugin_folding"))
    assert load_plugins(tmp_path) == [str(plugin)] and POLICIES.get("plugin_folding").__name__ == "Folding"

# --- entry points -----------------------------------------------------------------------------------------------

def test_installed_entry_points_register_policies_and_tasks(tmp_path):
    """A real distribution, built and installed by pip into a folder of its own (not the shared venv), found on
    PYTHONPATH the way an installed package is found in site-packages."""
    source = tmp_path / "src"
    (source / "rough_edges_plugin").mkdir(parents=True)
    (source / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "rough-edges-plugin"
        version = "0.1"

        [project.entry-points."kvbench.policies"]
        entry_point_oldest = "rough_edges_plugin.policy"

        [project.entry-points."kvbench.tasks"]
        entry_point_task = "rough_edges_plugin.task"
    '''))
    (source / "rough_edges_plugin" / "__init__.py").write_text("")
    (source / "rough_edges_plugin" / "policy.py").write_text(PLUGIN_POLICY.format(cls="EntryPointOldest",
                                                                                 name="entry_point_oldest"))
    (source / "rough_edges_plugin" / "task.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from kvbench.tasks import register
        from kvbench.tasks.niah import NeedleInAHaystack

        @register
        @dataclass
        class EntryPointTask(NeedleInAHaystack):
            """A needle task under another name (a plugin example)."""
            name = "entry_point_task"
    '''))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(source)], check=True, capture_output=True, timeout=120)
    listed = subprocess.run(
        [sys.executable, "-c", "from kvbench.policies import POLICIES; from kvbench.tasks import TASKS; "
         "print(POLICIES.names()); print(TASKS.names())"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(site)})
    assert listed.returncode == 0, listed.stderr
    policies, tasks = listed.stdout.splitlines()
    assert "'entry_point_oldest'" in policies and "'window'" in policies
    assert "'entry_point_task'" in tasks and "'niah'" in tasks


def test_a_broken_entry_point_is_named(monkeypatch):
    import importlib.metadata

    from kvbench.registry import Registry

    broken = importlib.metadata.EntryPoint("broken", "no_such_module_for_kvbench", "kvbench.policies")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken] if group == "kvbench.policies"
                        else [])
    with pytest.raises(KvbenchError, match="policy plugin 'broken' .*no_such_module_for_kvbench.* failed to import: "
                       "ModuleNotFoundError"):
        Registry("policy").names()
