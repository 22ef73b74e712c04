"""Reference computations written from each policy's definition, independent of kvbench's engine: a stock
DynamicCache (slot index == position) that holds everything, attention masked to what a policy keeps, and each
policy's rule applied over positions. The test suite checks the policies against these on tiny models, and
`kvbench check` on the user's own model, dtype and device (kvbench/checks/suite.py), so they are bounded in memory:
the attention weights are written out in float32, chunk by chunk over the queries, keeping each layer's column
sums and the rows of the last queries only. A policy names its reference in its `reference` method (its file),
which is what makes it checkable."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "kvbench_reference"
# float32 logits of one chunk of queries (256 MiB): a 32k-token prompt never holds its n x n weights
CHUNK_ELEMENTS = 1 << 26
# what `Policy.reference` returns: the kept masks `[kv_heads, seen]` per layer after the prompt and after each decode
# token, and for a prompt-scoring policy each layer's scores `[kv_heads, n]` (ties in them may break either way)
Reference = tuple[list[list[torch.Tensor]], list[torch.Tensor] | None]


class ReferenceAttention:
    """Attention over all slots of a stock cache, where each layer's KV head may only see `allowed[layer]`
    `[kv_heads, n_old]` of the old slots. Per layer it records `weights` `[1, H, t, n]`, the attention of the last
    `tail` queries (all of them when `tail` is None), `received` `[1, H, n]`, the attention each slot received
    summed over every query, and the layer's sliding window. The model's own attention says how a layer attends:
    a `sliding_window` W lets a query see the W positions up to its own, a `softcap` caps the logits
    (cap * tanh(logits / cap)). The layer's output is SDPA's over the mask transformers built (the forward kvbench
    runs, so both see the same hidden states), over a boolean mask of the kept slots once a policy dropped some,
    and the model's eager path where logits are soft-capped (SDPA cannot cap them)."""

    def __init__(self, tail: int | None = None) -> None:
        self.tail = tail
        self.allowed: dict[int, torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] = {}
        self.received: dict[int, torch.Tensor] = {}
        self.windows: dict[int, int | None] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None,
                 **kwargs):
        if query.shape[0] != 1:
            raise ValueError("the reference attention runs one sequence at a time")
        layer, group = module.layer_idx, module.num_key_value_groups
        heads, q_len, n = query.shape[1], query.shape[2], key.shape[2]
        self.windows[layer] = sliding_window
        # a layer masks old slots once a policy dropped some (the prompt's forward sees everything)
        masked = layer in self.allowed and not bool(self.allowed[layer].all())
        keys, values = repeat_kv(key, group)[0], repeat_kv(value, group)[0]  # [H, n, D]
        keys_t = keys.float().transpose(-1, -2)
        tail = q_len if self.tail is None else min(q_len, self.tail)
        received = torch.zeros(heads, n, dtype=torch.float32, device=key.device)
        rows, outputs, masks = [], [], []
        chunk = max(1, CHUNK_ELEMENTS // (heads * n))
        for start in range(0, q_len, chunk):
            stop = min(q_len, start + chunk)
            visible = self._visible(layer, start, stop, q_len, n, sliding_window, group, key.device)
            logits = query[0, :, start:stop].float() @ keys_t * scaling  # [H, c, n]
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
            received += weights.sum(dim=1)
            if stop > q_len - tail:
                rows.append(weights[:, max(0, q_len - tail - start) :])
            if softcap is not None:  # the model's eager path: logits in its dtype, softmax in float32
                capped = torch.tanh(query[0, :, start:stop] @ keys.transpose(-1, -2) * scaling / softcap) * softcap
                probs = capped.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32)
                outputs.append(probs.to(value.dtype) @ values)
            elif masked:
                masks.append(visible.expand(heads, -1, -1))
        # the rules run on the CPU: a long prompt's weights leave the device as their last rows and column sums
        self.weights[layer], self.received[layer] = torch.cat(rows, dim=1)[None].cpu(), received[None].cpu()
        if outputs:
            return torch.cat(outputs, dim=1)[None].transpose(1, 2).contiguous(), None
        if masks:  # SDPA over the kept slots: the kernel kvbench's own attention runs
            attention_mask = torch.cat(masks, dim=1)[None]
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)

    def _visible(self, layer: int, start: int, stop: int, q_len: int, n: int, window: int | None, group: int,
                 device: torch.device) -> torch.Tensor:
        """`[H or 1, c, n]`: which slots queries `start:stop` of the `q_len` new ones (the last slots) see."""
        slots = torch.arange(n, device=device)[None, :]
        query_positions = (torch.arange(start, stop, device=device) + n - q_len)[:, None]
        visible = slots <= query_positions
        if window is not None:
            visible &= slots > query_positions - window
        visible = visible[None]
        if layer in self.allowed:
            old = self.allowed[layer].to(device).repeat_interleave(group, dim=0)  # [H, n_old]
            visible = visible.expand(old.shape[0], -1, -1).clone()
            visible[..., : old.shape[-1]] &= old[:, None, :]
        return visible


