"""After physical eviction, the next token sees exactly the kept entries at their true positions."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.policies import build_policy
from kvbench.policies.reference import reference_attention, stock_forward
from tests.conftest import random_ids, sharpen
from tests.helpers import assert_model_close, model_tolerance, run_session


@pytest.mark.parametrize("name,params", [("window", {}), ("streaming_llm", {"sinks": 4}), ("h2o", {}),
                                         ("snapkv", {"window": 8}), ("random", {}), ("tova", {}),
                                         ("ada_kv", {"base": {"name": "snapkv", "window": 8}, "alpha": 0.2}),
                                         ("pyramidkv", {"window": 8, "beta": 4})])
@torch.inference_mode()
def test_evicted_cache_equals_masked_full_cache(sharp_llama, name, params):
    """Reference: a stock DynamicCache holding every entry, with attention masked to the kept
    positions of each layer and KV head, and the new token at position len(prompt)."""
    lm = sharp_llama
    prompt, following = random_ids(160, seed=6), random_ids(1, seed=7)
    session, history = run_session(lm, build_policy(name, params), prompt, [], budget=48)
    session.append(following)
    ours = session.logits

    stock = DynamicCache()
    with reference_attention(lm) as attention:
        stock_forward(lm, stock, prompt, 0)
        attention.allowed = dict(enumerate(history[-1]))
        reference = stock_forward(lm, stock, following, len(prompt))
    assert_model_close(lm, ours, reference)


@torch.inference_mode()
def test_window_equals_model_run_on_kept_tokens_with_original_positions():
    """With one layer, the kept K/V depend only on their own tokens and positions, so a window-compressed
    cache must give the logits of the model run on just the kept tokens at their original position ids."""
    from kvbench.engine.models import load_model

    lm = sharpen(load_model("random:tiny-llama", dtype="float32", device="cpu", seed=2))
    lm.model.model.layers = lm.model.model.layers[:1]
    lm.model.config.num_hidden_layers = 1
    prompt, budget = random_ids(120, seed=8), 32
    session, _ = run_session(lm, build_policy("streaming_llm", {"sinks": 4}), prompt, [], budget=budget)
    ours = session.step(65)

    kept_positions = list(range(4)) + list(range(len(prompt) - (budget - 4), len(prompt)))
    ids = torch.tensor([[prompt[p] for p in kept_positions] + [65]])
    positions = torch.tensor([kept_positions + [len(prompt)]])
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()[None, None]
    reference = lm.model(input_ids=ids, position_ids=positions, attention_mask=causal).logits[:, -1]
    assert_model_close(lm, ours, reference)  # the one-layer model's roundings
    # and RoPE really matters: contiguous positions give different logits
    contiguous = torch.arange(ids.shape[1])[None]
    shifted = lm.model(input_ids=ids, position_ids=contiguous, attention_mask=causal).logits[:, -1]
    assert (ours - shifted).abs().max() > 100 * model_tolerance(lm, reference)  # far beyond rounding
