"""`kvbench calibrate`: what a calibrated policy reads, computed from the model itself and saved where kvpress reads
the same thing (a folder kvpress's own `from_pretrained` loads):

- `qfilter`: Q-Filters (Godey et al. 2025, arXiv 2503.02812), one direction per layer and KV head found by an SVD of
  the model's own post-RoPE queries, in kvpress's `QFilters` format.
- `kvzap-linear`, `kvzap-mlp`: KVzap's surrogates (arXiv 2601.07891), a ridge regression or a small MLP per layer
  from the attention's input hidden states to their KVzip+ scores (kvzap.py), in kvpress's `KVzapModel` format.
- `expected-attention`: the mean and covariance of the pre-RoPE queries, in kvpress's `ExpectedAttentionStats`
  format (what its `ExpectedAttentionStatsPress` reads).

Each calibration window starts as the prompts its policy then sees start (`window_start`), and what is computed is
kept per model, keyed by the settings, the corpus, the model and `CALIBRATION_FORMAT`; a policy reads its artifact
once per loaded model (`read_artifact`).
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from kvbench import __version__
from kvbench.calibration import kvzap
from kvbench.calibration.artifacts import WEIGHTS_FILE, read_provenance, read_weights, write_artifact
from kvbench.calibration.methods import Settings, check_writable, dtype_name, require_method
from kvbench.engine.models import LoadedModel, cache_dir, model_digest, per_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.base import Policy, Schedule

# what the cached calibrations were computed by: bumped whenever a method's math or its windows change, so that an
# entry computed before is recomputed, not read back (1: every window starts as an inference prompt starts)
CALIBRATION_FORMAT = 1


@dataclass
class Calibrated:
    folder: Path
    computed: bool  # False: read back from the per-model cache
    seconds: float
    documents: int
    tokens: int
    quality: dict[str, Any]  # how well it does on held-out text (KVzap), as the provenance file records it
    stale: int | None = None  # the format of a cached calibration found and recomputed (None: none was)


def default_folder(lm: LoadedModel, method: str) -> Path:
    """Where a calibration lands unless told otherwise, and where its policy looks: `$KVBENCH_CACHE/<method>/`, in a
    folder keyed by the model's config, dtype and attention weights (`model_digest`, as RazorAttention's heads)."""
    return cache_dir() / method / model_digest(lm)


def calibrated_folder(lm: LoadedModel, policy: str, method: str, given: str | None, what: str,
                      it: str = "them") -> Path:
    """The folder `policy` reads `method`'s artifact for `lm` from: `given`, or where `kvbench calibrate` puts it.
    None there, or one that a kvbench of another calibration format made (its `calibration.json` says; a folder
    that names no format, as kvpress or a hand writes one, is read as it is), is a one-line error naming the command
    that makes `it` again."""
    folder = default_folder(lm, method) if given is None else Path(given).expanduser()
    command = calibrate_command(lm, method) + ("" if given is None else f" -o {given}")
    if not folder.is_dir():
        raise KvbenchError(f"policy '{policy}': no {what} in {folder}: make {it} with `{command}`")
    made = calibration_format(folder)
    if made is not None and made != CALIBRATION_FORMAT:
        raise KvbenchError(f"policy '{policy}': the {what} in {folder} come from calibration format {made}, this "
                           f"kvbench's is {CALIBRATION_FORMAT}: make {it} again with `{command}`")
    return folder


def calibration_format(folder: Path) -> int | None:
    """The calibration format `folder`'s provenance names; None: it names none."""
    made = (read_provenance(folder) or {}).get("calibration_format")
    return made if isinstance(made, int) else None


def calibrate_command(lm: LoadedModel, method: str) -> str:
    """The command that makes `method`'s artifact for `lm` where its policy looks by default."""
    return f"kvbench calibrate -m {lm.spec} --method {method} --dtype {dtype_name(lm)}"


# a chat template's user turn around this text shows where the turn's text goes
_TURN_TEXT = "kvbench calibration window"
_CHAT_METHODS = ("kvzap-linear", "kvzap-mlp")  # kvpress's KVzapDataCollector feeds each text as a chat turn


def window_start(tokenizer, method: str) -> tuple[list[int], str]:
    """The tokens every calibration window of `method` starts with, as the prompts its policy sees start (tasks'
    `encode_prompt`), and what they are, for the provenance. KVzap's reference (kvpress's KVzapDataCollector) feeds
    each text as a user turn of the chat template: its windows start with the template's opening of a user turn,
    where the tokenizer has a template ("chat template"). The Q-Filters reference (make_filters.py) and kvpress's
    Expected Attention statistics tokenise raw text with the tokenizer's special tokens, as every prompt without a
    template is: theirs, and KVzap's without a template, start with the tokens the tokenizer adds before a text
    ("start token": BOS where it adds one; "none" where it adds none)."""
    if method in _CHAT_METHODS and getattr(tokenizer, "chat_template", None):
        turn = tokenizer.apply_chat_template([{"role": "user", "content": _TURN_TEXT}], tokenize=False,
                                             add_generation_prompt=True)
        # the template writes its own special tokens, as a prompt's are (encode_prompt)
        return tokenizer(turn.split(_TURN_TEXT)[0], add_special_tokens=False).input_ids, "chat template"
    plain = tokenizer(_TURN_TEXT, add_special_tokens=False).input_ids
    full = tokenizer(_TURN_TEXT, add_special_tokens=True).input_ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    return full[:at], "start token" if at else "none"


