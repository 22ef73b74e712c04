"""Every family kvbench is tested on (a tiny random config of the real architecture each): `full` reproduces
`model.generate`, a window covering what the model can see does too, and SnapKV and H2O keep what the independent
reference (tests/reference.py, eager attention over a stock cache, sliding windows applied from positions) keeps.
Architectures kvbench cannot drive stop at load time with one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from kvbench.engine import models
from kvbench.engine.generation import generate
from kvbench.engine.models import load_model
from kvbench.engine.session import Session
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.reference import h2o_reference, snapkv_reference
from tests.conftest import random_ids
from tests.helpers import assert_model_close, run_cache

FAMILIES = ["tiny-mistral", "tiny-mistral-sliding", "tiny-qwen3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3",
            "tiny-mixtral"]
SLIDING = [shape for shape in FAMILIES if models.RANDOM_SHAPES[shape][1].get("sliding_window")]
NEW_TOKENS = 12
PROMPT, DECODE = random_ids(60, seed=21), random_ids(10, seed=22)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return load_model(f"random:{request.param}", dtype="float32", device="cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def sharp_family(request):
    """Peaked attention (random weights attend almost uniformly, where scores tie): every layer's logits x 30,
    through the scaling the model's attention passes to the attention function (q/k norms and fused projections
    make the weights the wrong place to sharpen)."""
    lm = load_model(f"random:{request.param}", dtype="float32", device="cpu", seed=1)
    for layer in lm.model.model.layers:
        layer.self_attn.scaling *= 30.0
    return lm


def window_of(lm) -> int | None:
    windows = {kind.window for kind in lm.layer_kinds} - {None}
    return windows.pop() if windows else None


def stock_generate(lm, prompt: list[int]):
    """`model.generate` with transformers' own attention: eager where the logits are soft-capped (SDPA cannot)."""
    softcapped = any(kind.softcap is not None for kind in lm.layer_kinds)
    lm.model.set_attn_implementation("eager" if softcapped else "sdpa")
    try:
        out = lm.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    finally:
        lm.model.set_attn_implementation("kvbench")
    return out.sequences[0, len(prompt) :].tolist(), out.logits[-1]


def ours(lm, policy: str, budget: int | None = None, **settings):
    return generate(lm, build_policy(policy), PROMPT, [], RunSettings(budget=budget, **settings),
                    max_new_tokens=NEW_TOKENS, eos_token_ids=set())


def assert_same_generation(lm, result, tokens, logits):
    """Same greedy tokens, logits equal up to summation order (a sliding layer's slots are not in position order)."""
    assert result.tokens == tokens
    assert_model_close(lm, result.last_logits, logits)


@pytest.mark.parametrize("settings", [{}, {"prefill": "chunked", "prefill_chunk": 16}])
def test_full_matches_generate(family, settings):
    tokens, logits = stock_generate(family, PROMPT)
    assert_same_generation(family, ours(family, "full", **settings), tokens, logits)


def test_window_covering_what_the_model_sees_matches_generate(family):
    """On sliding layers the window slides as the stock cache's does; a budget covering the global layers' whole
    sequence evicts nothing there (the issue: Mistral, window 8, budget 16, diverged at the 4th token)."""
    tokens, logits = stock_generate(family, PROMPT)
    global_layers = any(kind.window is None for kind in family.layer_kinds)
    budget = len(PROMPT) + NEW_TOKENS if global_layers else 2 * window_of(family)
    result = ours(family, "window", budget)
    assert result.measurements["evictions"] == 0
    assert_same_generation(family, result, tokens, logits)


@pytest.mark.parametrize("budget", [6, 24])  # below the sliding window (8): the policy evicts there too
def test_h2o_matches_reference(sharp_family, budget):
    recent_ratio = 0.5
    _, history = run_cache(sharp_family, build_policy("h2o", {"recent_ratio": recent_ratio}), PROMPT, DECODE, budget)
    reference = h2o_reference(sharp_family, PROMPT, DECODE, budget, recent=round(budget * recent_ratio))
    for step, (mine, theirs) in enumerate(zip(history, reference, strict=True)):
        for layer, (mask, expected) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(mask, expected), f"step {step} layer {layer}"


