"""Haystack text: the embedded corpus (CPython's reference-manual prose) or the user's files."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from kvbench.errors import KvbenchError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


# `hf:<name>` shortcuts: (dataset, config, split) of corpora with a `text` column
HUB_CORPORA = {
    "pg19": ("emozilla/pg19-test", None, "test"),
    "wikitext": ("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
}
HUB_MAX_CHARS = 20_000_000  # a long-context sample needs far less; PG-19's test split is ~50M characters


@functools.lru_cache(maxsize=8)
def load_corpus(source: str) -> str:
    """`embedded`, a text file, a folder of `*.txt` files, or `hf:<dataset>[:<config>]` (`hf:pg19`,
    `hf:wikitext`) through `datasets`, as one whitespace-normalised string."""
    if source == "embedded":
        return _embedded_prose()
    if source.startswith("hf:"):
        return " ".join(_hub_text(source[3:]).split())
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


def haystack_text(tokenizer, source: str, tokens: int) -> tuple[str, list[int]]:
    """The first `tokens` tokens of `source` (repeated if short) as text, and each token's end (chars)."""
    chars = 1 << (tokens * 12).bit_length()  # no tokenizer spends 12 characters on a token of English
    text, ends = _tokenized_prefix(tokenizer, source, chars)
    return text[: ends[tokens - 1]] if tokens else "", ends[:tokens]


# generators call haystack_text for many sizes while fitting a length: tokenize each prefix once
_PREFIXES: dict[tuple[int, int, int], tuple[str, list[int]]] = {}


def _tokenized_prefix(tokenizer, source: str, chars: int) -> tuple[str, list[int]]:
    key = (id(tokenizer), hash(source), chars)
    if key not in _PREFIXES:
        source = source.strip() + " "
        text = (source * (chars // len(source) + 1))[:chars]
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(_PREFIXES) > 8:
            _PREFIXES.clear()
        _PREFIXES[key] = text, [end for _, end in encoded.offset_mapping]
    return _PREFIXES[key]


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


def _hub_text(name: str) -> str:
    try:
        import datasets
    except ImportError:
        raise KvbenchError(f"corpus 'hf:{name}' needs the datasets package: pip install -e '.[data]' in the "
                           "kvbench checkout") from None
    repo, config, split = HUB_CORPORA.get(name, (*name.split(":", 1), "test") if ":" in name else (name, None, "test"))
    try:
        rows = datasets.load_dataset(repo, config, split=split)
    except Exception as exc:  # offline, unknown dataset, gated: one line, not a traceback
        raise KvbenchError(f"corpus 'hf:{name}': cannot load {repo}: {str(exc).splitlines()[0]}") from None
    if "text" not in rows.column_names:
        raise KvbenchError(f"corpus 'hf:{name}': {repo} has no 'text' column (columns: {rows.column_names})")
    parts, size = [], 0
    for text in rows["text"]:
        parts.append(text)
        size += len(text)
        if size >= HUB_MAX_CHARS:
            break
    return "\n".join(parts)
