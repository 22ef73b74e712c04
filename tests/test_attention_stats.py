"""`attention_probs` and `attention_received` against one unchunked softmax written from the definition."""

from __future__ import annotations

import pytest
import torch

from kvbench.checks.tolerance import sum_roundings
from kvbench.engine import attention
from tests.helpers import assert_close

HEADS, KV_HEADS, QUERIES, SLOTS, DIM, SCALING = 6, 2, 10, 25, 8, 0.3
GROUP = HEADS // KV_HEADS


def reference(query, key, padding=None, scaling=SCALING) -> torch.Tensor:
    """`[B, heads, q, n]`: logits = q k^T * scaling, query i sees slots j <= n - q + i that are not padding,
    softmax; query head h reads KV head h // group; a query that sees nothing (a padding one) gets zeros."""
    (batch, heads, q_len), n, group = query.shape[:3], key.shape[2], query.shape[1] // key.shape[1]
    logits = torch.einsum("bhqd,bhnd->bhqn", query, key.repeat_interleave(group, dim=1)) * scaling
    visible = (torch.arange(n)[None, :] <= (torch.arange(q_len) + n - q_len)[:, None]).expand(batch, heads, -1, -1)
    if padding is not None:
        visible = visible & ~padding.repeat_interleave(group, dim=1)[:, :, None, :]
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.where(visible.any(-1, keepdim=True), probs, 0.0)


def assert_probs_close(actual, expected, query, key, reduced: int = 0, scaling: float = SCALING) -> None:
    """Probabilities of logits q.k * scaling computed in another order: a logit's rounding (D terms, at the largest
    logit's size) moves a probability by as much, the softmax's sum over the n slots adds its own, a column sum or a
    mean `reduced` more."""
    group = query.shape[1] // key.shape[1]
    logits = torch.einsum("bhqd,bhnd->bhqn", query.float(), key.float().repeat_interleave(group, dim=1)) * scaling
    assert_close(actual, expected, roundings=sum_roundings(query.shape[-1] + key.shape[2] + reduced),
                 floor=float(logits.abs().max()))


def rebuilt(query, key, padding=None) -> torch.Tensor:
    """The chunks of `attention_probs` put back into one `[B, heads, q, n]` matrix."""
    batch = query.shape[0]
    whole = torch.zeros(batch, KV_HEADS, GROUP, QUERIES, SLOTS)
    covered = torch.zeros(QUERIES, dtype=torch.int64)
    for start, probs in attention.attention_probs(query, key, SCALING, padding):
        assert probs.dtype == torch.float32 and probs.shape[:3] == (batch, KV_HEADS, GROUP)
        whole[..., start : start + probs.shape[3], : probs.shape[-1]] = probs
        covered[start : start + probs.shape[3]] += 1
    assert covered.eq(1).all()  # every query in exactly one chunk
    return whole.reshape(batch, HEADS, QUERIES, SLOTS)


def inputs(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HEADS, QUERIES, DIM, generator=generator),
            torch.randn(batch, KV_HEADS, SLOTS, DIM, generator=generator))


def left_padding(batch: int) -> torch.Tensor:
    """`[B, kv_heads, n]`: row b starts with 3 * b padding slots (some of them among the queries)."""
    padding = torch.zeros(batch, KV_HEADS, SLOTS, dtype=torch.bool)
    for row in range(batch):
        padding[row, :, : 3 * row + (row > 1) * (SLOTS - QUERIES)] = True
    return padding


# queries per chunk: the chunk holds elements // (batch * heads * n) queries
CHUNKS = [1, 3, 4, QUERIES, 1000]


@pytest.mark.parametrize("queries_per_chunk", CHUNKS)
@pytest.mark.parametrize("padded", [False, True])
def test_chunked_probs_equal_one_softmax(monkeypatch, queries_per_chunk, padded):
    batch = 3
    monkeypatch.setattr(attention, "MAX_CHUNK_ELEMENTS", queries_per_chunk * batch * HEADS * SLOTS)
    query, key = inputs(batch, seed=queries_per_chunk)
    padding = left_padding(batch) if padded else None
    assert_probs_close(rebuilt(query, key, padding), reference(query, key, padding), query, key)


