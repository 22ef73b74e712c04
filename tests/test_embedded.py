"""Tests on the real embedded model (SmolLM2-135M-Instruct): few and short."""

from __future__ import annotations

from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task
from tests.conftest import needs_embedded


@needs_embedded
def test_full_finds_the_needle_and_a_small_window_does_not(smollm):
    task = build_task("niah", {"depths": [0.1]})
    sample = task.samples(smollm.tokenizer, 1024, count=1, seed=0)[0]
    full = evaluate(smollm, task, build_policy("full"), sample, RunSettings(), 1024, seed=0)
    window = evaluate(smollm, task, build_policy("window"), sample, RunSettings(budget=128), 1024, seed=0)
    assert full["scores"]["score"] == 1.0, full["prediction"]
    assert window["scores"]["score"] == 0.0, window["prediction"]
    assert window["cache_ratio"] < 0.15 and full["cache_ratio"] == 1.0