def corpus_documents(lm: LoadedModel, corpus: str, settings: Settings, method: str) -> list[list[int]]:
    """`settings.documents` windows of `settings.tokens` tokens: each `window_start`, then consecutive tokens of
    `corpus`, drawn with the seed among the corpus's non-overlapping stretches of that length."""
    from kvbench.tasks.corpus import load_corpus

    start, _ = window_start(lm.tokenizer, method)
    length = settings.tokens - len(start)
    if length < 1:
        raise KvbenchError(f"kvbench calibrate: --tokens {settings.tokens} leaves no room for text after the "
                           f"{len(start)} tokens each window of {method} starts with")
    ids = lm.tokenizer.encode(load_corpus(corpus), add_special_tokens=False)
    windows = len(ids) // length
    if windows < settings.documents:
        raise KvbenchError(f"kvbench calibrate: corpus '{corpus}' has {len(ids)} tokens, {windows} documents of "
                           f"{settings.tokens}; asked for {settings.documents}")
    chosen = torch.randperm(windows, generator=torch.Generator().manual_seed(settings.seed))[: settings.documents]
    return [start + ids[w * length : (w + 1) * length] for w in sorted(chosen.tolist())]


def calibrate(lm: LoadedModel, method: str, corpus: str, settings: Settings, output: Path | None = None,
              advance: Callable[[int, int], None] = lambda done, total: None,
              notice: Callable[[str], None] = lambda line: None) -> Calibrated:
    """`method`'s artifact for `lm` from `corpus` (`embedded` or a file or folder of text), written to `output`
    (default: `default_folder`). The computation is cached per model, settings and `CALIBRATION_FORMAT`
    (`per_model`), so a second call only writes the folder; a cached one of another format is recomputed, said in
    one line to `notice`. `advance(done, total)` after each document. A folder that cannot be written is a one-line
    error before anything is computed."""
    require_method(method)
    folder = output or default_folder(lm, method)
    check_writable(folder)
    check_writable(cache_dir() / f"calibrate-{method}")  # where the computation is kept (`per_model`)
    documents = corpus_documents(lm, corpus, settings, method)
    start, starts_with = window_start(lm.tokenizer, method)
    corpus_digest = hashlib.sha256(json.dumps(documents).encode()).hexdigest()[:16]
    variant = f"{asdict(settings)} corpus={corpus_digest}"
    stale: list[int] = []

    def recomputing(found: int) -> None:
        stale.append(found)
        notice(f"kvbench calibrate: the cached {method} calibration of {lm.spec} was made by calibration format "
               f"{found}, this kvbench's is {CALIBRATION_FORMAT}: recomputing it")

    started = time.perf_counter()
    saved, computed = per_model(lm, f"calibrate-{method}", variant,
                                lambda: _compute(lm, method, documents, settings, len(start), advance),
                                version=CALIBRATION_FORMAT, stale=recomputing)
    seconds = time.perf_counter() - started
    provenance = {"model": lm.spec, "dtype": dtype_name(lm), "corpus": corpus, "method": method,
                  **asdict(settings), "window_start": starts_with, "window_start_tokens": len(start),
                  "window_start_text": lm.tokenizer.decode(start), "calibration_format": CALIBRATION_FORMAT,
                  "kvbench": __version__}
    quality = _save(lm, method, saved, folder, provenance)
    return Calibrated(folder, computed, seconds, len(documents), settings.tokens, quality, stale[0] if stale else None)


def _compute(lm: LoadedModel, method: str, documents: list[list[int]], settings: Settings, start: int,
             advance: Callable[[int, int], None]) -> dict[str, torch.Tensor]:
    if method == "qfilter":
        return {"q_filters": qfilters(lm, documents, settings, advance)}
    if method == "expected-attention":
        return query_statistics(lm, documents, advance)
    return kvzap.fit(lm, documents, settings, method.removeprefix("kvzap-"), advance, skip=start)


def _save(lm: LoadedModel, method: str, saved: dict[str, torch.Tensor], folder: Path,
          provenance: dict) -> dict[str, Any]:
    """Writes `method`'s folder; returns what it says of the artifact's quality (KVzap's held-out scores)."""
    if method == "qfilter":
        save_qfilters(saved["q_filters"], folder, provenance)
        return {}
    if method == "expected-attention":
        save_query_statistics(saved, folder, provenance)
        return {}
    quality = kvzap.quality(saved)
    kvzap.save(kvzap.rebuilt(saved), folder, {**provenance, **quality})
    return quality


