"""The `kvbench` attention implementation: transformers' own SDPA path, plus the attention
statistics that attention-scored policies (H2O, SnapKV, ...) read.

SDPA never returns attention weights, so the policies that need them get them recomputed here,
chunked over queries so a long prompt never materialises its full n x n matrix. Policies that do
not score by attention (window, streaming_llm, full) never pay for it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "kvbench"
# bound on one chunk of attention probabilities (float32 elements, 4 MiB): small chunks stay in cache
MAX_CHUNK_ELEMENTS = 1 << 20


def kvbench_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    observer = kwargs.get("kv_observer")
    padding = None if observer is None else observer.padding(module.layer_idx)
    if padding is not None:
        # heads hold uneven counts (Ada-KV) or rows are left-padded (a batch): queries skip padding slots, but a
        # padding query still sees itself, so no row is fully masked (SDPA would return NaN and spread it)
        group = query.shape[1] // key.shape[1]
        causal = causal_mask(query.shape[-2], key.shape[-2], key.device)
        attention_mask = causal & ~padding.repeat_interleave(group, dim=1)[:, :, None, :] | _diagonal(causal)
    elif attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        # layers of one cache hold different lengths (per-layer budgets) but transformers builds one mask, sized
        # by layer 0: rebuild it for this layer (the new queries are the last slots; batch 1, no padding)
        attention_mask = causal_mask(query.shape[-2], key.shape[-2], key.device)
    output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if observer is not None and observer.observing:
        observer.observe(module.layer_idx, query, key, scaling if scaling is not None else module.scaling)
    return output


def _diagonal(causal: torch.Tensor) -> torch.Tensor:
    """Each query's own slot (the last one it sees) in a causal mask."""
    queries, keys = causal.shape[-2:]
    return (torch.arange(keys, device=causal.device)[None, :]
            == torch.arange(queries, device=causal.device)[:, None] + (keys - queries))[None, None]


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, q, n]` boolean: the q new queries are the last q of n slots and see every older slot."""
    last_visible = torch.arange(queries, device=device) + (keys - queries)
    return (torch.arange(keys, device=device)[None, :] <= last_visible[:, None])[None, None]


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, kvbench_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def attention_probs(
    query: torch.Tensor, key: torch.Tensor, scaling: float, padding: torch.Tensor | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Softmax attention of `query` `[B, heads, q, D]` to `key` `[B, kv_heads, n, D]`, chunk by chunk.

    The q queries are the newest q of the n slots (as right after a cache update), so query i sees
    slots j <= n - q + i. Yields `(first_query_index, probs)` with probs `[B, kv_heads, group, c, v]`
    in float32, where group = heads // kv_heads are the query heads sharing one KV head and v <= n
    are the slots visible to the chunk's last query (the rest are causally masked: zero anyway).
    `padding` `[B, kv_heads, n]` marks slots no query attends (a left-padded batch): they get zero, and a
    padding query's row is all zero.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    keys_t = key.float().transpose(-1, -2).unsqueeze(2)  # [B, kv, 1, D, n]
    chunk = max(1, MAX_CHUNK_ELEMENTS // (batch * heads * n))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        visible = n - q_len + stop
        q_chunk = query[:, :, start:stop].float().reshape(batch, kv_heads, group, stop - start, head_dim)
        logits = (q_chunk * scaling) @ keys_t[..., :visible]
        if stop - start > 1:  # causal mask: only the chunk's own trailing block has masked slots
            block = logits[..., visible - (stop - start) :]
            block.masked_fill_(torch.ones(block.shape[-2:], dtype=torch.bool, device=key.device).triu(1), float("-inf"))
        if padding is None:
            yield start, logits.softmax(dim=-1)
            continue
        logits.masked_fill_(padding[:, :, None, None, :visible], float("-inf"))
        yield start, logits.softmax(dim=-1).nan_to_num(0.0)


def attention_received(query: torch.Tensor, key: torch.Tensor, scaling: float,
                       padding: torch.Tensor | None = None) -> torch.Tensor:
    """Attention each slot received, summed over the queries and averaged over each KV head's
    query heads: `[B, kv_heads, n]` (the H2O accumulation step)."""
    total = torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device)
    for _, probs in attention_probs(query, key, scaling, padding):
        total[..., : probs.shape[-1]] += probs.sum(dim=3).mean(dim=2)
    return total