@contextlib.contextmanager
def reference_attention(lm, attention: ReferenceAttention | None = None) -> Iterator[ReferenceAttention]:
    """Run `lm` with `attention` (a fresh `ReferenceAttention` keeping every query's weights by default) for the
    block; kvbench's attention again after it."""
    attention = ReferenceAttention() if attention is None else attention
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    lm.model.set_attn_implementation(NAME)
    try:
        yield attention
    finally:
        lm.model.set_attn_implementation("kvbench")


def stock_forward(lm, cache: DynamicCache, ids: list[int], start: int) -> torch.Tensor:
    """Feed `ids` at positions `start`... into the stock `cache`: the last position's logits `[1, vocab]`."""
    position_ids = torch.arange(start, start + len(ids), device=lm.device)[None]
    inputs = {"input_ids": torch.tensor([ids], device=lm.device), lm.cache_arg: cache, "position_ids": position_ids,
              "use_cache": True, "logits_to_keep": 1}
    return lm.model(**inputs).logits[:, -1]


def per_kv_head(per_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[H, n]` -> `[kv_heads, n]`: the mean over each KV head's query heads."""
    return per_head.view(kv_heads, per_head.shape[0] // kv_heads, per_head.shape[-1]).mean(dim=1)


def top_set(scores: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """Boolean mask of the `count` highest-scoring candidates."""
    masked = torch.where(candidates, scores, torch.tensor(float("-inf")))
    chosen = torch.zeros_like(candidates)
    chosen[masked.topk(count).indices] = True
    return chosen


def simulate(lm, prompt: list[int], decode: list[int], rule, cache: DynamicCache | None = None,
             attention: ReferenceAttention | None = None) -> list[list[torch.Tensor]]:
    """Run `prompt` then each `decode` token over a stock cache, attention masked to what is kept; after each
    step `rule(layer, weights, alive, seen, new)` returns the layer's kept mask `[kv_heads, seen]` given the
    step's attention weights `[H, t, seen]` (its last `attention.tail` queries) and `alive` (kept so far plus the
    `new` tokens). Returns the kept masks per step (after the prompt, after each decode token), per layer.
    `cache`: the stock cache to run in (a rule may read its keys); `attention`: the reference attention to run
    with (a rule may read its `received`). On a sliding layer, `alive` has already lost the positions the next
    query cannot see."""
    kept = {layer: torch.ones(lm.kv_heads, 0, dtype=torch.bool) for layer in range(lm.num_layers)}
    cache, history, seen = DynamicCache() if cache is None else cache, [], 0
    attention = ReferenceAttention() if attention is None else attention
    with reference_attention(lm, attention):
        for ids in [prompt] + [[token] for token in decode]:
            attention.allowed = kept
            stock_forward(lm, cache, ids, seen)
            seen += len(ids)
            for layer in range(lm.num_layers):
                alive = torch.cat([kept[layer], torch.ones(lm.kv_heads, len(ids), dtype=torch.bool)], dim=1)
                window = attention.windows[layer]
                if window is not None:
                    alive &= torch.arange(seen) > seen - window
                kept[layer] = rule(layer, attention.weights[layer][0], alive, seen, len(ids))
            history.append([mask.clone() for mask in kept.values()])
    return history


@torch.no_grad()
def h2o_reference(lm, prompt: list[int], decode: list[int], budget: int, recent: int,
                  prefill_kept: list[torch.Tensor] | None = None) -> list[list[torch.Tensor]]:
    """H2O keeps the `recent` newest plus the top `budget - recent` by attention accumulated over all queries.
    `prefill_kept` replaces H2O's own choice after the prompt (another policy compressed it)."""
    scores = {layer: torch.zeros(lm.kv_heads, len(prompt) + len(decode)) for layer in range(lm.num_layers)}
    attention = ReferenceAttention(tail=1)

    def rule(layer, weights, alive, seen, new):
        scores[layer][:, :seen] += per_kv_head(attention.received[layer][0], lm.kv_heads)
        if prefill_kept is not None and seen == len(prompt):
            return prefill_kept[layer].clone()
        is_recent = torch.arange(seen) >= seen - recent
        protected = alive & is_recent  # recent entries still held (another policy may have dropped some)
        # per head: a sliding window may have dropped more from one head than from another
        return torch.stack([
            alive[h] if int(alive[h].sum()) <= budget else
            top_set(scores[layer][h, :seen], alive[h] & ~is_recent, budget - int(protected[h].sum())) | protected[h]
            for h in range(lm.kv_heads)
        ])

    return simulate(lm, prompt, decode, rule, attention=attention)


@torch.no_grad()
def snapkv_reference(lm, prompt: list[int], window: int, kernel: int, pooling: str) -> list[torch.Tensor]:
    """Per layer, the `[kv_heads, prefix]` SnapKV scores of the prompt: the last `window` queries'
    attention to the prefix, averaged over those queries and each KV head's query heads, then pooled.
    The policy keeps the top `budget - window` of them plus the window. On a sliding layer of window W the prefix
    is what the next query still sees (from position n - W + 1), pooled over only those; earlier positions score
    -inf."""
    n = len(prompt)
    with reference_attention(lm, ReferenceAttention(tail=window)) as attention:
        stock_forward(lm, DynamicCache(), prompt, 0)
    scores = []
    for layer in range(lm.num_layers):
        sliding = attention.windows[layer]
        first = 0 if sliding is None else min(n - window, max(0, n - sliding + 1))
        weights = attention.weights[layer][0, :, :, first : n - window]  # [H, window, prefix]
        votes = per_kv_head(weights.mean(dim=1), lm.kv_heads)
        pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
        pooled = pool(votes[:, None], kernel, stride=1, padding=kernel // 2)[:, 0] if votes.shape[-1] else votes
        scores.append(torch.cat([torch.full((lm.kv_heads, first), float("-inf")), pooled], dim=1))
    return scores


@torch.no_grad()
def tova_reference(lm, prompt: list[int], decode: list[int], budget: int, per_head: bool) -> list[list[torch.Tensor]]:
    """TOVA: after each step, while over budget, drop the entry the newest query attends to least,
    averaged over all the layer's heads (or over each KV head's query heads with `per_head`)."""

    def rule(layer, weights, alive, seen, new):
        scores = weights[:, -1].view(lm.kv_heads, -1, seen).mean(dim=1)  # the newest query's attention
        if not per_head:
            scores = scores.mean(dim=0, keepdim=True).expand(lm.kv_heads, seen)
        if int(alive[0].sum()) <= budget:
            return alive
        return torch.stack([top_set(scores[h], alive[h], budget) for h in range(lm.kv_heads)])

    return simulate(lm, prompt, decode, rule, attention=ReferenceAttention(tail=1))


@torch.no_grad()
def key_norms(lm, prompt: list[int]) -> list[torch.Tensor]:
    """Per layer, the L2 norm of every prompt key, `[kv_heads, n]`, from a stock cache."""
    cache = DynamicCache()
    stock_forward(lm, cache, prompt, 0)
    return [cast(Any, cache.layers[layer]).keys[0].float().norm(dim=-1).cpu() for layer in range(lm.num_layers)]


@torch.no_grad()
def scissorhands_reference(lm, prompt: list[int], decode: list[int], budget: int, history: int,
                           recent: int) -> list[list[torch.Tensor]]:
    """Scissorhands: each of the last `history` queries marks the entries it gives less than 1/(entries it
    sees) of its attention; over budget, the entries marked most often go first (the oldest among equals),
    never the `recent` newest."""
    total = len(prompt) + len(decode)
    marks: dict[int, dict[int, torch.Tensor]] = {layer: {} for layer in range(lm.num_layers)}  # by query position

    def rule(layer, weights, alive, seen, new):
        for i in range(max(0, new - history), new):
            position = seen - new + i
            sees = alive.clone()
            sees[:, position + 1 :] = False
            probs = weights[:, i].view(lm.kv_heads, -1, seen).mean(dim=1)
            verdict = torch.zeros(lm.kv_heads, total, dtype=torch.bool)
            verdict[:, :seen] = (probs < 1.0 / sees.sum(-1, keepdim=True)) & sees
            marks[layer][position] = verdict
        counts = torch.stack([marks[layer][p] for p in range(seen - history, seen) if p in marks[layer]]).sum(0)
        excess = int(alive[0].sum()) - budget
        is_recent = torch.arange(seen) >= seen - recent
        for h in range(lm.kv_heads if excess > 0 else 0):
            candidates = [p for p in range(seen) if alive[h, p] and not is_recent[p]]
            candidates.sort(key=lambda p, h=h: (-int(counts[h, p]), p))
            alive[h, candidates[:excess]] = False
        return alive

    return simulate(lm, prompt, decode, rule)


def held(lm, layer: int, n: int, budget: int) -> int:
    """How many of an `n`-token prompt's entries a layer holds under `budget` (a sliding one, `window - 1` at most)."""
    window = lm.layer_kinds[layer].window
    return min(budget, n if window is None else window - 1)


def visible(lm, layer: int, n: int) -> torch.Tensor:
    """`[n]`: the positions of an `n`-token prompt a layer still holds (a sliding one, its last `window - 1`)."""
    window = lm.layer_kinds[layer].window
    return torch.arange(n) > (-1 if window is None else n - window)


def top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """`[kv_heads, n]`: the `count` best-scoring entries of each head (a score of -inf: not held at all)."""
    kept = torch.zeros_like(scores, dtype=torch.bool)
    kept.scatter_(1, scores.topk(count, dim=-1).indices, True)
    return kept & (scores > float("-inf"))


def prompt_kept(lm, scores: list[torch.Tensor], budget: int) -> Reference:
    """A prompt-scoring policy's reference from its per-layer prompt `scores` `[kv_heads, n]`: the best `budget` of
    what each layer still holds (a sliding one, its last window - 1 positions), and those scores."""
    n = scores[0].shape[-1]
    scores = [score.masked_fill(~visible(lm, layer, n), float("-inf")) for layer, score in enumerate(scores)]
    return [[top(score, held(lm, layer, n, budget)) for layer, score in enumerate(scores)]], scores


@torch.no_grad()
def snapkv_kept(lm, prompt: list[int], budget: int, window: int, kernel: int, pooling: str) -> Reference:
    """SnapKV's kept sets: the top of `snapkv_reference`'s scores, the observation window always (it scores above
    everything)."""
    return prompt_kept(lm, [torch.cat([prefix, torch.full((lm.kv_heads, window), float("inf"))], dim=1)
                            for prefix in snapkv_reference(lm, prompt, window, kernel, pooling)], budget)


def knorm_kept(lm, prompt: list[int], budget: int) -> Reference:
    """Key norm's kept sets: the lowest key norms."""
    return prompt_kept(lm, [-norms for norms in key_norms(lm, prompt)], budget)


def streaming_llm_reference(lm, prompt: list[int], decode: list[int], budget: int, sinks: int) -> Reference:
    """StreamingLLM after the prompt and each decode token: the first `sinks` positions and the most recent ones,
    `budget` in all, of what each layer holds (a sliding layer no longer holds its sinks once the window passed
    them)."""
    history = []
    for seen in range(len(prompt), len(prompt) + len(decode) + 1):
        positions = torch.arange(seen, dtype=torch.float32)
        rank = positions.masked_fill(positions < sinks, float("inf"))
        history.append([top(rank.masked_fill(~visible(lm, layer, seen), float("-inf"))[None].expand(lm.kv_heads, seen),
                            held(lm, layer, seen, budget)) for layer in range(lm.num_layers)])
    return history, None


@torch.no_grad()
def qfilter_kept(lm, prompt: list[int], budget: int, filters: torch.Tensor) -> Reference:
    """Q-Filters' kept sets: per layer and KV head, the keys with the highest -<filter, key> (kvpress's score), one
    key at a time against its head's filter `filters` `[layers, kv_heads, head_dim]`."""
    cache = DynamicCache()
    stock_forward(lm, cache, prompt, 0)
    scores = []
    for layer in range(lm.num_layers):
        keys = cast(Any, cache.layers[layer]).keys[0].float().cpu()  # [kv_heads, n, D]
        scores.append(torch.tensor([[-float(filters[layer, head] @ keys[head, position]) for position in
                                     range(len(prompt))] for head in range(lm.kv_heads)]))
    return prompt_kept(lm, scores, budget)


@torch.no_grad()
def kvzap_kept(lm, prompt: list[int], budget: int, surrogate: list[torch.nn.Module]) -> Reference:
    """KVzap's kept sets: per layer and KV head, the highest predicted log KVzip+ scores, each position's computed
    one at a time from the hidden state its layer's attention reads (a hook on the stock forward), as the linear
    map w_h . x + b_h or the MLP w2_h . gelu(W1 x + b1) + b2_h of kvpress's KVzapModel (`surrogate`: its layers)."""
    inputs: dict[int, torch.Tensor] = {}

    def record(index: int):
        def hook(module, args, kwargs) -> None:
            inputs[index] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])[0].float().cpu()
        return hook

    layers = lm.model.model.layers
    handles = [layer.self_attn.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        stock_forward(lm, DynamicCache(), prompt, 0)
    finally:
        for handle in handles:
            handle.remove()
    scores = []
    for layer, module in enumerate(surrogate):
        linear = not isinstance(module, torch.nn.Sequential)
        parts = [module] if linear else list(cast(torch.nn.Sequential, module))
        first, last = (cast(torch.nn.Linear, parts[index].cpu()) for index in (0, -1))
        per_head = []
        for head in range(lm.kv_heads):
            row = []
            for x in inputs[layer]:
                inner = x if linear else F.gelu(first.weight @ x + first.bias)
                row.append(float(last.weight[head] @ inner + last.bias[head]))
            per_head.append(torch.tensor(row))
        scores.append(torch.stack(per_head))
    return prompt_kept(lm, scores, budget)