def qfilters(lm: LoadedModel, documents: list[list[int]], settings: Settings,
             advance: Callable[[int, int], None]) -> torch.Tensor:
    """`[layers, kv_heads, head_dim]` Q-Filters as the authors' make_filters.py computes them: per layer and query
    head, the first right singular vector of `samples` post-RoPE queries (the same positions for every head), its
    sign set so that most queries project on it positively, negated (kvpress scores a key by -<filter, key>: the
    keys along the queries' direction score highest), averaged over each KV head's query heads."""
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


Artifact = TypeVar("Artifact")
# what calibrated policies read of artifact folders, per model object: (what, folder) -> (the weights file's
# identity, what was read)
_READ: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[str, str], tuple[tuple[int, ...], Any]]] = \
    weakref.WeakKeyDictionary()


def read_artifact(lm: LoadedModel, folder: Path, what: str, read: Callable[[Path], Artifact]) -> Artifact:
    """`read(folder)`, `what` a policy makes of an artifact folder for `lm` (its tensors on the model's device), once
    per loaded model: kept while the folder's weights file is the same file, unchanged (its inode, size and
    modification time), so every session after the first reads nothing (a server reads its artifacts once, at
    start-up). Shared by every session on the model: read only."""
    try:
        stat = (folder / WEIGHTS_FILE).stat()
    except OSError:
        return read(folder)  # no artifact there: `read`'s own error
    identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    kept = _READ.setdefault(lm.model, {})
    key = (what, str(folder.resolve()))
    if key not in kept or kept[key][0] != identity:
        kept[key] = (identity, read(folder))
    return kept[key][1]


def save_qfilters(filters: torch.Tensor, folder: Path, provenance: dict) -> None:
    """kvpress's format (`QFilters.save_pretrained`'s files), with kvbench's provenance beside it."""
    layers, kv_heads, head_dim = filters.shape
    write_artifact(folder, {"q_filters": filters},
                   {"kv_head_dim": head_dim, "num_kv_heads": kv_heads, "num_layers": layers}, provenance)


def load_qfilters(folder: Path) -> torch.Tensor:
    """`[layers, kv_heads, head_dim]` from a folder in kvpress's format (kvbench's or one of kvpress's downloads)."""
    return read_weights(folder)["q_filters"]


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


STATS_FIELDS = ("query_mean", "query_cov")
STATS_SINKS = 4  # the first positions' queries are left out, as kvpress's collect_queries leaves them (outliers)


def query_statistics(lm: LoadedModel, documents: list[list[int]],
                     advance: Callable[[int, int], None]) -> dict[str, torch.Tensor]:
    """`query_mean` `[layers, heads, D]` and `query_cov` `[layers, heads, D, D]` of every pre-RoPE query of the
    documents but each one's first `STATS_SINKS`, as kvpress's `collect_queries` computes them (the covariance over
    n - 1). The sums are expected_attention's own prompt moments (its `observe`), added over the documents."""
    count = total = outer = torch.zeros(())
    for index, ids in enumerate(documents):
        policy = build_policy("expected_attention", {"n_sink": STATS_SINKS})
        # a budget of the whole document: the policy gathers its moments and evicts nothing
        session = Session(lm, policy, RunSettings(budget=len(ids)), prompt_tokens=len(ids))
        session.prefill(torch.tensor([ids]))
        moments = [layer.layer_stats[policy.state_key] for layer in session.cache.layers]
        count = count + torch.stack([m.count[0] for m in moments]).cpu().double()  # [layers, heads]
        total = total + torch.stack([m.total[0] for m in moments]).cpu().double()
        outer = outer + torch.stack([m.outer[0] for m in moments]).cpu().double()
        advance(index + 1, len(documents))
    mean = total / count[..., None]
    centered = outer - count[..., None, None] * mean[..., :, None] * mean[..., None, :]
    return {"query_mean": mean.float(), "query_cov": (centered / (count - 1)[..., None, None]).float()}


def save_query_statistics(stats: dict[str, torch.Tensor], folder: Path, provenance: dict) -> None:
    """kvpress's `ExpectedAttentionStats.save_pretrained` files (its `from_pretrained(folder)` and
    `ExpectedAttentionStatsPress(stats_folder=...)` load them), with kvbench's provenance beside them."""
    layers, heads, head_dim = stats["query_mean"].shape
    write_artifact(folder, {name: stats[name] for name in STATS_FIELDS}, {
        "num_layers": layers, "num_heads": heads, "head_dim": head_dim, "dataset_name": provenance["corpus"],
        "model_name": provenance["model"], "num_samples": provenance["documents"],
        "sample_seq_len": provenance["tokens"], "n_sink": STATS_SINKS}, provenance)


def load_query_statistics(folder: Path) -> dict[str, torch.Tensor]:
    """`query_mean` `[layers, heads, D]` and `query_cov` `[layers, heads, D, D]` from kvpress's format."""
    return read_weights(folder)
