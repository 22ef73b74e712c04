"""What `kvbench calibrate` offers: its methods, how much text each sees by default and at the papers' size, and
the checks made before a model loads. The CLI reads these for its --help; computing is calibrate.py."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.engine.models import LoadedModel


@dataclass(frozen=True)
class Settings:
    """How much text a calibration sees: `documents` windows of `tokens` consecutive corpus tokens, drawn with `seed`.
    qfilter's SVD sees `samples` query vectors per head; KVzap trains on `samples` positions of each document but the
    last `held_out`, which it is scored on (R^2, kept-set agreement); its MLP is `hidden_dim` wide, trained `epochs`
    times over the samples. Expected Attention counts every query. `SIZES` holds each method's defaults, sized for a
    CPU on the embedded models, and the papers' (`--paper`)."""

    documents: int = 4
    tokens: int = 512
    samples: int = 3000
    seed: int = 0
    held_out: int = 0
    hidden_dim: int = 512
    epochs: int = 15

    def __post_init__(self) -> None:
        if min(self.documents, self.tokens, self.samples, self.hidden_dim, self.epochs) < 1:
            raise KvbenchError(f"kvbench calibrate: documents, tokens, samples, hidden_dim and epochs must be at least "
                               f"1, got {self.documents}, {self.tokens}, {self.samples}, {self.hidden_dim}, "
                               f"{self.epochs}")
        if not 0 <= self.held_out < self.documents:
            raise KvbenchError(f"kvbench calibrate: held_out must leave a document to train on: {self.held_out} of "
                               f"{self.documents}")


# the CPU defaults, then the papers': Q-Filters' 20 x 2048 tokens; KVzap's ~1.2M positions (2,400 texts of about 1,000
# tokens, 500 positions each; kvpress's MLP 512 wide, 15 epochs); Expected Attention's 100 calibration texts
_KVZAP = (Settings(documents=10, tokens=512, samples=256, held_out=2, hidden_dim=64),
          Settings(documents=2448, tokens=1024, samples=500, held_out=48))
SIZES: dict[str, tuple[Settings, Settings]] = {
    "qfilter": (Settings(), Settings(documents=20, tokens=2048)),
    "kvzap-linear": _KVZAP,
    "kvzap-mlp": _KVZAP,
    "expected-attention": (Settings(documents=8, tokens=512), Settings(documents=100, tokens=1000)),
}
METHODS = tuple(SIZES)  # what `kvbench calibrate --method` offers


def require_method(method: str) -> None:
    if method not in METHODS:
        raise KvbenchError(f"kvbench calibrate: --method '{method}' is not one of {', '.join(METHODS)}")


def dtype_name(lm: LoadedModel) -> str:
    return str(lm.dtype).removeprefix("torch.")


def check_writable(folder: Path) -> None:
    """A one-line error unless `folder` is, or can be made, a folder this process writes in, naming what is in the
    way: a file where it or a folder above it would be, a place it may not write in (tried: a folder made there and
    removed, so a read-only file system is found out too)."""
    if folder.exists() and not folder.is_dir():
        raise KvbenchError(f"kvbench calibrate: cannot write the folder {folder}: it is a file")
    above = folder
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise KvbenchError(f"kvbench calibrate: cannot create the folder {folder}: {above} is a file")
    try:
        Path(tempfile.mkdtemp(prefix=".kvbench-check.", dir=above)).rmdir()
    except OSError as exc:
        raise KvbenchError(f"kvbench calibrate: cannot {'write' if above == folder else 'create'} the folder "
                           f"{folder}: {above} is not writable ({exc.strerror or type(exc).__name__})") from None