@pytest.mark.parametrize("queries_per_chunk", CHUNKS)
@pytest.mark.parametrize("padded", [False, True])
def test_attention_received_is_the_column_sums(monkeypatch, queries_per_chunk, padded):
    batch = 3
    monkeypatch.setattr(attention, "MAX_CHUNK_ELEMENTS", queries_per_chunk * batch * HEADS * SLOTS)
    query, key = inputs(batch, seed=100 + queries_per_chunk)
    padding = left_padding(batch) if padded else None
    probs = reference(query, key, padding)
    expected = probs.sum(dim=2).view(batch, KV_HEADS, GROUP, SLOTS).mean(dim=2)
    assert_probs_close(attention.attention_received(query, key, SCALING, padding), expected, query, key,
                       reduced=QUERIES + GROUP)


def test_half_precision_inputs_are_scored_in_float32():
    query, key = inputs(1, seed=7)
    expected = reference(query.bfloat16().float(), key.bfloat16().float())
    assert_probs_close(rebuilt(query.bfloat16(), key.bfloat16()), expected, query, key)  # scored in float32


def test_cpu_chunks_hold_many_queries_at_long_context():
    # 8k slots and 32 heads: the old 1 Mi-element bound gave 4 queries a chunk (1 at 32k)
    assert attention.chunk_elements(torch.device("cpu")) // (32 * 8192) >= 16


def capped_windowed_reference(query, key, positions, softcap, window, padding=None) -> torch.Tensor:
    """`reference` with soft-capped logits and a sliding window applied from the slots' true positions."""
    q_len, n = query.shape[2], key.shape[2]
    logits = torch.einsum("bhqd,bhnd->bhqn", query, key.repeat_interleave(GROUP, dim=1)) * SCALING
    logits = torch.tanh(logits / softcap) * softcap
    slot_causal = torch.arange(n)[None, :] <= (torch.arange(q_len) + n - q_len)[:, None]
    key_positions = positions.repeat_interleave(GROUP, dim=1)[:, :, None, :]
    query_positions = key_positions[..., -q_len:].transpose(-1, -2)
    visible = slot_causal & (key_positions <= query_positions) & (key_positions > query_positions - window)
    if padding is not None:
        visible = visible & ~padding.repeat_interleave(GROUP, dim=1)[:, :, None, :]
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.where(visible.any(-1, keepdim=True), probs, 0.0)


@pytest.mark.parametrize("queries_per_chunk", CHUNKS)
@pytest.mark.parametrize("padded", [False, True])
def test_softcapped_sliding_chunks_equal_one_softmax(monkeypatch, queries_per_chunk, padded):
    # every chunk is written into the same reused buffers: each must still be its own queries' attention
    batch, softcap, window = 3, 2.0, 7
    monkeypatch.setattr(attention, "MAX_CHUNK_ELEMENTS", queries_per_chunk * batch * HEADS * SLOTS)
    query, key = inputs(batch, seed=200 + queries_per_chunk)
    generator = torch.Generator().manual_seed(queries_per_chunk)
    older = torch.randperm(SLOTS - QUERIES, generator=generator)  # evictions moved the older entries around
    positions = torch.cat([older, torch.arange(SLOTS - QUERIES, SLOTS)]).expand(batch, KV_HEADS, SLOTS) + 100
    padding = left_padding(batch) if padded else None
    kind = attention.LayerKind(window=window, softcap=softcap)
    whole = torch.zeros(batch, KV_HEADS, GROUP, QUERIES, SLOTS)
    for start, probs in attention.attention_probs(query, key, SCALING, padding, kind, positions):
        whole[..., start : start + probs.shape[3], : probs.shape[-1]] = probs
    expected = capped_windowed_reference(query, key, positions, softcap, window, padding)
    assert_probs_close(whole.reshape(batch, HEADS, QUERIES, SLOTS), expected, query, key)  # capping shrinks errors
    received = attention.attention_received(query, key, SCALING, padding, kind, positions)
    assert_probs_close(received, expected.sum(dim=2).view(batch, KV_HEADS, GROUP, SLOTS).mean(dim=2), query, key,
                       reduced=QUERIES + GROUP)


def test_queries_laid_out_as_the_model_passes_them():
    # the model's queries are `[B, q, heads, D]` transposed to `[B, heads, q, D]`: not contiguous
    query, key = inputs(2, seed=300)
    transposed = query.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert_probs_close(rebuilt(transposed, key), reference(query, key), query, key)
