"""The README and docs/ hold together: every relative link (and its #anchor) resolves, every sweep config they
show validates, and every config in configs/ loads (the policies and tasks it names exist)."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from kvbench.config.cells import expand
from kvbench.config.schema import load_config

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


@functools.cache
def validated(name: str) -> tuple[int, str]:
    """`kvbench validate configs/<name>.yaml` as a user runs it, from the repository root: (exit code, output)."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        result = CliRunner().invoke(app, ["validate", f"configs/{name}.yaml"])
    finally:
        os.chdir(here)
    return result.exit_code, result.output


def cells(name: str) -> int:
    """The cells `kvbench validate` counts in configs/<name>.yaml."""
    code, output = validated(name)
    found = re.search(r"ok, ([\d,]+) cells", output)
    assert code == 0 and found, f"kvbench validate configs/{name}.yaml: {output[-300:]}"
    return int(found.group(1).replace(",", ""))


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(config):
    """On a fresh clone: `kvbench validate` exits 0, and no config reads data from outside the repository."""
    code, output = validated(config.stem)
    assert code == 0, f"kvbench validate {config.name} exited {code}: {output[-300:]}"
    assert "../" not in config.read_text().split("\nname:", 1)[-1], f"{config.name} reads a path outside the checkout"


def test_the_docs_show_at_least_one_config():
    assert shown_configs()


