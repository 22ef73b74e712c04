"""The per-scenario recommendation: tasks name their workload, and the report picks, per scenario, the smallest
cache that keeps every task of it within the allowed drop."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.analysis.report import advice_lines, scenario_advice
from tasks import TASKS


def cell(scenario, task, policy, budget, score, low, high, ratio, length=1024, higher=True):
    return {"model": "smollm2-135m", "dtype": "float32", "scenario": scenario, "task": task,
            "context_length": length, "question": "aware", "prefill": "full",
            "policy": policy, "params": "", "budget": budget, "score": score, "delta_ci_low": low,
            "delta_ci_high": high, "higher_is_better": higher, "cache_ratio": ratio}


def test_tasks_name_their_scenario():
    assert TASKS.build("niah").workload() == "prompt-heavy"
    assert TASKS.build("longgen").workload() == "generation-heavy"
    assert TASKS.build("multiquery", {"mode": "multi_turn"}).workload() == "generation-heavy"
    assert TASKS.build("multiquery", {"mode": "multi_request"}).workload() == "shared-context"
    assert TASKS.build("dialogue").workload() == "dialogue"
    assert TASKS.build("perplexity").workload() == "streaming"


def test_each_scenario_gets_the_smallest_cache_within_the_drop_on_every_task():
    frame = pd.DataFrame([
        cell("prompt-heavy", "niah", "full", "-", 0.8, None, None, 1.0),
        cell("prompt-heavy", "ruler", "full", "-", 0.6, None, None, 1.0),
        # snapkv at 0.25 holds on niah but not on ruler: the scenario needs both, so 0.5 is the answer
        cell("prompt-heavy", "niah", "snapkv", "0.25", 0.8, 0.0, 0.0, 0.25),
        cell("prompt-heavy", "ruler", "snapkv", "0.25", 0.4, -0.3, -0.1, 0.25),
        cell("prompt-heavy", "niah", "snapkv", "0.5", 0.8, 0.0, 0.0, 0.5),
        cell("prompt-heavy", "ruler", "snapkv", "0.5", 0.6, -0.01, 0.0, 0.5),
        cell("prompt-heavy", "niah", "h2o", "0.5", 0.8, 0.0, 0.0, 0.49),  # missing on ruler: does not qualify
        cell("prompt-heavy", "niah", "tova", "0.8", 0.8, 0.0, 0.0, 0.8),  # passes with no change, but is larger
        cell("prompt-heavy", "ruler", "tova", "0.8", 0.6, 0.0, 0.0, 0.8),
        # lower is better (perplexity of a continuation): a rise of 1% of full's 20 at the CI's high end is 1 point
        cell("generation-heavy", "longgen", "full", "-", 20.0, None, None, 1.0, higher=False),
        cell("generation-heavy", "longgen", "h2o", "0.25", 20.1, 0.0, 0.2, 0.25, higher=False),
        cell("generation-heavy", "longgen", "snapkv", "0.25", 25.0, 4.0, 6.0, 0.6, higher=False),
        cell("dialogue", "dialogue", "full", "-", 1.0, None, None, 1.0),
        cell("dialogue", "dialogue", "window", "0.5", 0.5, -0.8, -0.2, 0.5),
    ])
    advice = scenario_advice(frame, max_drop=2).set_index("scenario")
    assert advice.loc["prompt-heavy", "budget"] == "0.5" and advice.loc["prompt-heavy", "policy"] == "snapkv"
    assert advice.loc["prompt-heavy", "tasks"] == "niah, ruler"
    assert advice.loc["prompt-heavy", "worst_change"] == pytest.approx(-1.0)
    assert advice.loc["generation-heavy", "policy"] == "h2o"
    assert advice.loc["generation-heavy", "worst_change"] == pytest.approx(-1.0)
    assert pd.isna(advice.loc["dialogue", "policy"]) and "closest: window at 0.5 (-80.0)" in \
        advice.loc["dialogue", "note"]
    lines = advice_lines(scenario_advice(frame, max_drop=2), 2)
    assert lines[0].startswith("prompt-heavy (niah, ruler): snapkv at 0.5 scores 0.7 where full scores 0.7")
    assert "keep the full cache" in lines[-1]
    # a stricter drop moves the choice: h2o's worst change of -1 point does not pass 0.5
    assert pd.isna(scenario_advice(frame, max_drop=0.5).set_index("scenario").loc["generation-heavy", "policy"])
