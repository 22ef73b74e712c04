"""The `kvbench` attention implementation: transformers' own SDPA path, plus the attention
statistics that attention-scored policies (H2O, SnapKV, ...) read, and a sparse policy's (Quest's) selection of
the slots each decode step reads (`KVCache.read_mask`, applied as a mask: every entry stays in the cache).

SDPA never returns attention weights, so the policies that need them get them recomputed here,
chunked over queries so a long prompt never materialises its full n x n matrix. Policies that do
not score by attention (window, streaming_llm, full) never pay for it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvbench.engine.joint import JointCache
from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.engine.cache import LayerKV

ATTENTION_NAME = "kvbench"
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
# float32 logits in one chunk of `attention_probs` (its softmax holds as many again). On CPU 4 Mi elements
# (16 MiB): at 8k tokens and 32 heads a chunk holds 16 queries, and chunks that fit the caches beat larger ones
# (Llama-3-8B heads, 4k tokens, 2 cores: 0.65 s a layer at 4 Mi, 0.93 s at 16 Mi). On a GPU an eighth of the
# free memory, between that and GPU_MAX_CHUNK_ELEMENTS (1 GiB): few, large chunks keep the device busy.
MAX_CHUNK_ELEMENTS = 1 << 22
GPU_MAX_CHUNK_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class LayerKind:
    """How one of the model's layers attends, as far as kvbench must follow it."""

    window: int | None = None  # a sliding layer: each query sees the last `window` positions (itself included)
    softcap: float | None = None  # logits soft-capped to cap * tanh(logits / cap) (Gemma-2): SDPA cannot

    @property
    def name(self) -> str:
        return "full" if self.window is None else "sliding"


FULL = LayerKind()


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
    scaling = scaling if scaling is not None else cast(float, module.scaling)
    if isinstance(observer, JointCache):  # a joint step: each row attends over its own cache, as it does alone
        rows = observer.row_entries(cast(int, module.layer_idx))
        return torch.cat([kvbench_attention(module, query[row : row + 1], keys, values, None, scaling,
                                            **{**kwargs, "kv_observer": cache})[0]
                          for row, (cache, keys, values) in enumerate(rows)]), None
    if observer is not None and observer.static:  # a decode step on static buffers (kvbench/engine/step.py)
        layer = observer.layers[module.layer_idx]
        _check_kind(module, layer.kind, kwargs)
        if observer.keeps_step_weights:
            layer.step_weights = query_weights(layer, query, key, scaling)
        if layer.slots.exact:  # the prefix its entries fill, unmasked: the stock attention, bit for bit
            attended = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)[0] \
                if layer.kind.softcap is None else eager_attention(query, key, value, None, scaling, layer.kind.softcap)
        else:
            attended = static_attention(query, key, value, layer, scaling)
        if observer.observing:
            observer.observe(module.layer_idx, query, key, scaling)
        return attended, None
    if observer is None:  # a stock cache (slots are positions): transformers' mask is right, only softcap is ours
        kind, padding = LayerKind(softcap=kwargs.get("softcap")), None
    else:
        layer = observer.layers[module.layer_idx]
        kind, padding = layer.kind, layer.padding()
        _check_kind(module, kind, kwargs)
    if kind.window is not None and observer is not None:
        # slots are not in position order once entries moved: the window is applied to true positions
        attention_mask = sliding_mask(layer, kind.window, query.shape[-2], query.shape[1])
        if padding is not None:
            attention_mask = attention_mask & ~_per_query_head(padding, query.shape[1]) | _diagonal(attention_mask)
    elif padding is not None:
        # heads hold uneven counts (Ada-KV) or rows are left-padded (a batch): queries skip padding slots, but a
        # padding query still sees itself, so no row is fully masked (SDPA would return NaN and spread it)
        causal = causal_mask(query.shape[-2], key.shape[-2], key.device)
        attention_mask = causal & ~_per_query_head(padding, query.shape[1]) | _diagonal(causal)
    elif attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        # layers of one cache hold different lengths (per-layer budgets, sliding layers) but transformers builds
        # one mask, sized by one layer: rebuild it for this layer (the new queries are the last slots; batch 1)
        attention_mask = causal_mask(query.shape[-2], key.shape[-2], key.device)
    elif attention_mask is None and kind.softcap is not None and query.shape[-2] > 1:
        attention_mask = causal_mask(query.shape[-2], key.shape[-2], key.device)  # SDPA's is_causal, made explicit
    read = None if observer is None else observer.read_mask(module.layer_idx, query)
    if read is not None:  # a sparse policy's decode step: the query attends to the slots it selected only
        attention_mask = read[:, :, None, :] if attention_mask is None else attention_mask & read[:, :, None, :]
    if kind.softcap is not None:
        output = eager_attention(query, key, value, attention_mask, scaling, kind.softcap), None
    else:
        output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if observer is not None:
        if observer.observing:
            observer.observe(module.layer_idx, query, key, scaling)
        observer.slide(module.layer_idx)
    return output