# --- every kvbench command the docs show ------------------------------------------------------------------------
# A command runs here when it is read-only, offline and quick; every other one is parsed (its command, options and
# arguments must exist) and falls under one of these reasons, which the test states.
RUN_HERE = {"policies", "tasks", "--version", "validate", "estimate"}
NOT_RUN = {
    "a run folder a sweep made": {"report", "recommend", "plot", "summarize", "gate", "baseline", "merge"},
    "a real model (or a GPU, the hub, Ray) for minutes or more": {"run", "sweep", "check", "capacity", "lm-eval",
                                                                  "calibrate"},
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


def policy_table(page: Path) -> list[tuple[str, str]]:
    """The first two cells of each row of the page's policy table: the one whose header reads `| policy | schedule |
    ...`."""
    rows = table_rows(page)
    for index, (number, cells) in enumerate(rows):
        if cells[:2] == ["policy", "schedule"]:
            names, expected = [], number + 2  # the body starts past the header's |---| line
            for row_number, row_cells in rows[index + 2:]:
                if row_number != expected:  # a gap: the table has ended
                    break
                names.append((row_cells[0].strip("`"), row_cells[1]))
                expected += 1
            return names
    return []


def test_the_policies_page_has_a_table_row_for_every_registered_policy():
    table = policy_table(ROOT / "docs" / "policies.md")
    assert table, "policies.md has no `| policy | schedule | ...` table"
    listed = [name for name, _ in table]
    names = built_in_policies()
    missing = [name for name in names if name not in listed]
    unknown = [name for name in listed if name not in names]
    assert not missing and not unknown, f"policies.md's table: no row for {missing}; rows for no policy {unknown}"


def test_the_policies_table_gives_each_policys_schedule():
    from kvbench.policies import POLICIES

    wrong = [(name, cell) for name, cell in policy_table(ROOT / "docs" / "policies.md")
             if name in built_in_policies() and not cell.startswith(("its base's", POLICIES.get(name).schedule.when))]
    assert not wrong, f"policies.md's schedule column disagrees with the policies' `schedule`: {wrong}"


def test_every_count_of_built_in_policies_the_docs_state_is_the_registry_count():
    count = len(built_in_policies())
    stated = [(page.name, int(n)) for page in PAGES for n in re.findall(r"\b(\d+) built-in policies", prose(page))]
    assert ("policies.md", count) in stated, "policies.md no longer says how many built-in policies there are"
    wrong = [(name, n) for name, n in stated if n != count]
    assert not wrong, f"`kvbench policies` lists {count}; the docs say {wrong}"


# --- numbers the docs quote: counted from the code -------------------------------------------------------------
CONFIG_NAME = re.compile(r"configs/([\w.-]+)\.yaml")
CELLS = re.compile(r"\b(\d[\d,]*) cells\b")


def flat(text: str) -> str:
    """Text with its line breaks and runs of spaces as one space: a phrase split over two lines still matches."""
    return re.sub(r"\s+", " ", text)


def config_cell_claims() -> list[tuple[str, str, int]]:
    """(where, config, stated cells) for every "N cells" that names its config: in a config's comments (its own
    count, or another config's named on the same line), and in the docs where the line or sentence names one config
    (a command line in a shell block, or prose)."""
    claims = []
    for config in CONFIGS:
        for number, line in enumerate(config.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                named = [n for n in CONFIG_NAME.findall(line) if n != config.stem]
                for stated in CELLS.findall(line):
                    claims.append((f"{config.name}:{number}", named[0] if named else config.stem, stated))
    for page in PAGES:
        text = page.read_text()
        for body in re.findall(r"```(?:bash|console|sh)\n(.*?)```", text, flags=re.S):
            for line in body.splitlines():
                if len(set(CONFIG_NAME.findall(line))) == 1:
                    claims += [(page.name, CONFIG_NAME.findall(line)[0], n) for n in CELLS.findall(line)]
        for sentence in re.split(r"(?<=[.;:])\s+(?=[A-Z`(])", flat(prose(page))):
            if len(set(CONFIG_NAME.findall(sentence))) == 1:
                claims += [(page.name, CONFIG_NAME.findall(sentence)[0], n) for n in CELLS.findall(sentence)]
    return [(where, name, int(stated.replace(",", ""))) for where, name, stated in claims]


def test_the_docs_state_cell_counts_of_configs():
    """The check below has something to check: the counts the docs are known to state."""
    claimed = {(where.split(":")[0], name) for where, name, _ in config_cell_claims()}
    for expected in [("zoo.yaml", "zoo"), ("README.md", "llama8b-quick"), ("README.md", "llama8b"),
                     ("llama8b.yaml", "llama8b-quick"), ("README.md", "llama7b"), ("llama7b.yaml", "llama7b"),
                     ("llama7b.yaml", "llama7b-quick"), ("llama7b-quick.yaml", "llama7b-quick"),
                     ("scenarios.yaml", "scenarios"), ("policies.md", "zoo")]:
        assert expected in claimed, f"no cell count of configs/{expected[1]}.yaml found in {expected[0]}"


@pytest.mark.parametrize(("where", "name", "count"), config_cell_claims(),
                         ids=[f"{w}:{n}:{c}" for w, n, c in config_cell_claims()])
def test_every_cell_count_the_docs_state_is_what_validate_counts(where, name, count):
    assert count == cells(name), f"{where} says configs/{name}.yaml has {count} cells; kvbench validate: {cells(name)}"


def smoke_config():
    return load_config(ROOT / "configs" / "smoke.yaml")


def eviction_policies(config) -> list[str]:
    """The config's eviction policies: a policy of the eviction family, its entries stored as they are."""
    from kvbench.policies import POLICIES

    return [p.name for p in config.policies
            if POLICIES.get(p.name).family == "eviction" and "storage" not in p.canonical().get("params", {})]


def stated(page: str, pattern: str) -> tuple[str, ...]:
    """The groups of `pattern` in the page's prose (line breaks as spaces); the test fails if it is not there."""
    found = re.search(pattern, flat(prose(ROOT / page)))
    assert found, f"{page}: no longer says /{pattern}/ (update this test with the page)"
    return found.groups()


def test_the_demo_counts_are_smoke_yaml_s():
    config = smoke_config()
    policies, budgets, lengths = stated("README.md", r"over (\d+) policies, (\d+) budgets and (\d+) context lengths")
    assert (int(policies), int(budgets), int(lengths)) == (
        len(config.policies), len(config.budgets), len(config.context_lengths)), "README.md: the demo's grid"
    (demo_cells,) = stated("README.md", r"two RULER subtasks and perplexity: (\d+) cells")
    assert int(demo_cells) == cells("smoke"), f"README.md says the demo has {demo_cells} cells"
    evicting, budgets = stated("docs/demo.md", r"over (\d+) eviction policies x (\d+) budgets")
    assert int(evicting) == len(eviction_policies(config)), \
        f"demo.md says {evicting} eviction policies; configs/smoke.yaml has {eviction_policies(config)}"
    assert int(budgets) == len(config.budgets)
    smoke, capacity = stated("docs/demo.md", r"(\d+) \+ (\d+) cells")
    assert (int(smoke), int(capacity)) == (cells("smoke"), cells("capacity")), "demo.md: smoke + capacity cells"


def test_the_readme_s_policy_count_is_the_registry_s():
    (count,) = stated("README.md", r"\b(\d+) policies \(window")
    assert int(count) == len(built_in_policies()), f"README.md says {count} policies; the registry has " \
        f"{len(built_in_policies())}"


def built_in_tasks() -> list[str]:
    """The tasks `kvbench tasks` lists (a test's or a plugin's registered in this process left out)."""
    from kvbench.tasks import TASKS

    return [name for name in TASKS.names() if TASKS.get(name).__module__.startswith("kvbench.tasks.")]


def test_the_tasks_page_covers_every_task_kvbench_tasks_lists():
    rows = table_rows(ROOT / "docs" / "tasks.md")
    assert rows and rows[0][1][0] == "task", "tasks.md opens with its `| task | ... |` table"
    listed = [row[0].strip("`") for _, row in rows[2:] if row[0].startswith("`")]
    names = built_in_tasks()
    assert sorted(listed) == sorted(names), f"tasks.md's table: {sorted(listed)}; kvbench tasks: {sorted(names)}"
    text = prose(ROOT / "docs" / "tasks.md")
    detail = [name for name in names if f"- **`{name}`**" not in text]
    assert not detail, f"tasks.md has no detail paragraph (`- **`name`**`) for {detail}"


def test_the_gate_page_s_detectable_drops_are_the_gate_s():
    from kvbench.analysis.gate import detectable_drop

    claims = re.findall(r"n = (\d+): ~?([\d.]+) points", flat(prose(ROOT / "docs" / "gate.md")))
    assert claims, "gate.md no longer sizes a gate (`n = 8: 50 points`)"
    wrong = [(n, points, detectable_drop(int(n), 1.0)) for n, points in claims
             if float(points) != detectable_drop(int(n), 1.0)]
    assert not wrong, f"gate.md: (n, stated, kvbench.analysis.gate.detectable_drop(n, 1.0)): {wrong}"


def test_the_readme_s_test_command_is_what_ci_runs():
    """The README's `make test` is a Makefile target and what .ci/run runs; every `make X` the docs show is a
    target; the torch version the README names is the one constraints.txt pins."""
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make test\s+#.*\.ci/run", readme, flags=re.M), "README.md: `make test  # ... .ci/run ...`"
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), flags=re.M), ".ci/run does not run make test"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    shown = set()
    for page in PAGES:
        text = page.read_text()
        blocks = "\n".join(re.findall(r"```(?:bash|console|sh)\n(.*?)```", text, flags=re.S))
        shown |= {(page.name, t) for t in re.findall(r"`make ([\w-]+)`", text) + re.findall(r"^make ([\w-]+)", blocks,
                                                                                                flags=re.M)}
    missing = sorted(shown - {(page, t) for page, t in shown if t in targets})
    assert not missing, f"no such Makefile target: {missing}"
    pin = re.search(r"^torch==(\d+\.\d+)\.(\d+)", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pin, "constraints.txt pins no torch"
    stated_pins = re.findall(r"the torch that `constraints.txt` pins \((\d+\.\d+)\)|asks for torch (\d+\.\d+\.\d+)",
                             flat(prose(ROOT / "README.md")))
    assert stated_pins, "README.md no longer names the torch constraints.txt pins"
    for short, full in stated_pins:
        assert short in ("", pin.group(1)) and full in ("", f"{pin.group(1)}.{pin.group(2)}"), \
            f"README.md names torch {short or full}; constraints.txt pins {pin.group(0)}"


def test_every_record_column_is_documented():
    """Every key of a record a tiny run writes (and a threshold cell's) has a row or a mention in measurements.md."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    keys: set[str] = set()
    for budget in ("64", "threshold=0.01"):
        result = CliRunner().invoke(app, ["run", "-m", "random:tiny-llama", "-p", "h2o", "-b", budget, "-c", "256",
                                          "-n", "1", "--max-new-tokens", "2", "--json"])
        assert result.exit_code == 0, result.output[-400:]
        for line in result.output.splitlines():
            if line.startswith("{"):
                keys |= set(json.loads(line))
    assert "kept_max_ever" in keys, "a record without kept_max_ever: the run printed no records"
    page = (ROOT / "docs" / "measurements.md").read_text()
    missing = sorted(key for key in keys if f"`{key}`" not in page)
    assert not missing, f"measurements.md does not name these record columns: {missing}"
