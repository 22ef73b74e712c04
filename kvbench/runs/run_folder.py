"""The run folder (docs/running.md#the-run-folder): manifest.json, records.jsonl, cells.jsonl.

Records are appended and flushed one per finished sample, so a run killed at any moment loses at
most the sample in flight; a line cut off by a kill is dropped on the next open, never fatal.

One process writes a run folder at a time: opening it takes an exclusive OS lock on its `writer.lock`
(`fcntl.flock`), which goes with the process that holds it, so a killed sweep leaves no stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import torch

from kvbench import __version__
from kvbench.errors import KvbenchError

MANIFEST, RECORDS, CELLS, LOCK = "manifest.json", "records.jsonl", "cells.jsonl", "writer.lock"


def read_jsonl(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Every complete line of a JSONL file. A last line without its newline is a write cut short:
    it is ignored (and cut from the file when `repair`). A broken line before it is corruption."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) < len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(complete))
    rows = []
    for number, line in enumerate(complete.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise KvbenchError(f"{path}:{number}: corrupted result line (not JSON); fix or delete it") from None
    return rows


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "kvbench": __version__,
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_memory=props.total_memory, cuda=torch.version.cuda)
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML is optional: no driver version then
            info["driver"] = None
    return info


def _git_commit() -> str | None:
    source = Path(__file__).resolve().parents[2]  # kvbench/runs/ -> the checkout
    try:
        out = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def union_models(*described: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each model's `describe()` once per spec and dtype (the latest wins), in the order first seen: the
    manifest's `models` across resumes and shards."""
    union: dict[tuple[str, str], dict[str, Any]] = {}
    for models in described:
        for model in models:
            union[model["spec"], model["dtype"]] = model
    return list(union.values())


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunFolder:
    """One sweep's folder: what is done, and appending what gets done."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock: IO[str] | None = None  # the open lock file while this process writes the folder

    def lock(self) -> None:
        """Become the folder's one writer (creating it): an exclusive lock on `writer.lock`, held until `release`
        or until this process ends, however it ends. Held by another process, or a path no folder can be made at:
        a one-line error naming it."""
        if self._lock is not None:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = (self.path / LOCK).open("a+", encoding="utf-8")
        except OSError as error:  # a file where the folder goes or above it, no permission, a full disk
            in_the_way = next((path for path in (self.path, *self.path.parents)
                               if path.exists() and not path.is_dir()), None)
            reason = f"{in_the_way} is a file" if in_the_way else (error.strerror or str(error)).lower()
            raise KvbenchError(f"cannot write the run's folder {self.path}: {reason}; give another --output "
                               "folder") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not written its name yet"
            handle.close()
            raise KvbenchError(f"{self.path} is being written by another sweep ({holder}): wait for it to finish, "
                               "or give this one another --output folder") from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {now()}\n")
        handle.flush()
        self._lock = handle

    def release(self) -> None:
        """Stop writing the folder: let another process lock it."""
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    @property
    def records_path(self) -> Path:
        return self.path / RECORDS

    @property
    def cells_path(self) -> Path:
        return self.path / CELLS

    def manifest(self) -> dict[str, Any] | None:
        path = self.path / MANIFEST
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            raise KvbenchError(f"{path}: corrupted manifest (not JSON)") from None

    def open(self, manifest: dict[str, Any], force: bool) -> None:
        """Start or resume writing (`lock` first): a folder holding another config's results is refused unless
        `force`."""
        self.lock()
        previous = self.manifest()
        if previous and previous.get("config_hash") != manifest["config_hash"] and not force:
            raise KvbenchError(
                f"{self.path} holds results of a different config (hash {previous.get('config_hash')} vs "
                f"{manifest['config_hash']}); use a new --output folder, or --force to reuse the cells both share"
            )
        if previous:  # a resume keeps when it began, and the models that ran before (they may not load again)
            manifest = {**manifest, "started": previous.get("started", manifest["started"]),
                        "resumed": [*previous.get("resumed", []), manifest["started"]],
                        "models": union_models(previous.get("models", []), manifest.get("models", []))}
        self.write_manifest(manifest)
        read_jsonl(self.records_path, repair=True)
        read_jsonl(self.cells_path, repair=True)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        staging = self.path / (MANIFEST + ".tmp")
        staging.write_text(json.dumps(manifest, indent=2, default=str))
        staging.replace(self.path / MANIFEST)  # atomic: a kill never leaves half a manifest

    def records(self) -> list[dict[str, Any]]:
        """Every record. A cell that runs whole (a load cell) marks its records with its `attempt`: a kill and a
        rerun leave several attempts' records, and only the attempt its final status names counts (the last one
        while it has none)."""
        rows = read_jsonl(self.records_path)
        attempts = {row["cell_id"]: row["attempt"] for row in rows if "attempt" in row}
        if not attempts:
            return rows
        attempts |= {cell_id: status["attempt"] for cell_id, status in self.cells().items() if "attempt" in status}
        return [row for row in rows if row.get("attempt", attempts.get(row["cell_id"])) == attempts.get(row["cell_id"])]

    def cells(self) -> dict[str, dict[str, Any]]:
        """Final status per cell id (the last line for a cell wins)."""
        return {row["cell_id"]: row for row in read_jsonl(self.cells_path)}

    def done(self) -> set[tuple[str, str]]:
        return {(row["cell_id"], row["sample_id"]) for row in self.records()}

    def add_record(self, record: dict[str, Any]) -> None:
        append_jsonl(self.records_path, record)

    def add_trace(self, cell_id: str, sample_id: str, traces: list[dict[str, Any]]) -> None:
        """A sample's memory time series (`--trace`), one JSON line per sample in traces/<cell>.jsonl."""
        (self.path / "traces").mkdir(exist_ok=True)
        append_jsonl(self.path / "traces" / f"{cell_id}.jsonl", {"sample_id": sample_id, "traces": traces})

    def add_cell(self, status: dict[str, Any]) -> None:
        append_jsonl(self.cells_path, status)


def merge_runs(output: str | Path, shards: list[str]) -> None:
    """Union of shard folders of one config: records and cell statuses, each (cell, sample) once."""
    folders = [RunFolder(path) for path in shards]
    manifests = []
    for folder in folders:
        manifest = folder.manifest()
        if manifest is None:
            raise KvbenchError(f"not a run folder (no manifest.json): {folder.path}")
        manifests.append(manifest)
    hashes = {m["config_hash"] for m in manifests}
    if len(hashes) > 1:
        raise KvbenchError(f"shards come from different configs (hashes {', '.join(sorted(hashes))})")
    target = RunFolder(output)
    try:
        _merge_into(target, folders, manifests)
    finally:
        target.release()


def _merge_into(target: RunFolder, folders: list[RunFolder], manifests: list[dict[str, Any]]) -> None:
    merged = {**manifests[0], "shard": None, "merged_from": [str(f.path) for f in folders],
              "cells": sorted({cell for m in manifests for cell in m["cells"]}),
              "models": union_models(*(m.get("models", []) for m in manifests)),
              "cell_descriptions": {k: v for m in manifests for k, v in m.get("cell_descriptions", {}).items()}}
    target.open(merged, force=False)
    seen = target.done()
    statuses = target.cells()
    for folder in folders:
        for record in folder.records():
            if (record["cell_id"], record["sample_id"]) not in seen:
                seen.add((record["cell_id"], record["sample_id"]))
                target.add_record(record)
        for cell_id, status in folder.cells().items():
            if statuses.get(cell_id) != status:
                statuses[cell_id] = status
                target.add_cell(status)
