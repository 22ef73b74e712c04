"""The README and docs/ hold together: every relative link (and its #anchor) resolves, every sweep config they
show validates, and every config in configs/ loads (the policies and tasks it names exist)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvbench.config import load_config
from kvbench.sweep import expand

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text, found, fenced = page.read_text(), set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def prose(page: Path) -> str:
    """The page without its code blocks (a `](x)` inside code is not a link)."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def shown_configs() -> list[tuple[str, str]]:
    """Every YAML block of the README and docs that is a sweep config (it names policies and tasks)."""
    blocks = []
    for page in PAGES:
        for index, block in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S)):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and {"policies", "tasks"} <= set(data):
                blocks.append((f"{page.name}#{index}", block))
    return blocks


@pytest.mark.parametrize(("where", "block"), shown_configs(), ids=[w for w, _ in shown_configs()])
def test_every_config_the_docs_show_validates(where, block, tmp_path):
    path = tmp_path / "shown.yaml"
    path.write_text(block)
    assert expand(load_config(path))


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(config):
    if "../shared/" in config.read_text() and not (ROOT.parent / "shared").is_dir():
        pytest.skip("reads ../shared/data, which is not next to this checkout")
    assert expand(load_config(config))


def test_the_docs_show_at_least_one_config():
    assert shown_configs()


# --- every kvbench command the docs show ------------------------------------------------------------------------
# A command runs here when it is read-only, offline and quick; every other one is parsed (its command, options and
# arguments must exist) and falls under one of these reasons, which the test states.
RUN_HERE = {"policies", "tasks", "--version", "validate", "estimate"}
NOT_RUN = {
    "a run folder a sweep made": {"report", "recommend", "plot", "summarize", "gate", "baseline", "merge"},
    "a real model (or a GPU, the hub, Ray) for minutes or more": {"run", "sweep", "check", "capacity", "lm-eval"},
}


def shown_commands() -> list[tuple[str, str]]:
    """(page, command line) for every `kvbench ...` line of the docs' shell blocks: continuations joined, a prompt's
    `$ ` and a trailing comment dropped."""
    commands = []
    for page in PAGES:
        for body in re.findall(r"```(?:bash|console|sh)\n(.*?)```", page.read_text(), flags=re.S):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if re.match(r"kvbench( |$)", line):
                    commands.append((page.name, re.split(r"\s+#\s", line)[0].strip()))
    return commands


def argv_of(command: str) -> list[str]:
    """The arguments after `kvbench`: a synopsis's optional `[...]` parts dropped, shell variables as a value."""
    import shlex

    command = re.sub(r"\s\[[^\]]*\]", "", command)
    command = re.sub(r"\$\{?\w+\}?", "0", command)
    return shlex.split(command)[1:]


def subcommand(argv: list[str]) -> str:
    return argv[0] if argv else ""


@pytest.mark.parametrize(("page", "command"), shown_commands(), ids=[f"{p}:{c[:60]}" for p, c in shown_commands()])
def test_every_documented_command_parses_or_runs(page, command, monkeypatch):
    import typer.main
    from typer.testing import CliRunner

    from kvbench.cli import app

    argv = argv_of(command)
    name = subcommand(argv)
    if name in RUN_HERE:
        monkeypatch.chdir(ROOT)
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, f"{page}: `{command}` exited {result.exit_code}: {result.output[-400:]}"
        return
    reason = next((why for why, names in NOT_RUN.items() if name in names), None)
    assert reason, f"{page}: `{command}`: kvbench {name} is neither run here nor given a reason"
    if name == "lm-eval":  # lm-eval's own command line: its options are lm-eval's
        return
    group = typer.main.get_command(app)
    command_object = group.commands.get(name)
    assert command_object is not None, f"{page}: `{command}`: no command '{name}'"
    command_object.make_context(name, argv[1:])  # a click usage error: an option or argument that does not exist


def test_every_gate_command_pairs_a_run_with_its_own_baseline():
    """A baseline gates runs of the sweep it was frozen from (`kvbench gate` refuses others): the run folder a
    documented gate command names must be one of that sweep's."""
    for page, command in shown_commands():
        argv = argv_of(command)
        if subcommand(argv) != "gate" or "--baseline" not in argv:
            continue
        baseline = ROOT / argv[argv.index("--baseline") + 1]
        if baseline.exists():
            name = json.loads(baseline.read_text())["name"]
            assert Path(argv[1]).name.startswith(name), f"{page}: `{command}` gates a run with {name}'s baseline"


# --- tables that read fast --------------------------------------------------------------------------------------
MAX_CELL = 200  # characters of Markdown source; the detail goes in a paragraph or list below the table


def table_rows(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, cells) of every `|` row outside code fences; cells split on ` | `."""
    rows, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.lstrip().startswith("|"):
            rows.append((number, [cell.strip() for cell in line.strip().strip("|").split(" | ")]))
    return rows


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_table_cell_is_longer_than_200_characters(page):
    long = [f"line {number}: {len(cell)} characters: {cell[:60]}..."
            for number, cells in table_rows(page) for cell in cells if len(cell) > MAX_CELL]
    assert not long, f"{page.name}: move the detail below the table:\n" + "\n".join(long)


def built_in_policies() -> list[str]:
    """The registered policies kvbench ships (a test's or a plugin's registered in this process left out)."""
    from kvbench.policies import POLICIES

    return [name for name in POLICIES.names() if POLICIES.get(name).__module__.startswith("kvbench.policies.")]


def policy_table(page: Path) -> list[str]:
    """The first cells of the page's policy table: the one whose header reads `| policy | phases | ...`."""
    rows = table_rows(page)
    for index, (number, cells) in enumerate(rows):
        if cells[:2] == ["policy", "phases"]:
            names, expected = [], number + 2  # the body starts past the header's |---| line
            for row_number, row_cells in rows[index + 2:]:
                if row_number != expected:  # a gap: the table has ended
                    break
                names.append(row_cells[0].strip("`"))
                expected += 1
            return names
    return []


def test_the_policies_page_has_a_table_row_for_every_registered_policy():
    listed = policy_table(ROOT / "docs" / "policies.md")
    assert listed, "policies.md has no `| policy | phases | ...` table"
    names = built_in_policies()
    missing = [name for name in names if name not in listed]
    unknown = [name for name in listed if name not in names]
    assert not missing and not unknown, f"policies.md's table: no row for {missing}; rows for no policy {unknown}"


def test_every_count_of_built_in_policies_the_docs_state_is_the_registry_count():
    count = len(built_in_policies())
    stated = [(page.name, int(n)) for page in PAGES for n in re.findall(r"\b(\d+) built-in policies", prose(page))]
    assert ("policies.md", count) in stated, "policies.md no longer says how many built-in policies there are"
    wrong = [(name, n) for name, n in stated if n != count]
    assert not wrong, f"`kvbench policies` lists {count}; the docs say {wrong}"
