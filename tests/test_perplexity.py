"""Perplexity under eviction: equal to the model's own loss when nothing is evicted, worse when it is."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task
from kvbench.tasks.corpus import load_corpus
from tests.conftest import needs_embedded
from tests.helpers import model_approx


def one_pass_perplexity(lm, ids: list[int]) -> float:
    with torch.no_grad():
        inputs = torch.tensor([ids])
        return math.exp(lm.model(input_ids=inputs, labels=inputs).loss.item())


@pytest.mark.parametrize("params", [{"mode": "chunked", "chunk": 24}, {"mode": "exact"}])
def test_full_cache_perplexity_is_the_one_pass_loss(tiny_llama, params):
    task = build_task("perplexity", params)
    sample = task.samples(tiny_llama.tokenizer, 150, 1, seed=0)[0]
    record = evaluate(tiny_llama, task, build_policy("full"), sample, RunSettings(), 150, seed=0)
    assert len(sample.token_ids) == 150 and len(record["nll_by_position"]) == 149
    # a perplexity's log, the mean log-probability, is the model's output
    one_pass = one_pass_perplexity(tiny_llama, sample.token_ids)
    assert record["scores"]["nll"] == model_approx(tiny_llama, math.log(one_pass))
    assert record["scores"]["score"] == pytest.approx(math.exp(record["scores"]["nll"]))
    assert record["higher_is_better"] is False and "ppl_past_budget" not in record["scores"]
    # a budget above the text evicts nothing: the same numbers
    roomy = evaluate(tiny_llama, task, build_policy("window"), sample, RunSettings(budget=400), 150, seed=0)
    assert roomy["scores"]["nll"] == model_approx(tiny_llama, record["scores"]["nll"])


def test_the_cache_really_holds_the_budget(tiny_llama):
    task = build_task("perplexity", {"mode": "chunked", "chunk": 16})
    sample = task.samples(tiny_llama.tokenizer, 300, 1, seed=0)[0]
    record = evaluate(tiny_llama, task, build_policy("h2o"), sample, RunSettings(budget=48), 300, seed=0)
    assert record["kept_max_ever"] <= 48 + 16 and record["kept_mean"] == 48
    assert record["scores"]["ppl_past_budget"] > 0
    assert record["cache_ratio"] == pytest.approx(48 / 299)  # the last token is only a target, never fed


@needs_embedded
def test_a_small_window_forgets_what_the_text_repeats(smollm, tmp_path):
    # a passage said three times: with the whole text in cache the model copies the repeats
    (tmp_path / "repeat.txt").write_text(" ".join([load_corpus("embedded")[:900]] * 3))
    task = build_task("perplexity", {"corpus": str(tmp_path / "repeat.txt"), "chunk": 32})
    sample = task.samples(smollm.tokenizer, 480, 1, seed=0)[0]
    full = evaluate(smollm, task, build_policy("full"), sample, RunSettings(), 480, seed=0)
    window = evaluate(smollm, task, build_policy("window"), sample, RunSettings(budget=64), 480, seed=0)
    assert window["scores"]["score"] > 2 * full["scores"]["score"], (window["scores"], full["scores"])


def test_corpora_and_their_errors(tiny_llama, tmp_path, monkeypatch):
    with pytest.raises(KvbenchError, match="fewer than the context length"):
        (tmp_path / "short.txt").write_text("only a few words here")
        build_task("perplexity", {"corpus": str(tmp_path / "short.txt")}).samples(tiny_llama.tokenizer, 500, 1, 0)
    with pytest.raises(KvbenchError, match="mode"):
        build_task("perplexity", {"mode": "fast"})

    calls = []

    class Rows:
        column_names = ["text"]

        def __getitem__(self, column):
            return ["Call me Ishmael.", "Some years ago."]

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda repo, config, split: calls.append((repo, config, split)) or Rows()
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_corpus("hf:wikitext") == "Call me Ishmael. Some years ago."
    load_corpus("hf:pg19")
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "test"), ("emozilla/pg19-test", None, "test")]
    load_corpus.cache_clear()