def static_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: LayerKV,
                     scaling: float) -> torch.Tensor:
    """A static decode step's attention: each row's one query `[B, heads, 1, D]` over every slot of the step
    (`key`, `value` `[B, kv_heads, n, D]`), the free ones and those outside a sliding window masked. Each KV head's
    query heads are stacked as its queries, so the keys are read once, in place, by torch's own kernel. Returns
    `[B, 1, heads, D]`, as transformers' attention functions do."""
    batch, heads, _, dim = query.shape
    stacked = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    visible = step_visible(layer)[:, :, None, :]
    if layer.kind.softcap is not None:  # logits in the model dtype, as the model's own eager attention
        output = eager_attention(stacked, key, value, visible.expand(-1, -1, stacked.shape[2], -1), scaling,
                                 layer.kind.softcap).transpose(1, 2)
    else:
        output = F.scaled_dot_product_attention(stacked, key, value, attn_mask=visible, scale=scaling)
    return output.reshape(batch, 1, heads, value.shape[-1])


def _step_weights(stacked: torch.Tensor, key: torch.Tensor, visible: torch.Tensor | None, scaling: float,
                  softcap: float | None) -> torch.Tensor:
    """Softmax weights `[B, kv_heads, group, n]` in float32 of the stacked queries `[B, kv_heads, group, D]`."""
    logits = torch.matmul(float32(stacked), float32(key).transpose(-1, -2)).mul(scaling)
    if softcap is not None:
        logits = logits.div(softcap).tanh().mul(softcap)
    return (logits if visible is None else torch.where(visible, logits, float("-inf"))).softmax(dim=-1)


def float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in float32, with no op dispatched when it already is."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def step_visible(layer: LayerKV) -> torch.Tensor:
    """`[B, kv_heads, n]`: the slots a static step's query sees, its free ones not, nor on a sliding layer those it
    left behind."""
    padding, position = layer.padding(), layer.owner.position
    assert padding is not None and position is not None, "a static step marks its free slots"
    visible = ~padding
    if layer.kind.window is not None:
        visible = visible & (layer.live_positions() > position - layer.kind.window)
    return visible


def query_visible(layer: LayerKV) -> torch.Tensor:
    """`[B, kv_heads, n]`: the slots the newest query sees (the last of the slots, on the dynamic layout)."""
    if layer.static is not None:
        return step_visible(layer)
    positions = layer.live_positions()
    padding = layer.padding()
    visible = torch.ones_like(positions, dtype=torch.bool) if padding is None else ~padding
    if layer.kind.window is not None:
        visible = visible & window_visible(positions, positions[..., -1:], layer.kind.window)[..., 0, :]
    return visible


