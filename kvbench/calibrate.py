"""`kvbench calibrate`: what a calibrated policy reads, computed from the model itself and saved where kvpress reads
the same thing. One method so far, `qfilter`: Q-Filters (Godey et al. 2025, arXiv 2503.02812), one direction per
layer and KV head found by an SVD of the model's own post-RoPE queries, saved in kvpress's `QFilters` format
(`config.json` and `model.safetensors`, loaded by `QFilters.from_pretrained(folder)`)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.models import LoadedModel, cache_dir, model_digest, per_model
from kvbench.policies.base import Policy, Schedule

FILTERS_FILE, CONFIG_FILE, PROVENANCE_FILE = "model.safetensors", "config.json", "calibration.json"


@dataclass(frozen=True)
class QFilterSettings:
    """How much text the SVD sees: `documents` windows of `tokens` consecutive corpus tokens, of whose queries
    `samples` (the same positions for every head) are drawn with `seed`. The defaults run in seconds on a CPU for the
    embedded models; the paper's (`PAPER`) are 20 documents of 2,048 tokens."""

    documents: int = 4
    tokens: int = 512
    samples: int = 3000
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.documents, self.tokens, self.samples) < 1:
            raise KvbenchError(f"kvbench calibrate: documents, tokens and samples must be at least 1, got "
                               f"{self.documents}, {self.tokens}, {self.samples}")


PAPER = QFilterSettings(documents=20, tokens=2048, samples=3000)
METHODS = ("qfilter",)  # what `kvbench calibrate --method` offers


@dataclass
class Calibrated:
    folder: Path
    computed: bool  # False: read back from the per-model cache
    seconds: float
    documents: int
    tokens: int


def require_method(method: str) -> None:
    if method not in METHODS:
        raise KvbenchError(f"kvbench calibrate: --method '{method}' is not one of {', '.join(METHODS)}")


def default_folder(lm: LoadedModel, method: str) -> Path:
    """Where a calibration lands unless told otherwise, and where its policy looks: `$KVBENCH_CACHE/<method>/`, in a
    folder keyed by the model's config, dtype and attention weights (`model_digest`, as RazorAttention's heads)."""
    return cache_dir() / method / model_digest(lm)


def calibrate_command(lm: LoadedModel, method: str) -> str:
    """The command that makes `method`'s artifact for `lm` where its policy looks by default."""
    return f"kvbench calibrate -m {lm.spec} --method {method} --dtype {dtype_name(lm)}"


def dtype_name(lm: LoadedModel) -> str:
    return str(lm.dtype).removeprefix("torch.")


def corpus_documents(lm: LoadedModel, corpus: str, settings: QFilterSettings) -> list[list[int]]:
    """`settings.documents` windows of `settings.tokens` consecutive tokens of `corpus`, drawn with the seed among
    the corpus's non-overlapping windows."""
    from kvbench.tasks.corpus import load_corpus

    ids = lm.tokenizer.encode(load_corpus(corpus), add_special_tokens=False)
    windows = len(ids) // settings.tokens
    if windows < settings.documents:
        raise KvbenchError(f"kvbench calibrate: corpus '{corpus}' has {len(ids)} tokens, {windows} documents of "
                           f"{settings.tokens}; asked for {settings.documents}")
    chosen = torch.randperm(windows, generator=torch.Generator().manual_seed(settings.seed))[: settings.documents]
    return [ids[w * settings.tokens : (w + 1) * settings.tokens] for w in sorted(chosen.tolist())]


