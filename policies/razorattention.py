from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.engine.attention import attention_probs
from kvbench.engine.models import per_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies.base import Policy, RetrievalHeads, Schedule, register

CALIBRATION_SEED = 0


@dataclass
class HeadScores:
    """Per layer and KV head `[layers, kv_heads]`, the most any of its query heads scores (a KV head is a retrieval
    head when any query head sharing it is one: the cache is shared, so one such query head needs it whole)."""

    echo: torch.Tensor  # attention to the current token's earlier occurrence
    induction: torch.Tensor  # attention to the token that followed that occurrence


@register
@dataclass
class RazorAttention(RetrievalHeads):
    """RazorAttention (Tang et al. 2024, arXiv 2407.15891): retrieval heads keep the whole cache, the other heads the
    first `sinks` entries and the most recent (`budget` in all: Algorithm 1's buffer max(S0, N / C)).

    Retrieval heads are found without training, once per model: `calibration_tokens` random tokens fed twice in one
    prompt. For each query of the second copy, an echo head attends to the same token's occurrence in the first copy,
    an induction head to the token that followed it; a head's score is that attention averaged over the second copy's
    queries. The `induction` share of KV heads with the highest induction scores over the whole model, and the `echo`
    share with the highest echo scores (each at least one head), are retrieval heads: the paper's 15% and 1%.
    The scores are kept per model in memory and on disk (`$KVBENCH_CACHE/razorattention/`, keyed by a hash of the
    model's config and attention weights), so a sweep calibrates a model once; a cell that calibrated reports its
    seconds (`calibration_s`, not in `ttft_s`). The paper's compensation token (the mean of the dropped entries,
    weighted in attention by how many it stands for) is not modelled: the dropped entries are dropped.
    """

    name = "razorattention"
    induction: float = 0.15
    echo: float = 0.01
    calibration_tokens: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0.0 <= self.induction <= 1.0 and 0.0 <= self.echo <= 1.0):
            raise KvbenchError("policy 'razorattention' parameters 'induction' and 'echo' are shares of the heads, in "
                               f"[0, 1]: got {self.induction}, {self.echo}")
        if self.calibration_tokens < 2:
            raise KvbenchError("policy 'razorattention' parameter 'calibration_tokens' must be at least 2, got "
                               f"{self.calibration_tokens}")
        self._retrieval: torch.Tensor | None = None
        self._calibration_s = 0.0

    def prepare(self, lm) -> None:
        start = time.perf_counter()
        scores, calibrated = head_scores(lm, self.calibration_tokens)
        self._calibration_s = time.perf_counter() - start if calibrated else 0.0
        self._retrieval = top_share(scores.induction, self.induction) | top_share(scores.echo, self.echo)

    def retrieval_heads(self) -> torch.Tensor:
        if self._retrieval is None:
            raise KvbenchError("policy 'razorattention' finds its retrieval heads when a session is made (prepare)")
        return self._retrieval

    def report(self) -> dict[str, Any]:
        return {**super().report(), "calibration_s": self._calibration_s}


def top_share(scores: torch.Tensor, share: float) -> torch.Tensor:
    """True for the `share` of entries of `scores` with the highest values (at least one for a positive share)."""
    count = math.ceil(share * scores.numel())
    chosen = torch.zeros(scores.numel(), dtype=torch.bool)
    chosen[scores.flatten().argsort(descending=True, stable=True)[:count]] = True
    return chosen.view(scores.shape)


def head_scores(lm, tokens: int) -> tuple[HeadScores, bool]:
    """The model's echo and induction scores, and whether they were calibrated now (False: read back)."""
    def compute() -> dict[str, torch.Tensor]:
        scores = calibrate(lm, tokens)
        return {"echo": scores.echo, "induction": scores.induction}

    saved, calibrated = per_model(lm, "razorattention", f"tokens={tokens} seed={CALIBRATION_SEED}", compute)
    return HeadScores(saved["echo"], saved["induction"]), calibrated


def calibrate(lm, tokens: int) -> HeadScores:
    """One forward over `tokens` random token ids repeated twice, through kvbench's own session (the attention
    statistics path every attention-scored policy uses)."""
    vocab = lm.model.config.vocab_size
    sequence = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))
    recorder = _RepetitionRecorder(period=tokens)
    session = Session(lm, recorder, RunSettings(), prompt_tokens=2 * tokens)
    session.prefill(torch.cat([sequence, sequence])[None])
    return HeadScores(torch.stack(recorder.echo), torch.stack(recorder.induction))


@dataclass
class _RepetitionRecorder(Policy):
    """Keeps every entry and records, per layer and KV head, the echo and induction attention of a sequence that
    repeats with `period`: query i (i >= period) to key i - period (echo) and i - period + 1 (induction)."""

    name: ClassVar[str] = "razorattention-calibration"
    schedule: ClassVar[Schedule] = Schedule.NONE
    needs_attention: ClassVar[bool] = True
    period: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.echo: list[torch.Tensor] = []
        self.induction: list[torch.Tensor] = []

    def observe(self, layer, query, key, scaling, phase) -> None:
        echo = torch.zeros(key.shape[:2] + (query.shape[1] // key.shape[1],))  # [1, kv_heads, group]
        induction = torch.zeros_like(echo)
        for start, probs in attention_probs(query, key, scaling, kind=layer.kind, positions=layer.live_positions()):
            queries = torch.arange(start, start + probs.shape[3])
            repeated = queries >= self.period
            rows, earlier = queries[repeated] - start, queries[repeated] - self.period
            echo += probs[..., rows, earlier].sum(-1).cpu()
            induction += probs[..., rows, earlier + 1].sum(-1).cpu()
        self.echo.append((echo / self.period).amax(-1)[0])
        self.induction.append((induction / self.period).amax(-1)[0])
