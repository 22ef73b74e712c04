"""A calibrated policy's artifact folder, in kvpress's layout (what `save_pretrained` writes and `from_pretrained`
reads: the tensors in `model.safetensors`, `config.json`) with kvbench's provenance beside them in
`calibration.json`: written by calibrate.py and kvzap.py beside it, read by the policies."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvbench.errors import KvbenchError

WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE = "model.safetensors", "config.json", "calibration.json"


def write_artifact(folder: Path, tensors: dict[str, torch.Tensor], config: dict, provenance: dict) -> None:
    """A folder as kvpress's `save_pretrained` writes one (the tensors in `model.safetensors`, float32, and
    `config.json`), with kvbench's provenance beside them in `calibration.json`. The files are written whole in a
    folder beside it, then moved in, so a failed write leaves no part of an artifact; one that cannot be written is a
    one-line error."""
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.{time.time_ns()}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        save_file({name: tensor.detach().float().cpu().contiguous() for name, tensor in tensors.items()},
                  str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if folder.is_dir():  # a folder written before (or the user's own): its files replaced one by one
            for name in (WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE):
                (staging / name).replace(folder / name)
        else:
            staging.rename(folder)
    except OSError as exc:
        raise KvbenchError(f"kvbench calibrate: cannot write the folder {folder}: "
                           f"{exc.strerror or type(exc).__name__}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / WEIGHTS_FILE))


def read_provenance(folder: Path) -> dict | None:
    """What `calibration.json` in `folder` says; None: there is none (a folder kvpress or a hand wrote)."""
    path = folder / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        provenance = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise KvbenchError(f"{path}: not a readable JSON file; make the calibration again or delete it") from None
    return provenance if isinstance(provenance, dict) else {}
