"""Calibrated Expected Attention: `kvbench calibrate --method expected-attention` computes the pre-RoPE queries' mean
and covariance as kvpress's collect_queries does, in kvpress's ExpectedAttentionStats format; the
`expected_attention_stats` policy is `expected_attention` with those statistics in place of the prompt's own."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvbench.calibration.calibrate import (
    STATS_SINKS,
    Settings,
    calibrate,
    corpus_documents,
    load_query_statistics,
    query_statistics,
    save_query_statistics,
)
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.reference import stock_forward
from tests.conftest import random_ids
from tests.helpers import run_session
from tests.test_kvpress_policies import QueryTap

PROMPT, BUDGET = random_ids(96, seed=31), 40
SETTINGS = Settings(documents=2, tokens=64)
PROVENANCE = {"corpus": "prompt", "model": "random:tiny-llama", "documents": 1, "tokens": len(PROMPT)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(("Seven wizards hex jovial mice; the quick brown fox jumps over the lazy dog. " * 3)[:140])
    return path


@torch.no_grad()
def test_the_statistics_are_kvpress_s_collect_queries_in_its_format(sharp_llama, corpus, tmp_path):
    """Every pre-RoPE query (q_proj on the attention's input) of both documents but each one's first 4: their mean,
    and their covariance over n - 1."""
    calibrate(sharp_llama, "expected-attention", str(corpus), SETTINGS, tmp_path)
    tap = QueryTap(sharp_llama)
    try:
        for ids in corpus_documents(sharp_llama, str(corpus), SETTINGS, "expected-attention"):
            stock_forward(sharp_llama, DynamicCache(), ids, 0)
    finally:
        tap.close()
    stats = load_query_statistics(tmp_path)
    for layer in range(sharp_llama.num_layers):
        queries = torch.cat([q[:, STATS_SINKS:] for q in tap.queries[layer]], dim=1)  # [H, n, D]
        centered = queries - queries.mean(dim=1, keepdim=True)
        torch.testing.assert_close(stats["query_mean"][layer].double(), queries.mean(dim=1), atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(stats["query_cov"][layer].double(),
                                   centered.transpose(1, 2) @ centered / (queries.shape[1] - 1), atol=1e-6, rtol=1e-4)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"num_layers": 2, "num_heads": 4, "head_dim": 16, "dataset_name": str(corpus),
                      "model_name": "random:tiny-llama", "num_samples": 2, "sample_seq_len": 64, "n_sink": 4}


@pytest.fixture
def own_statistics(sharp_llama, tmp_path):
    """The prompt's own statistics, with the covariance over n as expected_attention estimates it."""
    stats = query_statistics(sharp_llama, [PROMPT], lambda done, total: None)
    counted = len(PROMPT) - STATS_SINKS
    stats["query_cov"] = stats["query_cov"] * (counted - 1) / counted
    save_query_statistics(stats, tmp_path / "own", PROVENANCE)
    return stats, tmp_path / "own"


def test_with_the_prompt_s_own_statistics_it_keeps_what_expected_attention_keeps(sharp_llama, own_statistics):
    _, folder = own_statistics
    _, estimated = run_session(sharp_llama, build_policy("expected_attention"), PROMPT, [], BUDGET)
    _, calibrated = run_session(sharp_llama, build_policy("expected_attention_stats", {"stats_folder": str(folder)}),
                                PROMPT, [], BUDGET)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(calibrated[0], estimated[0], strict=True))


@pytest.mark.parametrize("how", ["sign", "layers"])
def test_a_broken_artifact_keeps_other_entries(sharp_llama, own_statistics, tmp_path, how):
    stats, _ = own_statistics
    if how == "sign":
        stats = {**stats, "query_mean": -stats["query_mean"]}
    else:
        stats = {name: value.flip(0) for name, value in stats.items()}
    save_query_statistics(stats, tmp_path / how, PROVENANCE)
    _, estimated = run_session(sharp_llama, build_policy("expected_attention"), PROMPT, [], BUDGET)
    policy = build_policy("expected_attention_stats", {"stats_folder": str(tmp_path / how)})
    _, broken = run_session(sharp_llama, policy, PROMPT, [], BUDGET)
    assert not all(torch.equal(mine, theirs) for mine, theirs in zip(broken[0], estimated[0], strict=True))


def test_a_missing_artifact_names_the_command_that_makes_it(sharp_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    with pytest.raises(KvbenchError, match=r"^policy 'expected_attention_stats': no query statistics in .*: make them "
                                           r"with `kvbench calibrate -m random:tiny-llama --method expected-attention "
                                           r"--dtype float32`$"):
        run_session(sharp_llama, build_policy("expected_attention_stats"), PROMPT, [], BUDGET)
