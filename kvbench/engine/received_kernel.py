"""The attention each slot received from a prompt's queries, on a GPU, without the attention matrix: H2O's
prefill statistic (`attention.attention_received`) in two Triton kernels, both blockwise, so memory is O(context).

1. `_row_logsumexp`: each query's log-sum-exp over the slots it sees, one block of keys at a time, online as flash
   attention's forward keeps it (without the values).
2. `_column_sums`: each block of keys against every query that sees it: exp(logit - lse) is the softmax weight, and
   the block sums it over the queries and averages it over the KV head's query heads, never storing a weight.

A chunked softmax writes every float32 logit to memory and reads it back several times: at 32k tokens and 32 heads,
64 GiB per layer, which bounds its time on a GPU. Here the logits live in registers, and the dot products run on
tensor cores where the model's dtype allows: a 16-bit model's products are exact in the float32 accumulator, a
float32 model's dot is IEEE. The logits are the chunked path's up to rounding (the order of the sums, the scale
applied after the product rather than to the query).

Torch has no kernel for a softmax's column sums (its attention kernels return a row log-sum-exp at most), hence
these. Triton is imported by this module alone, which `attention` loads only for a CUDA tensor; the tests run the
kernels on CPU under `TRITON_INTERPRET=1` (tests/test_received_kernel.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = 1.0 / math.log(2.0)  # the kernels work in base 2 (exp2, log2): the logits are scaled by log2(e) once
BLOCK = 64  # queries or keys per block: 64 x 64 float32 logits per program, the shape flash attention's kernels use


@triton.jit
def _row_logsumexp(query, key, padding, lse,
                   query_b, query_h, query_m, query_d, key_b, key_h, key_n, key_d, padding_b, padding_h,
                   heads, queries, slots, scale_log2,
                   GROUP: tl.constexpr, DIM: tl.constexpr, HAS_PADDING: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """lse[b * heads + h, i] = log2 sum_j 2^(logit_ij): query i of head h over the slots j it sees."""
    block, row_head = tl.program_id(0), tl.program_id(1)
    row, head = (row_head // heads).to(tl.int64), row_head % heads  # a batch's queries pass 2^31 elements
    kv_head = head // GROUP
    offset = slots - queries  # query i is the slot offset + i: it sees the slots j <= offset + i
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(query + row * query_b + head * query_h + rows[:, None] * query_m + dims[None, :] * query_d,
                mask=(rows[:, None] < queries) & (dims[None, :] < DIM), other=0.0)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    # the block's last query sees up to the slot offset + its index; slots past the last are masked below
    for start in range(0, offset + (block + 1) * BLOCK_M, BLOCK_N):
        columns = start + tl.arange(0, BLOCK_N)
        k = tl.load(key + row * key_b + kv_head * key_h + columns[:, None] * key_n + dims[None, :] * key_d,
                    mask=(columns[:, None] < slots) & (dims[None, :] < DIM), other=0.0)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        seen = (columns[None, :] <= offset + rows[:, None]) & (columns[None, :] < slots)
        if HAS_PADDING:
            padded = tl.load(padding + row * padding_b + kv_head * padding_h + columns, mask=columns < slots, other=1)
            seen = seen & (padded[None, :] == 0)
        logits = tl.where(seen, logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that has seen nothing yet stays at 0
        total = total * tl.exp2(top - shift) + tl.sum(tl.exp2(logits - shift[:, None]), 1)
        top = new_top
    # a row that saw no slot (all padding) has the log-sum-exp of nothing: -inf
    empty = total == 0.0
    tl.store(lse + row_head * queries + rows, tl.where(empty, float("-inf"), top + tl.log2(total + empty)),
             mask=rows < queries)


@triton.jit
def _column_sums(query, key, padding, lse, received,
                 query_b, query_h, query_m, query_d, key_b, key_h, key_n, key_d, padding_b, padding_h,
                 kv_heads, queries, slots, scale_log2,
                 GROUP: tl.constexpr, DIM: tl.constexpr, HAS_PADDING: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """received[b, kv, j] = mean over kv's query heads h of sum_i 2^(logit_ij - lse[b * heads + h, i])."""
    block, row_kv = tl.program_id(0), tl.program_id(1)
    row, kv_head = (row_kv // kv_heads).to(tl.int64), row_kv % kv_heads
    offset = slots - queries
    columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = tl.load(key + row * key_b + kv_head * key_h + columns[:, None] * key_n + dims[None, :] * key_d,
                mask=(columns[:, None] < slots) & (dims[None, :] < DIM), other=0.0)
    kept = columns >= 0
    if HAS_PADDING:
        kept = tl.load(padding + row * padding_b + kv_head * padding_h + columns, mask=columns < slots, other=1) == 0
    total = tl.zeros([BLOCK_N], tl.float32)
    first = tl.maximum(block * BLOCK_N - offset, 0)  # the first query that sees the block's first slot
    for member in range(GROUP):
        head = kv_head * GROUP + member
        for start in range(first, queries, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q = tl.load(query + row * query_b + head * query_h + rows[:, None] * query_m + dims[None, :] * query_d,
                        mask=(rows[:, None] < queries) & (dims[None, :] < DIM), other=0.0)
            norm = tl.load(lse + (row * kv_heads * GROUP + head) * queries + rows, mask=rows < queries,
                           other=float("-inf"))
            logits = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
            # a query that saw no slot (all padding) has lse -inf and gives nothing, as its all-zero softmax row
            seen = (columns[:, None] <= offset + rows[None, :]) & (norm[None, :] > float("-inf")) & kept[:, None]
            total += tl.sum(tl.where(seen, tl.exp2(logits - norm[None, :]), 0.0), 1)
    tl.store(received + row_kv * slots + columns, total / GROUP, mask=columns < slots)


def attention_received_kernel(query: torch.Tensor, key: torch.Tensor, scaling: float,
                              padding: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """`attention.attention_received` for a layer with neither a window nor soft-capped logits: `[B, kv_heads, n]`
    float32, the attention each of `key`'s n slots `[B, kv_heads, n, D]` received from `query` `[B, heads, q, D]`
    (the newest q slots), summed over the queries and averaged over each KV head's query heads; `padding`
    `[B, kv_heads, n]` marks slots no query sees. `block` is the queries and keys of one block (16 at least)."""
    batch, heads, queries, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    key = key.to(query.dtype)
    lse = torch.empty(batch * heads, queries, dtype=torch.float32, device=query.device)
    received = torch.empty(batch, kv_heads, slots, dtype=torch.float32, device=query.device)
    marks = received if padding is None else padding.contiguous().view(torch.uint8)
    # the tensor cores' float32 mode (tf32) would round a float32 model's inputs; 16-bit inputs are exact in it
    shared = dict(GROUP=heads // kv_heads, DIM=dim, HAS_PADDING=padding is not None,
                  PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                  BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, triton.next_power_of_2(dim)))
    strides = (*query.stride(), *key.stride(), *(marks.stride()[:2] if padding is not None else (0, 0)))
    _row_logsumexp[(triton.cdiv(queries, block), batch * heads)](
        query, key, marks, lse, *strides, heads, queries, slots, scaling * LOG2_E, **shared)
    _column_sums[(triton.cdiv(slots, block), batch * kv_heads)](
        query, key, marks, lse, received, *strides, kv_heads, queries, slots, scaling * LOG2_E, **shared)
    return received
