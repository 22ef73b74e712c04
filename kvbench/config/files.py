"""A sweep config as its YAML files: merged over their includes, `--set key=value` applied, and where a key was
given (the file and line, or the `--set`) for an error to name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kvbench.errors import KvbenchError


def read_with_includes(path: Path, seen: tuple[Path, ...]) -> tuple[dict[str, Any], list[tuple[Path, Any]]]:
    """The merged mapping (included files first, this file on top) and each file's YAML node tree."""
    if not path.is_file():
        raise KvbenchError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise KvbenchError(f"{path}: include cycle")
    text = path.read_text(encoding="utf-8")
    try:
        data, node = yaml.safe_load(text), yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise KvbenchError(f"{path}{line}: malformed YAML: {reason}") from None
    if not isinstance(data, dict):
        raise KvbenchError(f"{path}: a config must be a mapping of keys, got {type(data).__name__}")
    includes = data.pop("include", [])
    plugins = data.pop("plugins", [])
    merged: dict[str, Any] = {}
    sources: list[tuple[Path, Any]] = [(path, node)]
    for include in [includes] if isinstance(includes, str) else includes:
        included, inner = read_with_includes(path.parent / include, seen + (path.resolve(),))
        merged = merge(merged, included)
        sources.extend(inner)
    merged = merge(merged, data)
    # folders add up over includes (an included file's policies still need theirs), each relative to its own file
    if isinstance(plugins, str):
        plugins = [plugins]
    if isinstance(plugins, list):
        plugins = [*merged.get("plugins", []), *(str(path.parent / p) if isinstance(p, str) else p for p in plugins)]
    if plugins:
        merged["plugins"] = plugins  # anything but folders is left for validation to name
    return merged, sources


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def assign(tree: Any, keys: list[str], value: Any) -> None:
    """Set `value` at a dotted path; numeric parts index lists (`policies.0=window`)."""
    *parents, last = keys
    for depth, key in enumerate(parents):
        if isinstance(tree, list):
            index = _index(tree, key)
            if isinstance(tree[index], str):  # a bare model id or name takes sub-keys in its mapping form
                tree[index] = model_spec(tree[index]) if keys[depth - 1] == "models" else named_spec(tree[index])
            tree = tree[index]
            continue
        node = tree.setdefault(key, {})
        if not isinstance(node, (dict, list)):
            node = tree[key] = {"id": node} if key == "model" else {}
        tree = node
    if isinstance(tree, list):
        tree[_index(tree, last)] = value
    else:
        tree[last] = value


def named_spec(value: Any) -> Any:
    """A policy or task given by its bare name, in its mapping form (`window` is `{name: window}`)."""
    return {"name": value} if isinstance(value, str) else value


def model_spec(value: Any) -> Any:
    """A model given by its bare id, in its mapping form (`smollm2-135m` is `{id: smollm2-135m}`)."""
    return {"id": value} if isinstance(value, str) else value


def _index(items: list, key: str) -> int:
    if not key.isdigit() or int(key) >= len(items):
        raise KvbenchError(f"--set: '{key}' is not an index of a {len(items)}-item list")
    return int(key)


def where_given(sources: list[tuple[Path, Any]], overridden: list[tuple[tuple, str]], loc: tuple) -> str:
    """`--set key=value` where the command line set `loc` (or a key above it), else `file:line` of the deepest node
    on `loc` that some source file spells out."""
    for keys, item in reversed(overridden):  # the last --set of a key is the one that stands
        if loc[: len(keys)] == keys:
            return f"--set {item}"
    for path, root in sources:
        node, line = root, None
        for part in loc:
            child = _child(node, part)
            if child is None:
                break
            line, node = child.start_mark.line + 1, child
        if line is not None:
            return f"{path}:{line}"
    return str(sources[0][0])


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == part:
                return value
        return None
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    return None


def dotted(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
