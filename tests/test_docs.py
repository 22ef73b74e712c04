"""The README and docs/ hold together: every relative link (and its #anchor) resolves, every sweep config they
show validates, and every config in configs/ loads (the policies and tasks it names exist)."""

from __future__ import annotations

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
