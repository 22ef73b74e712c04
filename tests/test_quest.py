"""Quest (sparse family): every decode step reads the pages a plain-loop reference from the paper picks, attends to
them only, reads fewer bytes with fewer pages while storing full's, and equals `full` when every page is read."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.checks.tolerance import sum_roundings
from kvbench.engine.generation import generate
from kvbench.engine.models import load_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import Demand, build_policy
from tests.conftest import random_ids
from tests.helpers import assert_close, assert_model_close
from tests.test_equivalence import stock_generate

PAGE = 8
PROMPT = 101  # 13 pages, the last one partly filled: the page being written changes as tokens arrive
STEPS = 12


def quest(**params):
    return build_policy("quest", {"page_size": PAGE, "dense_layers": 0, **params})


def reference_pages(query: torch.Tensor, keys: torch.Tensor, budget: int) -> list[list[set[int]]]:
    """The paper's selection, one head at a time: pages of PAGE tokens by position, per channel the min and max of
    their keys, the upper bound sum_c max(q_c min_c, q_c max_c) of each page; the page being written is read, and
    the best (budget // PAGE - 1) of the others. `query` `[heads, dim]`, `keys` `[kv_heads, n, dim]` in position
    order; returns the pages read, per batch row (one) and query head."""
    heads, kv_heads, n = query.shape[0], keys.shape[0], keys.shape[1]
    pages = math.ceil(n / PAGE)
    chosen = []
    for head in range(heads):
        kv = head // (heads // kv_heads)
        bounds = []
        for page in range(pages - 1):  # every page but the last
            block = keys[kv, page * PAGE : (page + 1) * PAGE]
            low, high = block.min(dim=0).values, block.max(dim=0).values
            bounds.append(sum(max(float(q) * float(lo), float(q) * float(hi))
                              for q, lo, hi in zip(query[head], low, high, strict=True)))
        ranked = sorted(range(pages - 1), key=lambda page: -bounds[page])
        chosen.append({pages - 1, *ranked[: budget // PAGE - 1]})
    return [chosen]


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: list[set[int]],
                        scaling: float) -> torch.Tensor:
    """Softmax attention of each head `[heads, dim]` over the slots of its pages only (keys in position order)."""
    heads, kv_heads = query.shape[0], keys.shape[0]
    out = []
    for head in range(heads):
        kv = head // (heads // kv_heads)
        slots = [s for s in range(keys.shape[1]) if s // PAGE in pages[head]]
        weights = torch.softmax((keys[kv, slots] @ query[head]) * scaling, dim=0)
        out.append(weights @ values[kv, slots])
    return torch.stack(out)


def traced_run(lm, policy, budget: int):
    """Prefill PROMPT tokens, step STEPS: each layer's decode-step query, keys, values, the slots quest chose and
    the attention output (the input of o_proj)."""
    steps, outputs = [], []
    choose = policy.read_mask

    def read_mask(layer, query, budget):
        mask = choose(layer, query, budget)
        steps.append((layer.layer_idx, query[0, :, 0].clone(), layer.live_keys()[0].clone(),
                      layer.live_values()[0].clone(), mask))
        return mask

    policy.read_mask = read_mask
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda _, args: outputs.append(args[0][0, -1].clone()))
             for layer in lm.model.model.layers]
    try:
        session = Session(lm, policy, RunSettings(budget=budget), prompt_tokens=PROMPT, adds=STEPS)
        session.prefill(random_ids(PROMPT, seed=7))
        outputs.clear()  # the prompt's forward reads every slot
        token = int(session.logits.argmax())
        for _ in range(STEPS):
            token = int(session.step(token).argmax())
    finally:
        for hook in hooks:
            hook.remove()
    return steps, outputs


@pytest.mark.parametrize("budget", [24, 40, 64])
def test_pages_and_outputs_match_the_paper_loop(sharp_llama, budget):
    lm = sharp_llama
    steps, outputs = traced_run(lm, quest(), budget)
    assert len(steps) == len(outputs) == STEPS * lm.num_layers
    heads, head_dim = lm.model.config.num_attention_heads, lm.head_dim
    for (layer, query, keys, values, mask), output in zip(steps, outputs, strict=True):
        assert mask is not None, "every layer reads sparsely (dense_layers=0) once the pages exceed the budget"
        n = keys.shape[1]
        expected = reference_pages(query, keys, budget)[0]
        read = [{s // PAGE for s in range(n) if mask[0, head, s]} for head in range(heads)]
        assert read == expected, (layer, n)
        # whole pages are read: every slot of a chosen page
        assert all(bool(mask[0, head, s]) == (s // PAGE in expected[head]) for head in range(heads) for s in range(n))
        attended = reference_attention(query, keys, values, expected, head_dim**-0.5)
        # q.k over head_dim, then the softmax's and the weighted sum's over the n slots, in another order
        assert_close(output.view(heads, head_dim), attended, roundings=sum_roundings(head_dim + 2 * n))


def test_every_page_read_equals_full_exactly(tiny_llama):
    """A budget that holds every page reads densely: greedy tokens and logits of model.generate, bit for bit. (Whole
    pages: 212 tokens round down to 26 pages of 8, one short of the 27 that 211 tokens fill.)"""
    prompt = random_ids(200, seed=4)
    tokens, logits = stock_generate(tiny_llama, prompt)
    every_page = PAGE * math.ceil((len(prompt) + 12) / PAGE)
    result = generate(tiny_llama, quest(), prompt, [], RunSettings(budget=every_page), max_new_tokens=12,
                      eos_token_ids=set())
    assert result.tokens == tokens
    assert torch.equal(result.last_logits, logits)
    assert result.measurements["kv_bytes_read"] == result.measurements["kv_bytes_read_full"]


def test_a_mask_of_every_slot_equals_full(tiny_llama):
    """The masked path itself changes nothing when it selects every slot (the pages' choice is all it adds)."""
    prompt = random_ids(200, seed=4)
    tokens, logits = stock_generate(tiny_llama, prompt)
    policy = quest()
    policy.read_mask = lambda layer, query, budget: torch.ones(1, query.shape[1], layer.length, dtype=torch.bool)
    result = generate(tiny_llama, policy, prompt, [], RunSettings(budget=PAGE), max_new_tokens=12, eos_token_ids=set())
    assert result.tokens == tokens
    assert_model_close(tiny_llama, result.last_logits, logits)


def test_bytes_read_fall_with_the_budget_while_stored_bytes_stay_full(sharp_llama):
    prompt = random_ids(PROMPT, seed=7)

    def measured(policy, budget=None):
        return generate(sharp_llama, policy, prompt, [], RunSettings(budget=budget), max_new_tokens=STEPS,
                        eos_token_ids=set()).measurements

    full = measured(build_policy("full"))
    assert full["kv_bytes_read"] == full["kv_bytes_read_full"] > 0
    reads = []
    for budget in (128, 64, 32, 16):
        m = measured(quest(), budget)
        assert m["kv_bytes_live"] == full["kv_bytes_live"] and m["kv_bytes_peak"] == full["kv_bytes_peak"]
        assert m["kv_bytes_read_full"] == full["kv_bytes_read"] and m["evictions"] == 0
        assert m["budget_scope"] == "read"
        reads.append(m["kv_bytes_read"])
    assert reads[0] == full["kv_bytes_read"]  # 128 tokens hold every page: read densely
    assert reads == sorted(reads, reverse=True) and len(set(reads)) == len(reads)
    # a query head reads at most the budget; a KV head loads what any of its query heads reads
    group = sharp_llama.model.config.num_attention_heads // sharp_llama.kv_heads
    entry = 2 * sharp_llama.head_dim * 4
    assert reads[-1] <= 16 * group * entry * sharp_llama.kv_heads * sharp_llama.num_layers


def test_an_eviction_policy_reads_what_it_holds(sharp_llama):
    """window keeps `budget` entries between steps: a step reads those and the new one."""
    m = generate(sharp_llama, build_policy("window"), random_ids(PROMPT, seed=7), [], RunSettings(budget=40),
                 max_new_tokens=STEPS, eos_token_ids=set()).measurements
    entry = 2 * sharp_llama.head_dim * 4
    assert m["kv_bytes_read"] == 41 * entry * sharp_llama.kv_heads * sharp_llama.num_layers
    assert m["kv_bytes_read"] < m["kv_bytes_read_full"]


def test_dense_layers_read_every_slot(sharp_llama):
    steps, _ = traced_run(sharp_llama, quest(dense_layers=1), 24)
    assert all((mask is None) == (layer < 1) for layer, *_, mask in steps)


def test_chunked_prefill_reads_the_prompt_densely(sharp_llama):
    prompt = random_ids(PROMPT, seed=7)
    runs = [generate(sharp_llama, quest(), prompt, [], RunSettings(budget=32, **settings), max_new_tokens=STEPS,
                     eos_token_ids=set()) for settings in ({}, {"prefill": "chunked", "prefill_chunk": 32})]
    assert runs[0].tokens == runs[1].tokens


def test_refusals_are_one_line():
    with pytest.raises(KvbenchError, match="less than one page"):
        quest().check(Demand(budget=PAGE - 1))
    with pytest.raises(KvbenchError, match="takes no storage|keeps every entry"):
        build_policy("quest", {"storage": "quant"})
    lm = load_model("random:tiny-mistral-sliding", dtype="float32", device="cpu")
    with pytest.raises(KvbenchError, match="sliding-window layers"):
        Session(lm, quest(), RunSettings(budget=32), prompt_tokens=64)


def test_a_config_budget_below_one_page_is_refused_in_one_line(tmp_path):
    from tests.helpers import assert_rejected_in_one_line

    config = tmp_path / "quest.yaml"
    config.write_text("name: q\nmodel: {id: 'random:tiny-llama', dtype: float32, device: cpu}\npolicies: [quest]\n"
                      "budgets: [8]\ncontext_lengths: [64]\ntasks: [{name: niah}]\nsamples: 1\n")
    assert_rejected_in_one_line(config, "quest: budget 8 tokens is less than one page (page_size=16)", tmp_path / "run")


def test_uneven_heads_count_their_reads_without_a_read_back_per_step(sharp_llama, monkeypatch):
    """Ada-KV's heads hold uneven counts after the prompt: each decode step reads what the cache holds, counted on
    the device (no host count of the padding per layer and step, which on a GPU would wait for its queue)."""
    from kvbench.engine.cache import LayerKV

    session = Session(sharp_llama, build_policy("ada_kv"), RunSettings(budget=40), prompt_tokens=PROMPT)
    session.prefill(random_ids(PROMPT, seed=5))
    held = []
    for token in random_ids(STEPS, seed=6):
        with monkeypatch.context() as patched:
            patched.setattr(LayerKV, "live_entries", lambda self: pytest.fail("a host count during a decode step"))
            session.step(token)
        held.append(session.cache.live_bytes())  # a prompt-time policy evicts nothing while decoding
    assert session.cache.padding(0) is not None
    assert session.cache.stats().kv_bytes_read == pytest.approx(sum(held) / len(held))