def calibrate(lm: LoadedModel, method: str, corpus: str, settings: QFilterSettings, output: Path | None = None,
              advance: Callable[[int, int], None] = lambda done, total: None) -> Calibrated:
    """`method`'s artifact for `lm` from `corpus` (`embedded` or a file or folder of text), written to `output`
    (default: `default_folder`). The computation is cached per model and settings (`per_model`), so a second call
    only writes the folder. `advance(done, total)` after each document."""
    require_method(method)
    documents = corpus_documents(lm, corpus, settings)
    corpus_digest = hashlib.sha256(json.dumps(documents).encode()).hexdigest()[:16]
    variant = f"{asdict(settings)} corpus={corpus_digest}"
    started = time.perf_counter()
    saved, computed = per_model(lm, f"calibrate-{method}", variant,
                                lambda: {"q_filters": qfilters(lm, documents, settings, advance)})
    seconds = time.perf_counter() - started
    folder = output or default_folder(lm, method)
    save_qfilters(saved["q_filters"], folder, {"model": lm.spec, "dtype": dtype_name(lm), "corpus": corpus,
                                               **asdict(settings), "kvbench": __version__})
    return Calibrated(folder, computed, seconds, len(documents), settings.tokens)


def qfilters(lm: LoadedModel, documents: list[list[int]], settings: QFilterSettings,
             advance: Callable[[int, int], None]) -> torch.Tensor:
    """`[layers, kv_heads, head_dim]` Q-Filters as the authors' make_filters.py computes them: per layer and query
    head, the first right singular vector of `samples` post-RoPE queries (the same positions for every head), its
    sign set so that most queries project on it positively, negated (kvpress scores a key by -<filter, key>: the
    keys along the queries' direction score highest), averaged over each KV head's query heads."""
    from kvbench.session import Session  # the session imports the policies
    from kvbench.settings import RunSettings

    total = len(documents) * settings.tokens
    drawn = torch.randperm(total, generator=torch.Generator().manual_seed(settings.seed))[: settings.samples]
    recorder = _QueryRecorder()
    for index, ids in enumerate(documents):
        in_document = drawn[(drawn >= index * settings.tokens) & (drawn < (index + 1) * settings.tokens)]
        recorder.positions = in_document.sort().values - index * settings.tokens
        Session(lm, recorder, RunSettings(), prompt_tokens=len(ids)).prefill(torch.tensor([ids]))
        advance(index + 1, len(documents))
    filters = []
    for per_document in recorder.queries:
        queries = torch.cat(per_document, dim=1)  # [heads, samples, D]
        left, _, right = torch.linalg.svd(queries, full_matrices=False)
        sign = torch.where((left[..., 0] > 0).float().mean(-1) > 0.5, 1.0, -1.0)
        per_head = -sign[:, None] * right[:, 0, :]
        filters.append(per_head.view(lm.kv_heads, -1, per_head.shape[-1]).mean(dim=1))
    return torch.stack(filters)


def save_qfilters(filters: torch.Tensor, folder: Path, provenance: dict) -> None:
    """kvpress's format (`QFilters.save_pretrained`'s files), with kvbench's provenance beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    layers, kv_heads, head_dim = filters.shape
    save_file({"q_filters": filters.float().contiguous()}, str(folder / FILTERS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({"kv_head_dim": head_dim, "num_kv_heads": kv_heads,
                                                  "num_layers": layers}, indent=2) + "\n")
    (folder / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")


def load_qfilters(folder: Path) -> torch.Tensor:
    """`[layers, kv_heads, head_dim]` from a folder in kvpress's format (kvbench's or one of kvpress's downloads)."""
    return load_file(str(folder / FILTERS_FILE))["q_filters"]


@dataclass
class _QueryRecorder(Policy):
    """Keeps every entry and records each layer's post-RoPE queries `[heads, k, D]` (float32, on the CPU) at
    `positions` of the prompt it sees."""

    name: ClassVar[str] = "qfilter-calibration"
    schedule: ClassVar[Schedule] = Schedule.NONE
    needs_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.positions = torch.zeros(0, dtype=torch.long)
        self.queries: list[list[torch.Tensor]] = []  # per layer, per document

    def observe(self, layer, query, key, scaling, phase) -> None:
        if layer.layer_idx == len(self.queries):
            self.queries.append([])
        self.queries[layer.layer_idx].append(query[0, :, self.positions.to(query.device)].float().cpu())
