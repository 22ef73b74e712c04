from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.llama.modeling_llama import rotate_half

from kvbench.calibration.calibrate import calibrated_folder, load_query_statistics, read_artifact
from kvbench.engine.attention import queries_per_chunk
from kvbench.engine.row_accounts import rows_of
from kvbench.errors import KvbenchError
from kvbench.policies.base import Demand, Policy, Schedule, protect, register, shares


@dataclass
class QueryMoments:
    """A layer's query statistics, pre-RoPE, per query head: the prompt's count, sum and sum of outer products
    (`[B, H]`, `[B, H, D]`, `[B, H, D, D]`, float32), and for decoding a ring of the newest queries with, per row,
    how many it was given (a batch's rows fill theirs from prompts of different lengths)."""

    count: torch.Tensor
    total: torch.Tensor
    outer: torch.Tensor
    scaling: float
    recent: torch.Tensor | None = None  # [B, H, query_buffer + 1, D]: the last cell a spare for uncounted queries
    recent_seen: np.ndarray | None = None  # [B] on the host


@register
@dataclass
class ExpectedAttention(Policy):
    """Expected Attention (Devoto et al. 2025; kvpress's ExpectedAttentionPress): keep the entries future queries
    are expected to attend to.

    The pre-RoPE queries of the prompt (the first `n_sink` positions left out, as outliers) give each query head
    a mean mu and covariance S; both are rotated by RoPE averaged over the next `n_future_positions` positions
    (R = mean of R(p)). For a query q ~ N(R mu, R S R^T), E[exp(s q.k)] = exp(s k.R mu + s^2/2 k^T R S R^T k):
    its softmax over the live keys, averaged over the KV head's query heads, times ||v||_2 (`use_vnorm`, after
    adding `epsilon`) is the score; the first `n_sink` positions are always kept. s is the model's attention
    scaling (1/sqrt(d) where kvpress writes it). Queries are un-rotated from the attention's own (post-RoPE)
    ones, so QK-normed models (Qwen3, Gemma3) get the normed queries, as kvpress recomputes them.
    With `decode: true` it keeps evicting while decoding, from the statistics of the newest `query_buffer`
    queries (the prompt's last ones first), as kvpress's DecodingPress scores from buffered queries.
    """

    name = "expected_attention"
    threshold_scale = "share of the head's expected attention (times ||v|| with use_vnorm), sinks protected"
    schedule = Schedule.PREFILL
    needs_attention = True
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    decode: bool = False
    query_buffer: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1 or self.query_buffer < 2:
            raise KvbenchError("policy 'expected_attention' needs n_future_positions >= 1 and query_buffer >= 2")
        if self.n_sink < 0 or self.epsilon < 0:
            raise KvbenchError("policy 'expected_attention' parameters 'n_sink' and 'epsilon' must be >= 0")
        if self.decode:
            self.schedule = Schedule.DECODE  # type: ignore[misc]

    def check(self, demand: Demand) -> None:
        super().check(demand)
        if demand.budget is not None and demand.budget <= self.n_sink:
            raise KvbenchError(f"expected_attention: budget {demand.budget} must exceed n_sink={self.n_sink}")

    def observe(self, layer, query, key, scaling, phase) -> None:
        if phase != "prefill" and not self.decode:
            return
        positions = _query_positions(layer, query.shape[2])
        cos, sin = layer.owner.model.rotary(query, positions.clamp(min=0), layer.layer_idx)
        plain = query.float() * cos[:, None] - rotate_half(query.float()) * sin[:, None]  # R(p)^T q
        moments = layer.layer_stats.get(self.state_key)
        if moments is None:
            batch, heads, _, dim = query.shape
            moments = layer.layer_stats[self.state_key] = QueryMoments(
                query.new_zeros((batch, heads), dtype=torch.float32),
                query.new_zeros((batch, heads, dim), dtype=torch.float32),
                query.new_zeros((batch, heads, dim, dim), dtype=torch.float32), scaling)
        counted = positions >= self.n_sink  # [B, q]: sinks and a padded row's padding left out
        if phase == "prefill":
            kept = plain * counted[:, None, :, None]
            moments.count += counted.sum(dim=1)[:, None]
            moments.total += kept.sum(dim=2)
            moments.outer += kept.transpose(-1, -2) @ kept
        if self.decode:  # each row's counted queries are its newest: the next position (host) says how many
            next_positions = layer.seen - np.array(layer.owner.row_padding)
            counted_queries = np.clip(next_positions - self.n_sink, 0, query.shape[2])
            _remember(moments, plain, counted_queries, self.query_buffer)

    def score(self, layer, budget: int) -> torch.Tensor:
        mean, covariance, scaling = self.statistics(layer)
        rotation = self._future_rotation(layer, mean)  # [B, D, D]
        mean = torch.einsum("bed,bhd->bhe", rotation, mean)
        covariance = torch.einsum("bed,bhdf,bgf->bheg", rotation, covariance, rotation)
        scores = self._expected(layer, mean, covariance if self.use_covariance else None, scaling)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * layer.live_values().float().norm(dim=-1)
        return protect(scores, layer.live_positions() < self.n_sink)

    def threshold_score(self, layer) -> torch.Tensor:
        # the expected attention sums to one over the entries, but use_vnorm scales it by the values' norms
        return shares(self.score(layer, layer.length), layer)

    def statistics(self, layer) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The pre-RoPE query mean `[B, H, D]` and covariance `[B, H, D, D]` the score expects, and the attention
        scaling: estimated from the queries seen (the prompt's, or while decoding the newest)."""
        moments = layer.layer_stats[self.state_key]
        return (*self._moments(moments, layer.owner.phase == "prefill"), moments.scaling)

    def _moments(self, moments: QueryMoments, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's query mean `[B, H, D]` and covariance `[B, H, D, D]`: the prompt's, or while decoding its ring's
        (once it holds two queries); rows whose rings hold different counts, one at a time."""
        seen = np.zeros(moments.count.shape[0], dtype=np.int64) if moments.recent_seen is None else moments.recent_seen
        kinds = {(prefill or int(rows) < 2, min(int(rows), self.query_buffer)) for rows in seen}
        if len(kinds) > 1:
            parts = [self._moments(rows_of(moments, slice(row, row + 1)), prefill) for row in range(len(seen))]
            return torch.cat([mean for mean, _ in parts]), torch.cat([covariance for _, covariance in parts])
        (from_prompt, held_count), = kinds
        if from_prompt:
            count = moments.count.clamp(min=1)[..., None]
            mean = moments.total / count
            return mean, moments.outer / count[..., None] - mean[..., :, None] * mean[..., None, :]
        assert moments.recent is not None
        held = moments.recent[:, :, :held_count]
        mean = held.mean(dim=2)
        centered = held - mean[:, :, None]
        return mean, centered.transpose(-1, -2) @ centered / held.shape[2]

    def _future_rotation(self, layer, like: torch.Tensor) -> torch.Tensor:
        """RoPE's rotation matrix averaged over the next `n_future_positions` positions, per row `[B, D, D]`."""
        batch, dim = like.shape[0], like.shape[-1]
        start = _next_positions(layer)
        positions = (start + torch.arange(self.n_future_positions, device=like.device)).expand(batch, -1)
        cos, sin = layer.owner.model.rotary(like, positions, layer.layer_idx)
        half = dim // 2
        swap = torch.zeros(dim, dim, device=like.device)  # rotate_half as a matrix: x -> (-x2, x1)
        swap[:half, half:] = -torch.eye(half, device=like.device)
        swap[half:, :half] = torch.eye(half, device=like.device)
        return torch.diag_embed(cos.mean(dim=1)) + sin.mean(dim=1)[..., None] * swap

    def _expected(self, layer, mean: torch.Tensor, covariance: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Softmax over the non-sink live keys of each query head's expected logit, averaged over the KV head's
        query heads: `[B, kv_heads, n]`. Chunked over keys so the covariance term holds one block at a time."""
        keys = layer.live_keys().float()
        batch, kv_heads, n, dim = keys.shape
        group = mean.shape[1] // kv_heads
        mean = mean.view(batch, kv_heads, group, dim)
        logits = torch.einsum("bkgd,bknd->bkgn", mean, keys) * scaling
        if covariance is not None:
            covariance = covariance.view(batch, kv_heads, group, dim, dim)
            block = queries_per_chunk(batch, kv_heads * group, n, dim, keys.device)
            for start in range(0, n, block):
                part = keys[:, :, start : start + block]
                spread = torch.einsum("bknd,bkgde,bkne->bkgn", part, covariance, part)
                logits[..., start : start + block] += spread * (scaling * scaling / 2)
        hidden = layer.live_positions() < self.n_sink
        if layer.padding() is not None:
            hidden = hidden | layer.padding()
        logits = logits.masked_fill(hidden[:, :, None], float("-inf"))
        return logits.softmax(dim=-1).nan_to_num(0.0).mean(dim=2)


def _next_positions(layer) -> torch.Tensor:
    """`[B, 1]`: the position each row's next token takes."""
    return torch.as_tensor(layer.next_position(), device=layer.device).reshape(-1)[:, None]


def _query_positions(layer, count: int) -> torch.Tensor:
    """`[B, count]` positions of the newest `count` tokens (negative on a left-padded row's padding)."""
    return _next_positions(layer) - count + torch.arange(count, device=layer.device)


def _remember(moments: QueryMoments, queries: torch.Tensor, counted: np.ndarray, size: int) -> None:
    """Write each row's `counted[row]` newest of `queries` `[B, H, q, D]` (its last `size` at most) into its ring of
    the newest `size` queries; the others go to the spare cell."""
    batch, _, q, _ = queries.shape
    if moments.recent is None:
        moments.recent = queries.new_zeros((batch, queries.shape[1], size + 1, queries.shape[-1]))
        moments.recent_seen = np.zeros(batch, dtype=np.int64)
    assert moments.recent_seen is not None
    kept = np.minimum(counted, size)
    order = np.arange(q) - (q - kept)[:, None]  # [B, q]: a kept query's place among the row's kept ones
    cells = np.where(order >= 0, (moments.recent_seen[:, None] + order) % size, size)
    index = torch.from_numpy(cells).to(queries.device)[:, None, :, None].expand_as(queries)
    moments.recent.scatter_(2, index, queries)
    moments.recent_seen = moments.recent_seen + kept



@register
@dataclass
class ExpectedAttentionStats(ExpectedAttention):
    """Expected Attention with calibrated query statistics (kvpress's ExpectedAttentionStatsPress): each query head's
    pre-RoPE mean and covariance come from calibration text (`kvbench calibrate --method expected-attention`), not
    from the prompt's own queries; the rest is `expected_attention`'s. `stats_folder`: a folder in kvpress's
    ExpectedAttentionStats format, default the model's own calibration in `$KVBENCH_CACHE/expected-attention/`."""

    name = "expected_attention_stats"
    stats_folder: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None  # [layers, H, D], [layers, H, D, D]

    def prepare(self, lm) -> None:
        self._stats = self.load(lm)

    def load(self, lm) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics for `lm`, checked against its shape; a missing artifact names the command that makes it."""
        folder = calibrated_folder(lm, self.name, "expected-attention", self.stats_folder, "query statistics")
        mean, covariance = read_artifact(lm, folder, "query statistics", lambda found: tuple(
            load_query_statistics(found)[name].to(lm.device) for name in ("query_mean", "query_cov")))
        expected = (lm.num_layers, lm.model.config.num_attention_heads, lm.head_dim)
        shape = tuple(mean.shape)
        if shape != expected:
            raise KvbenchError(f"policy '{self.name}': the statistics in {folder} are {shape} (layers, heads, "
                               f"head_dim); {lm.spec} needs {expected}")
        return mean, covariance

    def observe(self, layer, query, key, scaling, phase) -> None:
        layer.layer_stats[self.state_key] = scaling  # all it needs of the queries

    def statistics(self, layer) -> tuple[torch.Tensor, torch.Tensor, float]:
        if self._stats is None:
            raise KvbenchError(f"policy '{self.name}' reads its statistics when a session is made (prepare)")
        batch = layer.live_keys().shape[0]
        mean, covariance = (stat[layer.layer_idx].float() for stat in self._stats)
        return (mean.expand(batch, *mean.shape), covariance.expand(batch, *covariance.shape),
                layer.layer_stats[self.state_key])
