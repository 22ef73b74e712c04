"""`full` (and every policy whose budget is never reached) must reproduce `model.generate` exactly."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.generation import generate
from kvbench.engine.settings import RunSettings
from kvbench.policies import POLICIES, Policy, build_policy
from tests.conftest import random_ids
from tests.helpers import assert_model_close, tiny_policy

NEW_TOKENS = 12


def stock_generate(lm, prompt: list[int]):
    lm.model.set_attn_implementation("sdpa")
    try:
        out = lm.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # token 0 is no padding here
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    finally:
        lm.model.set_attn_implementation("kvbench")
    return out.sequences[0, len(prompt) :].tolist(), out.logits[-1]


def ours(lm, policy, prompt, **settings):
    return generate(lm, policy, prompt, [], RunSettings(**settings), max_new_tokens=NEW_TOKENS, eos_token_ids=set())


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_full_is_bit_identical_to_generate(model, request):
    lm = request.getfixturevalue(model)
    prompt = random_ids(300, seed=3)
    tokens, logits = stock_generate(lm, prompt)
    result = ours(lm, build_policy("full"), prompt)
    assert result.tokens == tokens
    assert torch.equal(result.last_logits, logits)


# pyramidkv spreads layers x budget unevenly: its top layers evict even when the average budget fits; storage
# policies (quant, ...) compress every entry whatever the budget (tests/test_storage.py)
@pytest.mark.parametrize("name", sorted(n for n in set(POLICIES.names()) - {"full", "pyramidkv"}
                                        if POLICIES.get(n).layout is Policy.layout))
def test_policy_with_budget_above_sequence_is_bit_identical(tiny_llama, name):
    prompt = random_ids(200, seed=4)
    tokens, logits = stock_generate(tiny_llama, prompt)
    result = ours(tiny_llama, tiny_policy(name), prompt, budget=len(prompt) + NEW_TOKENS)
    assert result.measurements["evictions"] == 0
    assert result.tokens == tokens
    assert torch.equal(result.last_logits, logits)


@pytest.mark.parametrize("settings", [{"prefill": "chunked", "prefill_chunk": 64}, {"question": "agnostic"}])
def test_full_chunked_or_agnostic_matches_generate(tiny_llama, settings):
    """Feeding the prompt in pieces changes only floating-point summation order."""
    prompt = random_ids(300, seed=5)
    tokens, logits = stock_generate(tiny_llama, prompt)
    result = generate(tiny_llama, build_policy("full"), prompt[:250], prompt[250:], RunSettings(**settings),
                      max_new_tokens=NEW_TOKENS, eos_token_ids=set())
    assert result.tokens == tokens
    assert_model_close(tiny_llama, result.last_logits, logits)
