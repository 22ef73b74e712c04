"""Fidelity to the full cache: KL, agreement and attention recall against references from their definitions."""

from __future__ import annotations

import pytest
import torch

from kvbench.checks.tolerance import sum_roundings
from kvbench.engine.generation import generate
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from tests.conftest import random_ids
from tests.helpers import assert_close, assert_model_close

PROMPT = random_ids(120, seed=21)


def run(lm, name: str, budget: int | None, tokens: int = 10):
    return generate(lm, build_policy(name), PROMPT, [], RunSettings(budget=budget, fidelity=True),
                    max_new_tokens=tokens, eos_token_ids=set())


def test_the_full_cache_is_faithful_to_itself(tiny_llama):
    generation = run(tiny_llama, "full", None)
    measured = generation.measurements
    # KL sums p (log p - log q): log-probabilities of this size, equal up to the model's rounding, give at most that
    logprobs = generation.last_logits.float().log_softmax(-1)
    assert_model_close(tiny_llama, measured["kl_max"], 0.0, floor=float(logprobs.abs().max()))
    assert measured["top1_agreement"] == 1.0 and measured["first_divergence"] is None
    # the whole attention: a softmax's normalizing sum over every slot, then the recall's sum of it
    assert_close(measured["attn_recall"], 1.0, roundings=sum_roundings(2 * (len(PROMPT) + 10)))
    assert len(measured["kl_by_position"]) == 10 and len(measured["attn_recall_by_layer"]) == tiny_llama.num_layers


def test_fidelity_changes_nothing_the_policy_does(sharp_llama):
    plain = generate(sharp_llama, build_policy("h2o"), PROMPT, [], RunSettings(budget=32), max_new_tokens=10,
                     eos_token_ids=set())
    followed = run(sharp_llama, "h2o", 32)
    assert followed.tokens == plain.tokens and torch.equal(followed.last_logits, plain.last_logits)
    assert followed.measurements["kv_bytes_live"] == plain.measurements["kv_bytes_live"]
    assert followed.measurements["kl_mean"] > 0 and followed.measurements["attn_recall"] < 1


def test_attention_recall_of_a_window_is_the_full_attention_on_its_last_entries(sharp_llama):
    """Reference: the stock model's eager attention over prompt + generated tokens; at each decode step a window
    of `budget` holds the last budget entries plus the new token, so its recall is the mass on those."""
    budget = 24
    generation = run(sharp_llama, "window", budget)
    ids = PROMPT + generation.tokens[:-1]
    model = sharp_llama.model
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    finally:
        model.set_attn_implementation("kvbench")
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    per_layer = []
    for weights in attentions:  # [1, heads, T, T]
        steps = []
        for query in range(len(PROMPT), len(ids)):
            by_kv_head = weights[0, :, query, : query + 1].reshape(-1, group, query + 1).mean(1)
            steps.append(float(by_kv_head[:, query - budget :].sum(-1).mean()))
        per_layer.append(sum(steps) / len(steps))
    measured = generation.measurements
    # shares of the model's attention (at most 1), computed by the model another way
    assert_model_close(sharp_llama, measured["attn_recall_by_layer"], per_layer)
    assert_model_close(sharp_llama, measured["attn_recall"], sum(per_layer) / len(per_layer))


def test_kl_and_agreement_are_the_definitions(sharp_llama):
    """Reference: the stock model's next-token distributions on the policy's own tokens (full cache) against the
    policy's logits at each step (from a run that records them)."""
    from kvbench.engine.session import Session

    generation = run(sharp_llama, "window", 24)
    ids = PROMPT + generation.tokens[:-1]
    with torch.no_grad():
        full = sharp_llama.model(input_ids=torch.tensor([ids])).logits[0, len(PROMPT) - 1 :].float().log_softmax(-1)
    session = Session(sharp_llama, build_policy("window"), RunSettings(budget=24), len(PROMPT), adds=16)
    policy = []
    with session:
        session.prefill(PROMPT)
        session.decode(10, set(), follow=lambda token, logits: policy.append(logits[0].float().log_softmax(-1)))
    policy = torch.stack(policy)
    kl = (full.exp() * (full - policy)).sum(-1)
    measured = generation.measurements
    # p-weighted differences of log-probabilities: the model's tolerance at the log-probabilities' size
    assert_model_close(sharp_llama, measured["kl_by_position"], kl, floor=float(full.abs().max()))
    agree = (full.argmax(-1) == torch.tensor(generation.tokens)).tolist()
    assert measured["top1_agreement"] == pytest.approx(sum(agree) / len(agree))
    assert measured["first_divergence"] == next((i for i, same in enumerate(agree) if not same), None)


def test_a_sweep_with_fidelity_summarizes_it(tmp_path):
    import pandas as pd

    from tests.test_sweep import TINY, sweep, write_config

    config = {**TINY, "policies": ["full", "window"], "budgets": [32], "samples": 1, "diagnostics": ["fidelity"]}
    sweep(write_config(tmp_path, config), tmp_path / "run")
    frame = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert {"kl_mean", "kl_mean_ci_low", "top1_agreement", "attn_recall", "length_ratio"} <= set(frame.columns)
    assert frame[frame["policy"] == "full"].iloc[0]["length_ratio"] == 1.0
    window = frame[frame["policy"] == "window"].iloc[0]
    assert window["attn_recall"] < 1
    slots = config["context_lengths"][0] + config["max_new_tokens"]  # the softmax's and the recall's sums over them
    assert_close(frame[frame["policy"] == "full"].iloc[0]["attn_recall"], 1.0, roundings=sum_roundings(2 * slots))

    from kvbench.analysis.plot import figures
    from kvbench.analysis.report import failure_gallery, recommend
    from kvbench.analysis.summary import summarize

    names = set(figures(tmp_path / "run"))
    assert {"kl_vs_ratio_niah", "recall_vs_ratio_niah", "kl_vs_position_niah", "recall_by_layer_niah"} <= names
    summary = summarize(tmp_path / "run", write=False)
    assert recommend(summary, max_drop=100).iloc[0]["policy"] == "window"  # random weights: every score is 0
    strict = recommend(summary, max_drop=100, max_kl=window["kl_mean"] / 2).iloc[0]
    assert strict["policy"] is None and "KL" in strict["note"]
    assert failure_gallery(tmp_path / "run") == []  # random weights: no sample to lose
    from kvbench.analysis.report import html_report

    page = html_report(tmp_path / "run").read_text()
    assert "attn_recall" in page and "recall_by_layer_niah" in page and "kl_vs_position_niah" in page


def test_the_gallery_marks_where_a_prediction_leaves_full():
    from kvbench.analysis.report import _mark_departure

    assert _mark_departure("The number is 123", "The number is 456") == "The number is ⟦123"
    assert _mark_departure("same", "same") == "same" and _mark_departure("ab", "abc") == "ab⟦"
