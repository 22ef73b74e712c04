"""Expected Attention, KVzip and CriticalKV keep what their definitions say, checked against references that
recompute everything from a stock cache and the model's own projections (queries from q_proj, RoPE from the
rotary frequencies, outputs through o_proj), plus their errors. GQA: 4 query heads share 2 KV heads."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.reference import simulate, snapkv_reference, stock_forward
from tests.conftest import random_ids
from tests.helpers import run_cache, run_session

PROMPT, DECODE, BUDGET = random_ids(96, seed=11), random_ids(10, seed=12), 40


def rotation(lm, position: int) -> torch.Tensor:
    """RoPE's `[D, D]` rotation at `position`: dimension i pairs with i + D/2, turned by position x theta^(-2i/D)."""
    dim = lm.head_dim
    half = dim // 2
    theta = lm.model.config.rope_parameters["rope_theta"]
    angles = position * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
    matrix = torch.zeros(dim, dim, dtype=torch.float64)
    index = torch.arange(half)
    matrix[index, index] = matrix[index + half, index + half] = angles.cos()
    matrix[index, index + half] = -angles.sin()
    matrix[index + half, index] = angles.sin()
    return matrix


class QueryTap:
    """Every layer's pre-RoPE queries `[H, positions, D]` (float64), from its q_proj on the attention's input."""

    def __init__(self, lm) -> None:
        self.queries = {layer: [] for layer in range(lm.num_layers)}
        self.hidden_norms = {layer: [] for layer in range(lm.num_layers)}  # the attention input's, per position
        self.lm = lm
        self.handles = [layer.self_attn.register_forward_hook(self._tap(i), with_kwargs=True)
                        for i, layer in enumerate(lm.model.model.layers)]

    def _tap(self, index):
        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"][0]
            q = module.q_proj(hidden).view(hidden.shape[0], -1, self.lm.head_dim).transpose(0, 1)
            self.queries[index].append(q.double())
            self.hidden_norms[index].append(hidden.double().norm(dim=-1))
        return hook

    def all(self, layer: int) -> torch.Tensor:
        return torch.cat(self.queries[layer], dim=1)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def expected_scores(lm, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, alive: torch.Tensor,
                    next_position: int, future: int, sink: int) -> torch.Tensor:
    """`[kv_heads, n]` expected attention of the `alive` keys from queries ~ N(mean, cov) of `queries` `[H, m, D]`,
    rotated by RoPE averaged over the next `future` positions, times the value norm; sinks inf."""
    rotate = sum(rotation(lm, p) for p in range(next_position, next_position + future)) / future
    scale = lm.head_dim ** -0.5
    heads, kv_heads = queries.shape[0], keys.shape[0]
    out = torch.zeros(kv_heads, keys.shape[1], dtype=torch.float64)
    candidates = alive.clone()
    candidates[:, :sink] = False
    for h in range(heads):
        g = h // (heads // kv_heads)
        mean = queries[h].mean(dim=0)
        centered = queries[h] - mean
        cov = centered.T @ centered / queries.shape[1]
        mu, sigma = rotate @ mean, rotate @ cov @ rotate.T
        k = keys[g].double()
        logits = scale * (k @ mu) + scale**2 / 2 * torch.einsum("nd,de,ne->n", k, sigma, k)
        out[g] += logits.masked_fill(~candidates[g], float("-inf")).softmax(-1).nan_to_num(0.0)
    out = out / (heads // kv_heads) * values.double().norm(dim=-1)
    out[:, :sink] = float("inf")
    return out


def top_per_head(scores: torch.Tensor, alive: torch.Tensor, count: int) -> torch.Tensor:
    kept = torch.zeros_like(alive)
    for h in range(scores.shape[0]):
        kept[h, scores[h].masked_fill(~alive[h], float("-inf")).topk(count).indices] = True
    return kept


@pytest.mark.parametrize("decode_too", [False, True])
def test_expected_attention_keeps_what_future_queries_are_expected_to_attend(sharp_llama, decode_too):
    sink, future, ring = 4, 64, 16
    cache, tap = DynamicCache(), QueryTap(sharp_llama)

    def rule(layer, weights, alive, seen, new):
        if (seen > len(PROMPT) and not decode_too) or int(alive[0].sum()) <= BUDGET:
            return alive
        queries = tap.all(layer)[:, sink:seen]
        if seen > len(PROMPT):  # decoding: the newest `ring` queries
            queries = queries[:, -ring:]
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        return top_per_head(expected_scores(sharp_llama, queries, keys, values, alive, seen, future, sink), alive,
                            BUDGET)

    try:
        expected = simulate(sharp_llama, PROMPT, DECODE, rule, cache=cache)
    finally:
        tap.close()
    policy = build_policy("expected_attention", {"n_future_positions": future, "n_sink": sink,
                                                 "decode": decode_too, "query_buffer": ring})
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    for step, (ours, theirs) in enumerate(zip(history, expected, strict=True)):
        for layer, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(mine, reference), f"step {step} layer {layer}"
    # neither the newest entries nor the policy without its covariance term
    plain = build_policy("expected_attention", {"n_future_positions": future, "use_covariance": False})
    _, without = run_cache(sharp_llama, plain, PROMPT, [], BUDGET)
    assert not all(torch.equal(a, b) for a, b in zip(history[0], without[0], strict=True))


def test_expected_attention_carries_its_statistics_through_a_shared_prefill_and_a_fork(sharp_llama):
    from kvbench.engine.sharing import shared_prefill

    policy = build_policy("expected_attention", {"decode": True, "query_buffer": 8})
    settings = RunSettings(budget=BUDGET)
    alone, _ = run_session(sharp_llama, policy, PROMPT, [], BUDGET)
    shared = shared_prefill(sharp_llama, PROMPT, [build_policy("expected_attention",
                                                               {"decode": True, "query_buffer": 8})])
    adopted = Session(sharp_llama, build_policy("expected_attention", {"decode": True, "query_buffer": 8}),
                      settings, prompt_tokens=len(PROMPT), adds=len(DECODE))
    adopted.prefill(PROMPT, shared=shared)
    for a, b in zip(alone.cache.layers, adopted.cache.layers, strict=True):
        assert torch.equal(a.live_positions(), b.live_positions())
    twin = adopted.fork()
    for token in DECODE:
        adopted.step(token)
        twin.step(token)
    for a, b in zip(adopted.cache.layers, twin.cache.layers, strict=True):
        assert torch.equal(a.live_positions(), b.live_positions())


# --- KVzip --------------------------------------------------------------------------------------------------

def rope(lm, x: torch.Tensor, start: int) -> torch.Tensor:
    """`x` `[H, q, D]` rotated to positions start, start + 1, ..."""
    return torch.stack([torch.stack([rotation(lm, start + i) @ x[h, i] for i in range(x.shape[1])])
                        for h in range(x.shape[0])])


@torch.no_grad()
def kvzip_reference(lm, prompt: list[int], budget: int, chunk: int, sink: int, layerwise: bool,
                    plus: bool = False) -> list[torch.Tensor]:
    """Per layer, the `[kv_heads, n]` kept mask: each prompt entry's score is the highest attention a query of its
    chunk's repetition ("Repeat the previous context exactly." + newline + the chunk; later chunks "...starting
    with" and the previous chunk's last 8 tokens) gives it, those queries seeing the sinks, the chunk and
    themselves; the best layers x heads x budget of all (or heads x budget of each layer) are kept. `plus`
    (KVzip+): each weight divided by the query's hidden-state norm, times ||o_proj(v in the query head's slot)||."""
    n, kv_heads = len(prompt), lm.kv_heads
    encode = lambda text: lm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    cache = DynamicCache()
    stock_forward(lm, cache, prompt, 0)
    scores = [torch.zeros(kv_heads, n, dtype=torch.float64) for _ in range(lm.num_layers)]
    for start in range(0, n, chunk):
        piece = prompt[start : start + chunk]
        if start == 0:
            request = encode("\n\nRepeat the previous context exactly.")
        else:
            request = encode("\n\nRepeat the part of the previous context exactly, starting with") + \
                prompt[start - 8 : start]
        repeat = request + encode("\n") + piece
        probe, tap = copy.deepcopy(cache), QueryTap(lm)
        try:
            stock_forward(lm, probe, repeat, n)
        finally:
            tap.close()
        for layer in range(lm.num_layers):
            queries = rope(lm, tap.all(layer), n)  # [H, r, D]
            keys = probe.layers[layer].keys[0].double()  # [kv, n + r, D]
            seen = list(range(min(sink, start))) + list(range(start, start + len(piece))) + \
                list(range(n, n + len(repeat)))
            for h in range(queries.shape[0]):
                g = h // (queries.shape[0] // kv_heads)
                logits = queries[h] @ keys[g, seen].T * lm.head_dim ** -0.5
                own = len(repeat)
                causal = torch.ones(own, len(seen), dtype=torch.bool)
                causal[:, -own:] = torch.ones(own, own, dtype=torch.bool).tril()
                probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
                first = min(sink, start)
                probs = probs[:, first : first + len(piece)]
                if plus:
                    values = probe.layers[layer].values[0, g, start : start + len(piece)].double()
                    o_proj = lm.model.model.layers[layer].self_attn.o_proj.weight.double()
                    written = (values @ o_proj[:, h * lm.head_dim : (h + 1) * lm.head_dim].T).norm(dim=-1)
                    probs = probs / tap.hidden_norms[layer][0][:, None] * written[None]
                best = probs.amax(dim=0)
                scores[layer][g, start : start + len(piece)] = torch.maximum(
                    scores[layer][g, start : start + len(piece)], best)
    for s in scores:
        s[:, :sink] = float("inf")
    if layerwise:
        counts = [kv_heads * budget] * lm.num_layers
    else:
        everything = torch.cat([s.flatten() for s in scores])
        owner = torch.arange(lm.num_layers).repeat_interleave(kv_heads * n)
        counts = torch.bincount(owner[everything.topk(lm.num_layers * kv_heads * budget).indices],
                                minlength=lm.num_layers).tolist()
    masks = []
    for s, count in zip(scores, counts, strict=True):
        kept = torch.zeros(kv_heads * n, dtype=torch.bool)
        kept[s.flatten().topk(count).indices] = True
        masks.append(kept.view(kv_heads, n))
    return masks


@pytest.mark.parametrize(("chunk", "layerwise"), [(2048, False), (40, False), (40, True)])
def test_kvzip_keeps_what_the_reconstruction_attends_to(sharp_llama, chunk, layerwise):
    policy = build_policy("kvzip", {"chunk": chunk, "layerwise": layerwise})
    session, history = run_session(sharp_llama, policy, PROMPT, DECODE, BUDGET)
    expected = kvzip_reference(sharp_llama, PROMPT, BUDGET, chunk, 4, layerwise)
    for layer, (mine, reference) in enumerate(zip(history[0], expected, strict=True)):
        assert torch.equal(mine, reference), f"layer {layer}"
    counts = [int(m.sum()) for m in history[0]]
    assert sum(counts) == sharp_llama.num_layers * sharp_llama.kv_heads * BUDGET
    if not layerwise:
        assert len(set(counts)) > 1  # the global selection gives layers different shares
    # the reconstruction's entries are gone, the positions continue from the prompt, decoding works after it
    assert all(layer.seen == len(PROMPT) + len(DECODE) for layer in session.cache.layers)
    assert int(history[-1][0][:, len(PROMPT):].sum()) == sharp_llama.kv_heads * len(DECODE)
    stats = session.cache.stats()
    assert stats.kv_bytes_physical > stats.kv_bytes_live  # uneven heads are padded, and the padding is reported


def test_kvzip_refuses_what_it_cannot_reconstruct(sharp_llama):
    with pytest.raises(KvbenchError, match="prefill mode 'full'"):
        run_session(sharp_llama, build_policy("kvzip"), PROMPT, [], BUDGET, chunk=32)
    with pytest.raises(KvbenchError, match="takes no storage"):
        build_policy("kvzip", {"storage": "quant"})


# --- CriticalKV ---------------------------------------------------------------------------------------------

@torch.no_grad()
def projected_norms(lm, values: torch.Tensor, layer: int) -> torch.Tensor:
    """`[kv_heads, n]`: ||o_proj(v placed in query head h's slot)||_1, averaged over each KV head's query heads."""
    o_proj = lm.model.model.layers[layer].self_attn.o_proj
    heads, dim = lm.model.config.num_attention_heads, lm.head_dim
    group = heads // lm.kv_heads
    norms = torch.zeros(lm.kv_heads, values.shape[1])
    for h in range(heads):
        placed = torch.zeros(values.shape[1], heads * dim)
        placed[:, h * dim : (h + 1) * dim] = values[h // group]
        norms[h // group] += o_proj(placed).abs().sum(-1) / group
    return norms


@pytest.mark.parametrize("eps", [1e-4, 0.02])  # 0.02 weighs as much as a mean attention weight: the scale matters
def test_criticalkv_keeps_the_first_stage_then_the_output_weighted_best(sharp_llama, eps):
    window, ratio = 8, 0.5
    cache = DynamicCache()
    stock_forward(sharp_llama, cache, PROMPT, 0)
    base = snapkv_reference(sharp_llama, PROMPT, window, 7, "max")
    n = len(PROMPT)
    policy = build_policy("criticalkv", {"base": {"name": "snapkv", "window": window}, "epsilon": eps,
                                         "first_stage_ratio": ratio})
    _, history = run_cache(sharp_llama, policy, PROMPT, [], BUDGET)
    for layer in range(sharp_llama.num_layers):
        scores = torch.cat([base[layer], torch.full((sharp_llama.kv_heads, window), float("inf"))], dim=1)
        first = scores.topk(int(BUDGET * ratio), dim=-1).indices
        corrected = (scores + eps) * projected_norms(sharp_llama, cache.layers[layer].values[0], layer)
        corrected.scatter_(-1, first, float("inf"))
        expected = top_per_head(corrected, torch.ones(sharp_llama.kv_heads, n, dtype=torch.bool), BUDGET)
        assert torch.equal(history[0][layer], expected), f"layer {layer}"
    _, plain = run_cache(sharp_llama, build_policy("snapkv", {"window": window}), PROMPT, [], BUDGET)
    assert not all(torch.equal(a, b) for a, b in zip(history[0], plain[0], strict=True))


def test_criticalkv_takes_its_bases_schedule_and_refuses_a_base_without_scores():
    assert build_policy("criticalkv", {"base": "h2o"}).schedule.when == "decode"
    assert build_policy("criticalkv").schedule.when == "prefill"
    for base in ("full", "kvzip", "ada_kv"):  # nothing to score, or a base that picks its kept set itself
        with pytest.raises(KvbenchError, match=f"base '{base}' must score entries"):
            build_policy("criticalkv", {"base": base})
    with pytest.raises(KvbenchError, match="first_stage_ratio"):
        build_policy("criticalkv", {"first_stage_ratio": 1.5})


@pytest.mark.parametrize("name", ["kvzip", "ada_kv"])
def test_prompt_compressors_stream_text_compressing_its_first_chunk_once(sharp_llama, name):
    """Perplexity and lm-eval's rolling loglikelihood: the first chunk is the prompt (KVzip reconstructs it, Ada-KV
    shares its budget), the rest a continuation the cache grows with."""
    text, chunk = PROMPT + DECODE, 64
    session = Session(sharp_llama, build_policy(name), RunSettings(budget=BUDGET), prompt_tokens=len(text),
                      arrival=chunk)
    with session:
        session.score(text, chunk=chunk)
    held = sum(layer.live_entries() for layer in session.cache.layers)
    expected = sharp_llama.num_layers * sharp_llama.kv_heads * (BUDGET + len(text) - 1 - chunk)
    assert abs(held - expected) <= sharp_llama.num_layers * sharp_llama.kv_heads  # Ada-KV rounds per head
