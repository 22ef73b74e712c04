"""Haystack text: the embedded corpus (CPython's reference-manual prose) or the user's files."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from kvbench.errors import KvbenchError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@functools.lru_cache(maxsize=8)
def load_corpus(source: str) -> str:
    """`embedded`, a text file, or a folder of `*.txt` files, as one whitespace-normalised string."""
    if source == "embedded":
        return _embedded_prose()
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise KvbenchError(f"corpus folder has no .txt files: {source}")
    elif path.is_file():
        files = [path]
    else:
        raise KvbenchError(f"corpus not found: {source}")
    text = " ".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return " ".join(text.split())


def _embedded_prose() -> str:
    """The prose paragraphs of `pydoc_data.topics` (~465 KB shipped with every CPython): code,
    grammar productions, signatures and headings are dropped so the haystack reads as English."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    keep = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.splitlines()
        if not lines or any(line.startswith("      ") for line in lines):  # code and grammar blocks
            continue
        flat = " ".join(paragraph.split())
        letters = sum(ch.isalpha() or ch == " " for ch in flat)
        if len(flat) > 80 and flat[-1] in ".:" and letters / len(flat) > 0.85:
            keep.append(flat)
    return " ".join(keep)
