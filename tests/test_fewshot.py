"""The fewshot task: its exact match against answers made by hand, the examples that fill the context and their
segments, the split an eviction makes, `whole_segments` keeping examples whole, and a run under every policy."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvbench.engine.attention import LayerKind
from kvbench.engine.segments import Segment, segment_measurements
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.policies.base import build_spec
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task
from kvbench.tasks.base import encode_prompt
from tests.conftest import needs_embedded
from tests.test_batch_sweep import POLICY_SPECS

# every registered policy once, at parameters that fit the tiny models' prompts: the batch sweep's grid, which its own
# test keeps complete
SPECS = {spec if isinstance(spec, str) else spec["name"]: spec for spec in reversed(POLICY_SPECS)}


@pytest.mark.parametrize(("operation", "check"), [
    ("kebab", lambda words, output: output == "-".join(words.split())),
    ("title", lambda words, output: output == words.title() and output.lower() == words),
    ("add", lambda numbers, output: int(output) == sum(map(int, numbers.split(" + "))) and len(numbers) == 9),
])
def test_each_operation_makes_the_output_of_its_input(operation, check):
    task = build_task("fewshot", {"operation": operation})
    for seed in range(5):
        given, expected = task.instance(random.Random(seed))
        assert check(given, expected), (given, expected)


def test_the_score_is_an_exact_match(tiny_llama):
    task = build_task("fewshot")
    sample = task.samples(tiny_llama.tokenizer, 300, 1, 0)[0]
    answer = sample.answers[0]
    assert "-" in answer and task.score(answer, sample) == {"score": 1.0}
    for wrong in (answer.replace("-", " "), answer + "-and", answer.upper(), ""):
        assert task.score(wrong, sample)["score"] == 0.0, wrong


def test_a_segment_is_whole_split_or_dropped_per_layer_and_head_where_a_stock_cache_holds_it():
    def layer(*heads: list[int]) -> SimpleNamespace:
        return SimpleNamespace(seen=10, live_positions=lambda: torch.tensor([heads]),
                               held_slots=lambda: torch.ones(1, len(heads), len(heads[0]), dtype=torch.bool))

    # layer 0: head 0 holds 0-3 and 7, head 1 holds 2-6; a sliding layer whose window passed everything: not counted
    cache = SimpleNamespace(layers=[layer([0, 1, 2, 3, 7], [2, 3, 4, 5, 6]), layer([9], [9])],
                            kinds=[LayerKind(), LayerKind(window=4)])
    measured = segment_measurements(cache, (Segment("a", 0, 2), Segment("b", 2, 4), Segment("c", 4, 8)))
    assert [(s["label"], s["whole"], s["split"], s["dropped"]) for s in measured["segments"]] == [
        ("a", 0.5, 0.0, 0.5), ("b", 1.0, 0.0, 0.0), ("c", 0.0, 1.0, 0.0)]
    assert measured["segments_split"] == 1 / 3 and measured["segments_dropped"] == 0.0


def test_whole_examples_fill_the_context_and_each_is_a_segment(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    for length in (300, 800):
        for sample in build_task("fewshot", {"operation": "title"}).samples(tokenizer, length, 2, 1):
            examples = sample.context.split("\n\n")
            assert len(examples) == sample.meta["examples"] >= 2 and all(e.startswith("Input: ") for e in examples)
            context, question = encode_prompt(tokenizer, sample)
            longest = max(len(tokenizer(e).input_ids) for e in examples)
            assert length - longest - 2 <= len(context) + len(question) <= length
    with pytest.raises(KvbenchError, match="too short"):
        build_task("fewshot").samples(tokenizer, 40, 1, 0)


def run(lm, policy, budget=0.5, **params):
    task = build_task("fewshot", {"answer_tokens": 3, **params})
    sample = task.samples(lm.tokenizer, 500, 1, 0)[0]
    return evaluate(lm, task, policy, sample, RunSettings(budget=budget), 500, 0)


@pytest.mark.parametrize("base", [{"name": "snapkv", "window": 8}, {"name": "h2o", "recent_ratio": 0.5}])
def test_whole_segments_keeps_or_drops_every_example_whole_where_its_base_splits_them(sharp_llama, base):
    split = run(sharp_llama, build_spec(base))
    whole = run(sharp_llama, build_policy("whole_segments", {"base": base}))
    assert split["segments_split"] > 0.5
    assert whole["segments_split"] == 0.0 and all(s["whole"] + s["dropped"] == 1.0 for s in whole["segments"])
    assert any(s["whole"] > 0 for s in whole["segments"]) and any(s["dropped"] > 0 for s in whole["segments"])
    assert whole["kept_max"] <= split["kept_max"] and whole["evictions"] > 0  # within the budget, as its base


def test_whole_segments_fills_what_a_segment_too_large_leaves_with_the_next_that_fit_then_loose_entries():
    """Four examples of 4, 5, 2 and 2 entries ranked in that order, and one entry outside them, at a budget of 7.
    Head 0 ranks the loose entry last: the second example does not fit beside the first, the third does (the better
    of the two that would), the fourth then does not, and the loose entry fills the budget. Head 1 ranks the loose
    entry first: it is kept with the first example, then the third. Each head keeps its whole budget, no example
    cut."""
    policy = build_policy("whole_segments")
    policy._segments = (Segment("example 1", 0, 4), Segment("example 2", 4, 9), Segment("example 3", 9, 11),
                        Segment("example 4", 11, 13))
    examples = [0.9] * 4 + [0.5] * 5 + [0.3] * 2 + [0.2] * 2
    scores = torch.tensor([[examples + [0.1], examples + [0.95]]])
    policy.stage = lambda cache: SimpleNamespace(score=lambda layer, budget: scores)
    layer = SimpleNamespace(owner=None, live_positions=lambda: torch.arange(14).expand(1, 2, 14), padding=lambda: None)
    kept = policy.select(layer, 7)
    assert [row.nonzero()[:, 0].tolist() for row in kept[0]] == [[0, 1, 2, 3, 9, 10, 13]] * 2
    assert kept.sum(-1).tolist() == [[7, 7]]
    # a budget the second example fits beside the first: the first two, then the loose entry where it ranks
    kept = policy.select(layer, 10)
    assert [row.nonzero()[:, 0].tolist() for row in kept[0]] == [[*range(9), 13]] * 2


def test_whole_segments_without_segments_is_its_base(tiny_llama):
    task = build_task("niah", {"depths": [0.5]})
    sample = task.samples(tiny_llama.tokenizer, 300, 1, 0)[0]
    base, wrapped = (evaluate(tiny_llama, task, policy, sample, RunSettings(budget=100), 300, 0)
                     for policy in (build_policy("snapkv"), build_policy("whole_segments")))
    assert wrapped["prediction"] == base["prediction"] and wrapped["kept_mean"] == base["kept_mean"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_it_runs_under_every_policy(tiny_llama, name):
    record = run(tiny_llama, build_spec(SPECS[name]))
    assert record["scores"]["score"] in (0.0, 1.0) and len(record["segments"]) == record["meta"]["examples"]


@needs_embedded
def test_the_embedded_model_does_the_task_at_full_cache(smollm):
    task = build_task("fewshot", {"answer_tokens": 12})
    sample = task.samples(smollm.tokenizer, 300, 2, 0)[1]  # the first sample's answer drops its first word
    record = evaluate(smollm, task, build_policy("full"), sample, RunSettings(), 300, 0)
    assert record["scores"] == {"score": 1.0} and record["segments_split"] == 0.0, record["prediction"]