def query_weights(layer: LayerKV, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """The newest query's attention weights `[B, kv_heads, group, n]` (float32) over `key` `[B, kv_heads, n, D]`:
    each of a KV head's query heads over the slots it sees, as `attention_probs` gives them; a static step's are
    its attention's own."""
    if layer.step_weights is not None:
        return layer.step_weights
    if layer.static is not None:
        stacked = query.reshape(key.shape[0], key.shape[1], -1, query.shape[-1])
        visible = None if layer.static.exact else step_visible(layer)[:, :, None, :]
        return _step_weights(stacked, key, visible, scaling, layer.kind.softcap)
    (_, probs), = attention_probs(query[:, :, -1:], key, scaling, layer.padding(), layer.kind, layer.live_positions())
    return probs[:, :, :, 0]


def received_by(layer: LayerKV, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """`attention_received` over `layer`'s slots: `[B, kv_heads, n]` the attention each slot received from the
    queries (those of a static step: its one query)."""
    if layer.static is not None:
        return query_weights(layer, query, key, scaling).mean(dim=2)
    return attention_received(query, key, scaling, layer.padding(), layer.kind, layer.live_positions())


def _check_kind(module: torch.nn.Module, kind: LayerKind, kwargs: dict) -> None:
    """The model's own attention says how this layer attends: it must be what the cache was built for."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if (window, softcap) != (kind.window, kind.softcap):
        raise KvbenchError(f"{type(module).__name__} layer {module.layer_idx} attends with sliding_window={window}, "
                           f"softcap={softcap}, but its config says {kind.window}, {kind.softcap}: kvbench cannot "
                           f"drive this model (supported: full and sliding_attention layers, soft-capped logits)")
    for name in UNSUPPORTED_ATTENTION_TERMS:
        if kwargs.get(name) is not None:
            raise KvbenchError(f"{type(module).__name__} attends with {name} ({UNSUPPORTED_ATTENTION_TERMS[name]}): "
                               f"not supported by kvbench (supported: causal softmax attention, sliding windows, "
                               f"soft-capped logits)")


# what some models add to their attention and kvbench cannot follow
UNSUPPORTED_ATTENTION_TERMS = {"s_aux": "attention sinks", "position_bias": "a relative position bias"}


def _per_query_head(per_kv_head: torch.Tensor, heads: int) -> torch.Tensor:
    """`[B, kv_heads, n]` slot flags as a `[B, heads or 1, 1, n]` mask term."""
    return per_kv_head.repeat_interleave(heads // per_kv_head.shape[1], dim=1)[:, :, None, :]


def _diagonal(mask: torch.Tensor) -> torch.Tensor:
    """Each query's own slot (the last one it sees) in a `[.., q, n]` mask: the new queries are the last slots."""
    queries, keys = mask.shape[-2:]
    return (torch.arange(keys, device=mask.device)[None, :]
            == torch.arange(queries, device=mask.device)[:, None] + (keys - queries))[None, None]


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, q, n]` boolean: the q new queries are the last q of n slots and see every older slot."""
    last_visible = torch.arange(queries, device=device) + (keys - queries)
    return (torch.arange(keys, device=device)[None, :] <= last_visible[:, None])[None, None]


def window_visible(key_positions: torch.Tensor, query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys each query of a sliding layer sees: `key_positions` `[..., n]`, `query_positions` `[..., q]` (true
    positions, any slot order) -> `[..., q, n]`: not later than the query and fewer than `window` before it."""
    keys, queries = key_positions[..., None, :], query_positions[..., :, None]
    return (keys <= queries) & (keys > queries - window)


def sliding_mask(layer: LayerKV, window: int, queries: int, heads: int) -> torch.Tensor:
    """`[B, 1 or heads, q, n]` boolean mask of a sliding layer's attention (`window`, its kind's) from its slots'
    true positions. The new queries are the last `queries` slots; one row serves every head until a policy evicted
    per head."""
    positions = layer.live_positions()
    if layer.heads_share_positions:
        positions = positions[:, :1]
    visible = window_visible(positions, positions[..., -queries:], window)
    return visible.repeat_interleave(heads // visible.shape[1], dim=1)


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float, softcap: float | None) -> torch.Tensor:
    """Softmax attention written out (the model's eager path: logits in the model dtype, soft-capped, masked,
    softmax in float32, no dropout) for what SDPA cannot express; `mask` `[B, 1 or heads, q, n]` boolean, None:
    the single query sees everything. Chunked over queries like `attention_probs`, each KV head's query heads
    stacked so the keys are read in place. Returns `[B, q, heads, D]`, as transformers' attention functions do."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    output = query.new_empty(batch, heads, q_len, value.shape[-1])
    chunk = queries_per_chunk(batch, heads, q_len, n, key.device)
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        q_chunk = query[:, :, start:stop].reshape(batch, kv_heads, group * (stop - start), head_dim)
        logits = (q_chunk @ key.transpose(-1, -2)).view(batch, kv_heads, group, stop - start, n) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is not None:
            visible = mask[..., start:stop, :]
            if visible.shape[1] > 1:  # a row per query head: each KV head's group together
                visible = visible.reshape(batch, kv_heads, group, stop - start, n)
            else:
                visible = visible[:, :, None]
            logits = logits.masked_fill(~visible, float("-inf"))
        weights = logits.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        output[:, :, start:stop] = (weights.view(batch, kv_heads, group * (stop - start), n) @ value).view(
            batch, heads, stop - start, -1)
    return output.transpose(1, 2).contiguous()


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, kvbench_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def record_attention_inputs(model: Any) -> None:
    """Make each attention module of `model` hand the hidden states it projects its queries, keys and values from
    (`[batch, new tokens, hidden]`, after the layer's input norm) to the layer of the kvbench cache it runs with, as
    `LayerKV.attention_input`, while that cache's observers run (KVzap scores them, KVzip+ divides by their norm).
    Installed once per model; a forward without an observing kvbench cache is left as it is."""
    if getattr(model, "_kvbench_attention_inputs", False):
        return
    for decoder_layer in model.model.layers:
        decoder_layer.self_attn.register_forward_pre_hook(_hand_attention_input, with_kwargs=True)
    model._kvbench_attention_inputs = True


def _hand_attention_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    observer = kwargs.get("kv_observer")
    if isinstance(observer, JointCache):  # a joint step: each row's attention runs with that row's own cache
        caches = [(cache, hidden[row : row + 1]) for row, cache in enumerate(observer.members)]
    else:
        caches = [] if observer is None else [(observer, hidden)]
    for cache, rows in caches:
        if cache.observing:
            cache.layers[cast(int, module.layer_idx)].attention_input = rows


def chunk_elements(device: torch.device) -> int:
    """The logits budget of one `attention_probs` chunk on `device`, in float32 elements (see above)."""
    if device.type == "cuda":
        free_elements = torch.cuda.mem_get_info(device)[0] // (8 * 4)
        return max(MAX_CHUNK_ELEMENTS, min(GPU_MAX_CHUNK_ELEMENTS, free_elements))
    return MAX_CHUNK_ELEMENTS


def queries_per_chunk(batch: int, heads: int, queries: int, keys: int, device: torch.device) -> int:
    """Queries of one chunk of logits; a chunk that fits the CPU budget asks the device nothing (no host sync)."""
    if batch * heads * queries * keys <= MAX_CHUNK_ELEMENTS:
        return queries
    return max(1, chunk_elements(device) // (batch * heads * keys))


def attention_probs(
    query: torch.Tensor, key: torch.Tensor, scaling: float, padding: torch.Tensor | None = None,
    kind: LayerKind = FULL, positions: torch.Tensor | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Softmax attention of `query` `[B, heads, q, D]` to `key` `[B, kv_heads, n, D]`, chunk by chunk.

    The q queries are the newest q of the n slots (as right after a cache update), so query i sees
    slots j <= n - q + i. Yields `(first_query_index, probs)` with probs `[B, kv_heads, group, c, v]`
    in float32, where group = heads // kv_heads are the query heads sharing one KV head and v <= n
    are the slots visible to the chunk's last query (the rest are causally masked: zero anyway).
    `padding` `[B, kv_heads, n]` marks slots no query attends (a left-padded batch): they get zero, and a
    padding query's row is all zero. A layer `kind` with a window needs the slots' true `positions`
    `[B, kv_heads, n]` (any slot order): a query sees only the keys within its window; soft-capped logits are
    capped as the model caps them.
    A chunk holds as many queries as `chunk_elements` allows; each KV head's query heads are stacked along the
    query dimension, so one matmul per chunk reads the float32 keys in place (no per-group copy of them).
    Every chunk's logits are written into one buffer, allocated once per call (a fresh chunk-sized block per
    chunk costs page faults on every chunk on CPU), and the softmax overwrites them in place (its kernels read a
    row before writing it; one buffer instead of two keeps more of a chunk in the CPU's cache):
    `probs` is valid until the next chunk is asked for, so a caller reduces or copies it first.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    keys_t = key.float().transpose(-1, -2)  # [B, kv, D, n], converted once
    chunk = min(q_len, queries_per_chunk(batch, heads, q_len, n, key.device))
    largest = batch * heads * chunk * n
    buffer = torch.empty(largest, dtype=torch.float32, device=key.device)
    # the causal mask of a chunk's own trailing block, the same for every chunk (the last one's is its corner)
    ahead = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).triu(1) if chunk > 1 else None
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        size, visible = stop - start, n - q_len + stop
        shape = (batch, kv_heads, group, size, visible)
        elements = batch * heads * size * visible
        q_chunk = query[:, :, start:stop].float().mul(scaling).reshape(batch, kv_heads, group * size, head_dim)
        logits = torch.matmul(q_chunk, keys_t[..., :visible],
                              out=buffer[:elements].view(batch, kv_heads, group * size, visible)).view(shape)
        if kind.softcap is not None:
            logits.div_(kind.softcap).tanh_().mul_(kind.softcap)
        _mask_unseen(logits, ahead, kind, positions, padding)
        probs = torch.softmax(logits, dim=-1, out=logits)
        yield start, probs if padding is None else probs.nan_to_num_(0.0)


def _mask_unseen(logits: torch.Tensor, ahead: torch.Tensor | None, kind: LayerKind, positions: torch.Tensor | None,
                 padding: torch.Tensor | None) -> None:
    """Set to -inf, in place, the logits `[B, kv_heads, group, c, v]` of a chunk's c queries (the newest of the v
    slots they may see) for the slots a query does not see: later slots (`ahead`: the causal mask of a chunk's
    trailing block), slots outside a sliding layer's window, padding (`positions` and `padding` as
    `attention_probs` takes them)."""
    size, visible = logits.shape[3], logits.shape[4]
    if ahead is not None and size > 1:  # causal mask: only the chunk's own trailing block has masked slots
        logits[..., visible - size :].masked_fill_(ahead[:size, :size], float("-inf"))
    if kind.window is not None:
        assert positions is not None, "a sliding layer's statistics need its slots' positions"
        seen = positions[..., :visible]
        query_positions = positions[..., visible - size : visible]
        logits.masked_fill_(~window_visible(seen, query_positions, kind.window)[:, :, None], float("-inf"))
    if padding is not None:
        logits.masked_fill_(padding[:, :, None, None, :visible], float("-inf"))


def attention_received(query: torch.Tensor, key: torch.Tensor, scaling: float,
                       padding: torch.Tensor | None = None, kind: LayerKind = FULL,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention each slot received, summed over the queries and averaged over each KV head's
    query heads: `[B, kv_heads, n]` (the H2O accumulation step); `kind` and `positions` as `attention_probs`.
    Each chunk's sum over its queries and mean over the group is one matrix-vector product (a BLAS call reading
    the probs once) instead of a strided reduction and a mean. On a GPU, a prompt's (more than one query, on a
    layer that neither slides nor caps its logits) comes from `received_kernel`, which stores no weight."""
    if key.is_cuda and kind == FULL and query.shape[2] > 1 and TRITON_INSTALLED:
        # imported here, so Triton loads with the first statistics a GPU computes, never on a CPU
        from kvbench.engine.received_kernel import attention_received_kernel

        return attention_received_kernel(query, key, scaling, padding)
    batch, kv_heads, n = key.shape[:3]
    group = query.shape[1] // kv_heads
    total = torch.zeros(batch, kv_heads, 1, n, dtype=torch.float32, device=key.device)
    weights = None
    for _, probs in attention_probs(query, key, scaling, padding, kind, positions):
        rows, visible = group * probs.shape[3], probs.shape[-1]
        if weights is None:  # the first chunk is the largest
            weights = torch.full((batch, kv_heads, 1, rows), 1.0 / group, dtype=torch.float32, device=key.device)
        total[..., :visible] += torch.matmul(weights[..., :rows], probs.view(batch, kv_heads, rows, visible))
    return total.view(batch, kv_heads, n)
