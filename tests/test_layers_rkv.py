"""SimLayerKV and R-KV keep what their definitions say, checked against plain-loop references over a stock cache
(GQA: 4 query heads share 2 KV heads, 2 layers), plus their parameter errors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.reference import ReferenceAttention, reference_attention, simulate, stock_forward
from tests.conftest import random_ids
from tests.helpers import run_cache

PROMPT, DECODE = random_ids(96, seed=11), random_ids(10, seed=12)


def assert_same_history(ours, theirs):
    assert len(ours) == len(theirs)
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
        for layer, (mask, reference) in enumerate(zip(mine, expected, strict=True)):
            assert torch.equal(mask, reference), f"step {step} layer {layer}"


# --- SimLayerKV ---------------------------------------------------------------------------------------------

def watched(n: int, budget: int, n_last: int, n_initial: int) -> torch.Tensor:
    """What the laziness test looks at in a prompt of `n`: the first `n_initial` positions and the `n_recent` =
    budget - n_initial + n_last positions before the last `n_last` (whose own slots are left out)."""
    recent = budget - n_initial + n_last
    positions = torch.arange(n)
    return (positions < n_initial) | ((positions >= n - n_last - recent) & (positions < n - n_last))


@torch.no_grad()
def lazy_shares(lm, prompt: list[int], budget: int, n_last: int, n_initial: int) -> list[float]:
    """Per layer, the share of the last `n_last` queries' attention (averaged over them and every query head)
    that lands on what a lazy layer keeps."""
    with reference_attention(lm, ReferenceAttention(tail=n_last)) as attention:
        stock_forward(lm, DynamicCache(), prompt, 0)
    mask = watched(len(prompt), budget, n_last, n_initial)
    return [float(attention.weights[layer][0].mean(dim=(0, 1))[mask].sum()) for layer in range(lm.num_layers)]


@torch.no_grad()
def simlayerkv_reference(lm, prompt: list[int], decode: list[int], budget: int, threshold: float, n_last: int,
                         n_initial: int) -> tuple[list[bool], list[list[torch.Tensor]]]:
    """The layers judged lazy after the prompt, and the kept masks: a lazy layer keeps its first `n_initial`
    positions and its newest `budget - n_initial` after the prompt and after every decode token, the others all."""
    n = len(prompt)
    shares = lazy_shares(lm, prompt, budget, n_last, n_initial)
    long_enough = n > n_initial + (budget - n_initial + n_last) + n_last
    lazy = [long_enough and share > threshold for share in shares]

    def rule(layer, weights, alive, seen, new):
        if not lazy[layer]:
            return alive
        positions = torch.arange(seen)
        return alive & ((positions < n_initial) | (positions >= seen - (budget - n_initial)))

    return lazy, simulate(lm, prompt, decode, rule)


@pytest.mark.parametrize("n_last,n_initial", [(1, 4), (3, 2)])
def test_simlayerkv_keeps_sinks_and_recent_in_lazy_layers_only(sharp_llama, n_last, n_initial):
    budget = 24
    shares = lazy_shares(sharp_llama, PROMPT, budget, n_last, n_initial)
    threshold = sum(shares) / len(shares)  # between the two layers' shares: one layer lazy, the other not
    lazy, expected = simlayerkv_reference(sharp_llama, PROMPT, DECODE, budget, threshold, n_last, n_initial)
    assert sorted(lazy) == [False, True], shares
    policy = build_policy("simlayerkv", {"lazy_threshold": threshold, "n_last": n_last, "n_initial": n_initial})
    cache, history = run_cache(sharp_llama, policy, PROMPT, DECODE, budget)
    assert [layer.layer_stats[policy.state_key] for layer in cache.layers] == lazy
    assert_same_history(history, expected)
    held = [int(mask.sum(-1).max()) for mask in history[-1]]
    assert held == [budget if is_lazy else len(PROMPT) + len(DECODE) for is_lazy in lazy]


@pytest.mark.parametrize("n_last", [1, 3])
def test_simlayerkv_judges_a_layer_by_the_share_the_paper_defines(sharp_llama, n_last):
    """Each layer's decision reads the reference's share to a hair: a threshold just below it makes the layer
    lazy, just above it not."""
    budget = 24
    for layer, share in enumerate(lazy_shares(sharp_llama, PROMPT, budget, n_last, 4)):
        for offset, lazy in ((-1e-5, True), (1e-5, False)):
            policy = build_policy("simlayerkv", {"lazy_threshold": share + offset, "n_last": n_last})
            cache, _ = run_cache(sharp_llama, policy, PROMPT, [], budget)
            assert cache.layers[layer].layer_stats[policy.state_key] is lazy, (layer, share, offset)


@pytest.mark.parametrize("threshold,prompt,lazy", [(0.0, 96, [True, True]), (1.0, 96, [False, False]),
                                                   (0.0, 48, [False, False])])
def test_simlayerkv_judges_every_layer_or_none(sharp_llama, threshold, prompt, lazy):
    """Threshold 0 makes every layer lazy, 1 none (kvpress), and so does a prompt no longer than n_initial +
    n_recent + n_last (48 <= 4 + 45 + 1 at budget 48)."""
    budget = 48
    policy = build_policy("simlayerkv", {"lazy_threshold": threshold})
    cache, history = run_cache(sharp_llama, policy, PROMPT[:prompt], DECODE, budget)
    assert [layer.layer_stats[policy.state_key] for layer in cache.layers] == lazy
    _, expected = simlayerkv_reference(sharp_llama, PROMPT[:prompt], DECODE, budget, threshold, 1, 4)
    assert_same_history(history, expected)
    full = prompt + len(DECODE)
    assert cache.stats().cache_ratio == pytest.approx(sum(budget if is_lazy else full for is_lazy in lazy) / (2 * full))


# --- R-KV ---------------------------------------------------------------------------------------------------

class QueryRecorder(ReferenceAttention):
    """The reference attention, also keeping each layer's newest queries `[H, q, D]` and the scaling."""

    def __init__(self) -> None:
        super().__init__(tail=1)
        self.queries: dict[int, torch.Tensor] = {}
        self.scaling = 1.0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        self.queries[module.layer_idx], self.scaling = query[0].float(), scaling
        return super().__call__(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def rkv_head_scores(queries: torch.Tensor, keys: torch.Tensor, scaling: float, window: int, kernel: int,
                    mix_lambda: float, threshold: float) -> torch.Tensor:
    """One KV head's R-KV scores of its held entries but the newest `window` (`keys` `[n, D]` in position order,
    `queries` `[group, w, D]` the newest ones of its query heads), from the paper and the official code."""
    n = keys.shape[0]
    prefix = n - window
    # importance: logits maxed over the query heads, softmax over the prefix, mean over the queries, max-pooled
    logits = (queries @ keys[:prefix].T * scaling).max(dim=0).values  # [w, prefix]
    attention = logits.softmax(dim=-1).mean(dim=0)
    reach = kernel // 2
    pooled = torch.tensor([float(attention[max(0, i - reach) : i + reach + 1].max()) for i in range(prefix)])
    # redundancy: cosine similarities without the diagonal; each key's newest similar key (or the oldest) is
    # retained: that pair counts 0; the mean over all keys, softmaxed over them
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(0.0)
    for i in range(n):
        similar = [j for j in range(n) if similarity[i, j] > threshold]
        similarity[i, max(similar) if similar else 0] = 0.0
    redundancy = similarity.mean(dim=0).softmax(dim=0)
    return mix_lambda * pooled - (1 - mix_lambda) * redundancy[:prefix]


@torch.no_grad()
def rkv_reference(lm, prompt: list[int], decode: list[int], budget: int, window: int, kernel: int,
                  mix_lambda: float, buffer: int, similarity_threshold: float) -> list[list[torch.Tensor]]:
    """R-KV's kept masks: after the prompt and whenever `buffer` tokens arrived beyond the budget, each KV head
    keeps its newest `window` entries and the `budget - window` others of the highest score."""
    cache, attention = DynamicCache(), QueryRecorder()
    recent: dict[int, torch.Tensor] = {}

    def rule(layer, weights, alive, seen, new):
        queries = attention.queries[layer]
        recent[layer] = torch.cat([recent.get(layer, queries[:, :0]), queries], dim=1)[:, -window:]
        held = int(alive[0].sum())
        if held - budget < (1 if seen == len(prompt) else buffer):
            return alive
        keys = cache.layers[layer].keys[0].float()  # [kv_heads, seen, D]
        group = recent[layer].shape[0] // lm.kv_heads
        kept = torch.zeros_like(alive)
        for h in range(lm.kv_heads):
            positions = alive[h].nonzero().flatten()
            scores = rkv_head_scores(recent[layer][h * group : (h + 1) * group], keys[h, positions],
                                     attention.scaling, window, kernel, mix_lambda, similarity_threshold)
            kept[h, positions[-window:]] = True
            kept[h, positions[scores.topk(budget - window).indices]] = True
        return kept

    return simulate(lm, prompt, decode, rule, cache=cache, attention=attention)


RKV = {"window": 4, "kernel": 7, "mix_lambda": 0.07, "buffer": 4, "similarity_threshold": 0.5}


@pytest.mark.parametrize("params", [RKV, {**RKV, "kernel": 3, "mix_lambda": 0.5, "similarity_threshold": 0.2}])
def test_rkv_keeps_important_unredundant_entries_after_the_prompt_and_every_buffer(sharp_llama, params):
    budget = 40
    cache, history = run_cache(sharp_llama, build_policy("rkv", params), PROMPT, DECODE, budget)
    assert_same_history(history, rkv_reference(sharp_llama, PROMPT, DECODE, budget, **params))
    held = [int(masks[0].sum(-1).max()) for masks in history]
    assert held == [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42]  # the budget, then `buffer` more at most
    assert cache.evictions == 2 * 2 * ((96 - 40) + 2 * 4)  # layers x heads x (the prompt's, two buffers')


def test_rkv_keeps_its_buffer_as_a_wrapper_stage(sharp_llama):
    """SnapKV compresses the prompt, R-KV the generation: every `buffer` tokens, whatever the run's evict_every."""
    policy = build_policy("compose", {"prefill": {"name": "snapkv", "window": 8}, "decode": {"name": "rkv", **RKV}})
    _, history = run_cache(sharp_llama, policy, PROMPT, DECODE, 40)
    assert [int(masks[0].sum(-1).max()) for masks in history] == [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42]


def test_rkv_redundancy_changes_what_is_kept(sharp_llama):
    """Not SnapKV-like importance alone (mix_lambda 1), nor redundancy alone (0)."""
    kept = {}
    for mix_lambda in (0.0, 0.07, 1.0):
        _, history = run_cache(sharp_llama, build_policy("rkv", {**RKV, "mix_lambda": mix_lambda}), PROMPT, [], 40)
        kept[mix_lambda] = history[0]
    for other in (0.0, 1.0):
        assert not all(torch.equal(a, b) for a, b in zip(kept[0.07], kept[other], strict=True))


@pytest.mark.parametrize("chunk", [None, 32])
def test_rkv_batch_rows_keep_what_they_keep_alone(sharp_llama, chunk):
    """A left-padded batch: each row's padding is no part of its similarities or attention (a chunked prefill
    compresses a row while it still holds padding slots), and each row compresses every `buffer` tokens of its
    own, as alone."""
    long = random_ids(100, seed=5)
    short, budget, tokens = long[32:], 30, DECODE[:6]  # padded by a whole chunk: the rows' chunks are their own
    settings = RunSettings(budget=budget, prefill="chunked" if chunk else "full", prefill_chunk=chunk or 512)
    batched = Session(sharp_llama, build_policy("rkv", RKV), settings, [68, 100], adds=6,
                      left_padding=torch.tensor([32, 0]))
    batched.prefill(torch.tensor([[0] * 32 + short, long]))
    alone = []
    for prompt in (short, long):
        session = Session(sharp_llama, build_policy("rkv", RKV), settings, len(prompt), adds=6)
        session.prefill(prompt)
        alone.append(session)
    for step in range(len(tokens) + 1):
        for row, session in enumerate(alone):
            for mine, theirs in zip(batched.cache.layers, session.cache.layers, strict=True):
                held = mine.live_positions()[row].masked_fill(~mine.held_slots()[row], -1)
                ours = [sorted(p for p in head.tolist() if p >= 0) for head in held]
                alone_held = theirs.live_positions()[0].masked_fill(~theirs.held_slots()[0], -1)
                assert ours == [sorted(p for p in head.tolist() if p >= 0) for head in alone_held], \
                    f"step {step} row {row}"
        if step < len(tokens):
            batched.step(torch.tensor([tokens[step], tokens[step]]))
            for session in alone:
                session.step(tokens[step])


# --- errors -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,culprit", [
    ("simlayerkv", {"lazy_threshold": 1.5}, "lazy_threshold"),
    ("simlayerkv", {"n_last": 0}, "n_last"),
    ("simlayerkv", {"n_initial": -1}, "n_initial"),
    ("rkv", {"window": 0}, "window"),
    ("rkv", {"kernel": 4}, "kernel"),
    ("rkv", {"mix_lambda": 1.5}, "mix_lambda"),
    ("rkv", {"buffer": 0}, "buffer"),
    ("rkv", {"similarity_threshold": -0.5}, "similarity_threshold"),
])
def test_bad_parameters_are_one_line_errors_naming_them(name, params, culprit):
    with pytest.raises(KvbenchError, match=culprit) as error:
        build_policy(name, params)
    assert "\n" not in str(error.value)


def test_budgets_and_settings_they_cannot_run_with(sharp_llama):
    with pytest.raises(KvbenchError, match="n_initial=4"):
        run_cache(sharp_llama, build_policy("simlayerkv"), PROMPT, [], 4)
    with pytest.raises(KvbenchError, match="window=8"):
        run_cache(sharp_llama, build_policy("rkv"), PROMPT, [], 8)
    with pytest.raises(KvbenchError, match="prefill mode 'full'"):
        run_cache(sharp_llama, build_policy("simlayerkv"), PROMPT, [], 40, chunk=32)

