"""Batch > 1: left-padded prompts of different lengths decode as they would one by one."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.generation import generate, generate_batch
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from tests.conftest import random_ids
from tests.helpers import assert_model_close

LENGTHS = (41, 64, 29)


@pytest.mark.parametrize("policy, budget", [("full", None), ("window", 24), ("streaming_llm", 20), ("h2o", 24)])
def test_each_row_decodes_as_it_would_alone(sharp_llama, policy, budget):
    prompts = [random_ids(n, seed=n) for n in LENGTHS]
    settings = RunSettings(budget=budget)
    rows, measured = generate_batch(sharp_llama, build_policy(policy), prompts, settings, max_new_tokens=12,
                                    eos_token_ids=set())
    for prompt, row in zip(prompts, rows, strict=True):
        alone = generate(sharp_llama, build_policy(policy), prompt, [], settings, max_new_tokens=12,
                         eos_token_ids=set())
        assert row == alone.tokens, (policy, len(prompt))
    assert measured["batch"] == 3 and measured["generated_tokens"] == 36
    if budget:  # padding never counts as kept: every row holds the budget, as alone
        assert measured["kept_mean"] == budget and measured["kv_bytes_live"] == alone.measurements["kv_bytes_live"] * 3


def test_padding_is_masked_in_the_prompt_forward(sharp_llama):
    """A padded row's last logits equal the unpadded prompt's (padding changes nothing it can see)."""
    from kvbench.engine.session import Session

    short, long = random_ids(20, seed=1), random_ids(33, seed=2)
    batched = Session(sharp_llama, build_policy("full"), RunSettings(), 33, left_padding=torch.tensor([13, 0]))
    batched.prefill(torch.tensor([[0] * 13 + short, long]))
    alone = Session(sharp_llama, build_policy("full"), RunSettings(), 20)
    alone.prefill(short)
    assert_model_close(sharp_llama, batched.logits[0], alone.logits[0])
    assert batched.cache.layers[0].live_entries() == (20 + 33) * sharp_llama.kv_heads


def test_think_rows_of_one_length_each_keep_their_own_channels(sharp_llama):
    """ThinK batches rows of one length (no eviction): each row's key channels are chosen from its own prompt, so it
    decodes as alone, and the batch holds the rows' bytes."""
    prompts = [random_ids(48, seed=seed) for seed in (3, 4)]
    policy = {"ratio": 0.5, "window": 8, "recent": 4}
    rows, measured = generate_batch(sharp_llama, build_policy("think", policy), prompts, RunSettings(),
                                    max_new_tokens=10, eos_token_ids=set())
    for prompt, row in zip(prompts, rows, strict=True):
        alone = generate(sharp_llama, build_policy("think", policy), prompt, [], RunSettings(), max_new_tokens=10,
                         eos_token_ids=set())
        assert row == alone.tokens
    assert measured["kv_bytes_live"] == 2 * alone.measurements["kv_bytes_live"]


def test_quest_rows_read_as_they_would_alone(sharp_llama):
    """Quest pages each row from its own first token: a left-padded row reads the pages it reads alone, and its
    record counts its own bytes read."""
    from kvbench.engine.generation import Prompt, generate_rows

    quest = build_policy("quest", {"page_size": 8, "dense_layers": 0})
    prompts = [random_ids(n, seed=n) for n in LENGTHS]
    settings = RunSettings(budget=16)
    rows = generate_rows(sharp_llama, quest, [Prompt(p, [], 12) for p in prompts], settings, eos_token_ids=set())
    for prompt, row in zip(prompts, rows, strict=True):
        alone = generate(sharp_llama, quest, prompt, [], settings, max_new_tokens=12, eos_token_ids=set())
        assert row.tokens == alone.tokens, len(prompt)
        for column in ("kv_bytes_read", "kv_bytes_read_full", "kv_bytes_live"):
            assert row.measurements[column] == alone.measurements[column], (column, len(prompt))
        assert row.measurements["kv_bytes_read"] < row.measurements["kv_bytes_read_full"]
