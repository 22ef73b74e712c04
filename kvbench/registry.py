"""Name -> class registries for policies and tasks, and loading user plugins: from a folder, or from installed
distributions that declare a `kvbench.policies` / `kvbench.tasks` entry point."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
import typing
from pathlib import Path
from typing import Any, Generic, TypeVar

import pydantic

from kvbench.errors import KvbenchError, did_you_mean

T = TypeVar("T")

# `[project.entry-points."kvbench.policies"] myname = "mypkg.module"`: the module is imported (its @register runs)
# the first time the registry of that kind is read
ENTRY_POINT_GROUPS = {"policy": "kvbench.policies", "task": "kvbench.tasks"}


class Registry(Generic[T]):
    """Maps names to classes; `register` is a class decorator reading the class's `name`. The built-in ones are
    known by the module that registers them (`index`), imported when their name is first read: listing the names
    imports nothing, and running one policy imports that policy's module alone."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, type[T]] = {}
        self._modules: dict[str, str] = {}
        self._entry_points_loaded = False

    def index(self, modules: dict[str, str]) -> None:
        """Names and the modules that register them, imported on demand."""
        self._modules.update(modules)

    def register(self, cls: type[T]) -> type[T]:
        name = cls.name  # type: ignore[attr-defined]
        if name in self._entries and self._entries[name] is not cls:
            raise KvbenchError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = cls
        return cls

    def get(self, name: str) -> type[T]:
        self._load_entry_points()
        if name not in self._entries and name in self._modules:
            importlib.import_module(self._modules[name])
        if name not in self._entries:
            raise KvbenchError(f"unknown {self.kind} '{name}'{did_you_mean(name, self._entries)}; known: "
                               f"{', '.join(self.names())}")
        return self._entries[name]

    def build(self, name: str, params: dict[str, Any] | None = None) -> T:
        """Instantiate `name` from user parameters, checking their names and types."""
        cls = self.get(name)
        params = dict(params or {})
        known = declared_params(cls)
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise KvbenchError(
                f"{self.kind} '{name}' has no parameter '{unknown[0]}'; its parameters: {', '.join(known) or 'none'}"
            )
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in params.items():
            try:
                values[key] = pydantic.TypeAdapter(hints[key]).validate_python(value)
            except pydantic.ValidationError as exc:
                reason = exc.errors()[0]["msg"]
                raise KvbenchError(f"{self.kind} '{name}' parameter '{key}'={value!r}: {reason}") from None
        return cls(**values)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted({*self._entries, *self._modules})

    def _load_entry_points(self) -> None:
        """Import, once, every module installed distributions declare for this kind of registry."""
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True  # first: a plugin that reads the registry while importing must not recurse
        group = ENTRY_POINT_GROUPS.get(self.kind)
        for entry_point in importlib.metadata.entry_points(group=group) if group else ():
            try:
                entry_point.load()
            except KvbenchError:
                raise
            except Exception as exc:  # an installed plugin that breaks is named, like a plugin folder's file
                source = f"{entry_point.dist.name} " if entry_point.dist else ""
                raise KvbenchError(f"{self.kind} plugin '{entry_point.name}' ({source}entry point "
                                   f"{entry_point.value}) failed to import: {type(exc).__name__}: {exc}") from exc


def first_line(cls: type) -> str:
    """A class's one-line description: the first paragraph of its docstring, unwrapped."""
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def declared_params(cls: type) -> dict[str, Any]:
    """The user-settable fields of a dataclass, with their defaults."""
    return {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
        if f.init
    }


def load_plugins(folder: str | Path) -> list[str]:
    """Import every `*.py` file in `folder`; their `@register` decorators add them to the registries."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KvbenchError(f"plugin folder not found: {folder}")
    loaded = []
    for path in sorted(folder.glob("*.py")):
        module_name = f"kvbench_plugin_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
        if module_name in sys.modules:  # already registered in this process
            loaded.append(str(path))
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # a broken plugin is the user's input: name it, and leave nothing of it loaded
            sys.modules.pop(module_name, None)
            what = str(exc) if isinstance(exc, KvbenchError) else f"failed to import: {type(exc).__name__}: {exc}"
            raise KvbenchError(f"plugin {path}: {what}") from exc
        loaded.append(str(path))
    return loaded