@pytest.mark.parametrize("budget", [6, 24])
def test_snapkv_matches_reference(sharp_family, budget):
    window = 4
    params = {"window": window, "kernel": 3, "pooling": "max"}
    cache, history = run_cache(sharp_family, build_policy("snapkv", params), PROMPT, [], budget)
    reference = snapkv_reference(sharp_family, PROMPT, window=window, kernel=3, pooling="max")
    prefix = len(PROMPT) - window
    for layer, (mask, scores) in enumerate(zip(history[0], reference, strict=True)):
        sliding = cache.layers[layer].kind.window
        assert mask[:, prefix:].all(), "the observation window is always kept"
        held = budget if sliding is None else min(budget, sliding - 1)
        for head in range(sharp_family.kv_heads):
            # max pooling makes plateaus of equal scores: compare the kept scores, not which of tied positions
            kept = scores[head][mask[head, :prefix]].sort().values
            best = scores[head].topk(held - window).values.sort().values
            torch.testing.assert_close(kept, best, msg=f"layer {layer} head {head}")


@pytest.mark.parametrize("shape", SLIDING)
def test_sliding_layers_hold_only_their_window(shape):
    """A sliding layer never holds more than window - 1 entries between forwards, nor a buffer sized by the
    prompt; `kv_bytes_full` counts what the stock cache holds, and the record names the layer kinds."""
    lm = load_model(f"random:{shape}", dtype="float32", device="cpu")
    session = Session(lm, build_policy("full"), RunSettings(), prompt_tokens=len(PROMPT), adds=len(DECODE))
    with session:
        session.prefill(PROMPT)
        for token in DECODE:
            session.step(token)
            for layer in session.cache.layers:
                window = layer.kind.window
                if window is not None:
                    held = layer.held_slots()[0, 0]
                    assert int(held.sum()) == window - 1 and layer.capacity < 2 * window
                    assert sorted(layer.live_positions()[0, 0][held].tolist()) == list(
                        range(session.seen - window + 1, session.seen))
    record = session.measurements()
    kinds = [kind.name for kind in lm.layer_kinds]
    assert record["layer_kinds"] == {name: kinds.count(name) for name in set(kinds)}
    window = window_of(lm)
    entry = 2 * lm.kv_heads * lm.head_dim * 4
    seen = len(PROMPT) + len(DECODE)
    assert record["kv_bytes_full"] == sum(seen if k == "full" else window - 1 for k in kinds) * entry
    assert record["kv_bytes_live"] == record["kv_bytes_full"]


TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, vocab_size=512)


@pytest.mark.parametrize("model_type,params,message", [
    ("mamba", {**TINY_CONFIG, "intermediate_size": 128}, "model architecture 'mamba' has linear_attention layers"),
    ("qwen3", {**TINY_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 2,
               "layer_types": ["full_attention", "chunked_attention"]}, "'qwen3' has chunked_attention layers"),
    ("t5", {"d_model": 64, "num_layers": 2, "vocab_size": 512}, "encoder-decoder"),
])
def test_unsupported_architectures_fail_loudly(monkeypatch, model_type, params, message):
    monkeypatch.setitem(models.RANDOM_SHAPES, "tiny-unsupported", (model_type, params))
    with pytest.raises(KvbenchError, match=message) as raised:
        load_model("random:tiny-unsupported", dtype="float32", device="cpu")
    assert "kvbench drives decoder-only models of full_attention and sliding_attention layers" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_model_without_custom_attention_fails_loudly():
    config = AutoConfig.for_model("mamba", **TINY_CONFIG)
    model_class = models.AutoModelForCausalLM._model_mapping[type(config)]
    with pytest.raises(KvbenchError, match="'MambaForCausalLM' does not take a custom attention implementation"):
        models.check_model_class(model_class)


@pytest.mark.parametrize("shape", SLIDING)
def test_sliding_mask_follows_positions_after_decode_evictions(shape):
    """Decode steps move the newest entry into the evicted slot, so slot order leaves position order; a chunk fed
    after them must still see, per query, the window of true positions: the logits of a stock forward."""
    lm = load_model(f"random:{shape}", dtype="float32", device="cpu")
    session = Session(lm, build_policy("full"), RunSettings(), prompt_tokens=40, arrival=15, adds=20)
    session.prefill(PROMPT[:40])
    for token in PROMPT[40:45]:
        session.step(token)
    session.append(PROMPT[45:])
    softcapped = any(kind.softcap is not None for kind in lm.layer_kinds)
    lm.model.set_attn_implementation("eager" if softcapped else "sdpa")
    try:
        with torch.inference_mode():
            expected = lm.model(input_ids=torch.tensor([PROMPT])).logits[:, -1]
    finally:
        lm.model.set_attn_implementation("kvbench")
    assert_model_close(lm, session.logits, expected)
