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
# float32 logits in one chunk of `attention_probs` (its softmax holds as many again). On CPU 4 Mi elements
# (16 MiB): at 8k tokens and 32 heads a chunk holds 16 queries, and chunks that fit the caches beat larger ones
# (Llama-3-8B heads, 4k tokens, 2 cores: 0.65 s a layer at 4 Mi, 0.93 s at 16 Mi). On a GPU an eighth of the
# free memory, between that and GPU_MAX_CHUNK_ELEMENTS (1 GiB): few, large chunks keep the device busy.
MAX_CHUNK_ELEMENTS = 1 << 22
GPU_MAX_CHUNK_ELEMENTS = 1 << 28


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


def chunk_elements(device: torch.device) -> int:
    """The logits budget of one `attention_probs` chunk on `device`, in float32 elements (see above)."""
    if device.type == "cuda":
        free_elements = torch.cuda.mem_get_info(device)[0] // (8 * 4)
        return max(MAX_CHUNK_ELEMENTS, min(GPU_MAX_CHUNK_ELEMENTS, free_elements))
    return MAX_CHUNK_ELEMENTS


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
    A chunk holds as many queries as `chunk_elements` allows; each KV head's query heads are stacked along the
    query dimension, so one matmul per chunk reads the float32 keys in place (no per-group copy of them).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    keys_t = key.float().transpose(-1, -2)  # [B, kv, D, n], converted once
    chunk = max(1, chunk_elements(key.device) // (batch * heads * n))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        size, visible = stop - start, n - q_len + stop
        q_chunk = query[:, :, start:stop].float().reshape(batch, kv_heads, group * size, head_dim)
        logits = ((q_chunk * scaling) @ keys_t[..., :visible]).view(batch, kv_heads, group, size, visible)
        if size > 1:  # causal mask: only the chunk's own trailing block has masked slots
            block = logits[..., visible - size :]
            block.masked_fill_(torch.ones(size, size, dtype=torch.bool, device=key.device).triu(1), float("-inf"))
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
