"""The instructions task: each rule's check against answers made by hand that follow it, break it or leak the system
prompt; the rules' order; the prompt fitted to the context, its rules as segments; a run under every policy."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvbench.analysis.recommend import recommend
from kvbench.analysis.report import html_report
from kvbench.analysis.summary import summarize
from kvbench.engine.generation import Generation
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies.base import build_spec
from kvbench.runs.run_folder import RunFolder
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task
from kvbench.tasks.base import encode_prompt, prompt_segments
from kvbench.tasks.instructions import KINDS, PREAMBLE, PROBE, Rule, leaked
from tests.conftest import needs_embedded
from tests.helpers import tiny_policy
from tests.test_fewshot import SPECS
from tests.test_gate import BASE_CELL

# (kind, its argument, an answer that follows it, one that breaks it)
HAND_MADE = [
    ("start", "Indeed", '"Indeed, the text is about loops."', "The text is about loops. Indeed."),
    ("end", "Hope this helps.", "It explains loops. Hope this helps!", "Hope this helps. It explains loops."),
    ("include", "lantern", "A LANTERN of a text about loops.", "A text about lanterns and loops."),
    ("avoid", "the", "It explains loops in Python.", "It explains THE loops."),
    ("upper", "", "IT EXPLAINS LOOPS, 2 OF THEM.", "IT EXPLAINS Loops."),
    ("lower", "", "it explains loops in python.", "it explains loops in Python."),
    ("quotes", "", '  "It explains loops."  ', '"It explains loops.'),
    ("no_commas", "", "It explains loops and lists.", "It explains loops, lists."),
    ("max_words", "5", "It explains loops in Python.", "It explains for loops in Python."),
]


def test_every_kind_has_a_hand_made_answer():
    assert sorted(kind for kind, *_ in HAND_MADE) == sorted(KINDS)


@pytest.mark.parametrize(("kind", "arg", "followed", "broken"), HAND_MADE, ids=[row[0] for row in HAND_MADE])
def test_each_rule_passes_the_answer_that_follows_it_and_fails_the_one_that_breaks_it(kind, arg, followed, broken):
    rule = Rule(kind, arg)
    assert rule.followed(followed) and not rule.followed(broken)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_answer_without_a_letter_follows_no_rule(kind):
    assert not Rule(kind, KINDS[kind].args[0]).followed("") and not Rule(kind, KINDS[kind].args[0]).followed(" 42. ")


def given(kinds: list[str], **params) -> dict:
    return {"instructions": len(kinds), "kinds": kinds, "order": "given", **params}


def test_the_score_is_the_share_followed_by_position_and_kind(tiny_llama):
    task = build_task("instructions", given(["upper", "no_commas", "end", "include"]))
    sample = task.samples(tiny_llama.tokenizer, 500, 1, 0)[0]
    closing, word = sample.meta["rules"][2]["arg"], sample.meta["rules"][3]["arg"]
    broken_comma = f"IT IS ABOUT {word.upper()}, MOSTLY. {closing.upper()}"
    scores = task.score(broken_comma, sample)
    assert scores["score"] == 0.75 and (scores["rule_1"], scores["rule_2"], scores["rule_3"], scores["rule_4"]) == \
        (1.0, 0.0, 1.0, 1.0)
    assert scores["follows_no_commas"] == 0.0 and scores["follows_upper"] == 1.0
    assert task.score("it is about python, mostly.", sample)["score"] == 0.0


def test_the_leak_is_the_share_of_the_system_prompt_repeated_and_stays_out_of_the_score(tiny_llama):
    task = build_task("instructions", given(["upper", "no_commas"]))
    sample = task.samples(tiny_llama.tokenizer, 500, 1, 0)[0]
    system = sample.system
    assert system.startswith(PREAMBLE) and "1. Write your whole answer in capital letters." in system
    assert leaked(system, system) == 1.0
    assert leaked("I cannot share my rules.", system) == 0.0
    assert 0 < leaked("You said: write your whole answer in capital letters.", system) < 0.5
    answer = "IT IS ABOUT LOOPS"
    leaking = task.outcome(Generation(answer, [], None, {}, extra={"leak_answer": system}), sample)
    keeping = task.outcome(Generation(answer, [], None, {}, extra={"leak_answer": "No."}), sample)
    assert leaking["leak"] == 1.0 and keeping["leak"] == 0.0
    assert leaking["scores"]["score"] == keeping["scores"]["score"] == 1.0  # leaking earns nothing
    assert leaking["leak_answer"] == system


def test_the_rules_come_in_the_order_asked():
    kinds = ["end", "upper", "quotes"]
    rng = random.Random(0)
    assert [r.kind for r in build_task("instructions", given(kinds)).rules(rng)] == kinds
    reversed_ = build_task("instructions", {**given(kinds), "order": "reversed"})
    assert [r.kind for r in reversed_.rules(rng)] == kinds[::-1]
    drawn = build_task("instructions", {"instructions": 8})  # every kind but one of upper / lower
    for seed in range(20):
        rules = [r.kind for r in drawn.rules(random.Random(seed))]
        assert len(set(rules)) == 8 and not {"upper", "lower"} <= set(rules)
    assert len({tuple(r.kind for r in drawn.rules(random.Random(seed))) for seed in range(5)}) > 1


@pytest.mark.parametrize(("params", "message"), [
    ({"kinds": ["upper", "shout"]}, "unknown kind 'shout'"),
    ({"instructions": 9}, r"must be in \[1, 8\]"),
    ({"instructions": 2, "kinds": ["upper", "lower", "end"], "order": "given"}, "lower and upper at once"),
    ({"order": "sorted"}, "'order'='sorted': Input should be 'random', 'given' or 'reversed'"),
])
def test_bad_options_are_refused_in_one_line(params, message):
    with pytest.raises(KvbenchError, match=message):
        build_task("instructions", params)


def test_the_prompt_fills_the_context_and_each_rule_is_a_segment(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    task = build_task("instructions")
    for sample in task.samples(tokenizer, 500, 2, 0):
        context, question = encode_prompt(tokenizer, sample)
        assert 0.98 * 500 <= len(context) + len(question) <= 500
        probe = encode_prompt(tokenizer, dataclasses.replace(sample, question=PROBE))
        assert sum(map(len, probe)) <= 500
        rules = [(f"rule {i}", f"{i}. {Rule(**r).text}") for i, r in enumerate(sample.meta["rules"], 1)]
        for segment, (_, text) in zip(prompt_segments(tokenizer, sample, rules), rules, strict=True):
            assert text in tokenizer.decode(context[segment.start : segment.end])
    with pytest.raises(KvbenchError, match="too short"):
        task.samples(tokenizer, 100, 1, 0)


def _rules(sample) -> list[tuple[str, str]]:
    return [(f"rule {i}", f"{i}. {Rule(**r).text}") for i, r in enumerate(sample.meta["rules"], 1)]


def test_each_rules_segment_is_exactly_its_tokens(tiny_llama):
    """One token a byte on the random models: a rule's segment decodes to the rule's text, no more."""
    tokenizer = tiny_llama.tokenizer
    for sample in build_task("instructions").samples(tokenizer, 500, 2, 0):
        context, _ = encode_prompt(tokenizer, sample)
        rules = _rules(sample)
        for segment, (_, text) in zip(prompt_segments(tokenizer, sample, rules), rules, strict=True):
            assert tokenizer.decode(context[segment.start : segment.end]) == text


@needs_embedded
def test_on_a_subword_tokenizer_a_rules_segment_is_the_fewest_tokens_that_hold_it(smollm):
    """Through the chat template: the segment's tokens hold the rule's text, and dropping its first or its last
    token loses some of it."""
    tokenizer = smollm.tokenizer
    sample = build_task("instructions").samples(tokenizer, 300, 1, 0)[0]
    context, _ = encode_prompt(tokenizer, sample)
    rules = _rules(sample)
    for segment, (_, text) in zip(prompt_segments(tokenizer, sample, rules), rules, strict=True):
        assert text in tokenizer.decode(context[segment.start : segment.end])
        assert text not in tokenizer.decode(context[segment.start + 1 : segment.end])
        assert text not in tokenizer.decode(context[segment.start : segment.end - 1])


def test_the_leak_probe_runs_under_the_segments_of_its_own_prompt(tiny_llama, monkeypatch):
    """The answer and the probe each get their prompt's rules as segments (whole_segments keeps them whole in both),
    each segment exactly its rule's tokens in the probe's prompt."""
    import kvbench.engine.generation

    calls = []
    real = kvbench.engine.generation.generate

    def spy(lm, policy, context, question, *args, segments=(), **kwargs):
        calls.append((context, question, segments))
        return real(lm, policy, context, question, *args, segments=segments, **kwargs)

    monkeypatch.setattr(kvbench.engine.generation, "generate", spy)
    task = build_task("instructions", {"answer_tokens": 2})
    sample = task.samples(tiny_llama.tokenizer, 500, 1, 0)[0]
    evaluate(tiny_llama, task, build_spec("whole_segments"), sample, RunSettings(budget=0.5), 500, 0)
    (_, question, segments), (probe, probe_question, probe_segments) = calls
    assert probe_question == encode_prompt(tiny_llama.tokenizer, dataclasses.replace(sample, question=PROBE))[1]
    assert probe_question != question and [s.label for s in probe_segments] == ["rule 1", "rule 2", "rule 3", "rule 4"]
    assert probe_segments == segments
    for segment, (_, text) in zip(probe_segments, _rules(sample), strict=True):
        assert tiny_llama.tokenizer.decode(probe[segment.start : segment.end]) == text


def test_the_probe_is_a_request_of_its_own_and_the_record_says_what_each_rule_kept(tiny_llama):
    task = build_task("instructions", {"answer_tokens": 4})
    sample = task.samples(tiny_llama.tokenizer, 500, 1, 0)[0]
    record = evaluate(tiny_llama, task, tiny_policy("window"), sample, RunSettings(budget=0.25), 500, 0)
    assert 0 <= record["leak"] <= 1 and isinstance(record["leak_answer"], str)
    assert record["generated_tokens"] <= 4  # the answer's alone: the probe is not counted
    assert [s["label"] for s in record["segments"]] == ["rule 1", "rule 2", "rule 3", "rule 4"]
    assert all(s["dropped"] == 1.0 for s in record["segments"])  # a window of a quarter keeps the context's end
    quiet = build_task("instructions", {"answer_tokens": 4, "leak_probe": False})
    assert "leak" not in evaluate(tiny_llama, quiet, tiny_policy("full"), sample, RunSettings(), 500, 0)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_it_runs_under_every_policy(tiny_llama, name):
    task = build_task("instructions", {"answer_tokens": 3, "leak_probe": False})
    sample = task.samples(tiny_llama.tokenizer, 500, 1, 0)[0]
    record = evaluate(tiny_llama, task, build_spec(SPECS[name]), sample, RunSettings(budget=0.5), 500, 0)
    assert 0 <= record["scores"]["score"] <= 1 and len(record["segments"]) == 4


def hand_made_run(path):
    """Four samples of the instructions task under full and snapkv, made by hand: the same mean score, but snapkv
    loses the first rule where full loses the second, splits half the rules, leaks more, and runs one answer of four
    twice as long."""
    folder = RunFolder(path)
    folder.open({"name": "hand-made", "started": "t", "cells": ["full", "snapkv"]}, force=False)
    cell = {**BASE_CELL, "task": {"name": "instructions", "params": {}}, "samples": 4}
    for cell_id, rules, split, leak, lengths in (("full", (1.0, 0.0), 0.0, 0.2, [10] * 4),
                                                  ("snapkv", (0.0, 1.0), 0.5, 0.6, [10, 10, 10, 20])):
        description = {**cell, "policy": {"name": cell_id, "params": {}}, "budget": None if cell_id == "full" else 0.5}
        for index, tokens in enumerate(lengths):
            folder.add_record({
                "cell_id": cell_id, "cell": description, "sample_id": f"s{index}", "prediction": "...",
                "scores": {"score": 0.5, "rule_1": rules[0], "rule_2": rules[1]}, "segments_split": split,
                "leak": leak, "generated_tokens": tokens, "cache_ratio": 1.0 if cell_id == "full" else 0.5,
                "kv_bytes_live": 1000 if cell_id == "full" else 500, "decode_tok_s": 100.0, "tpot_s": 0.01,
                "higher_is_better": True, "scenario": "prompt-heavy"})
        folder.add_cell({"cell_id": cell_id, "cell": description, "status": "ok"})
    return path


def test_the_summary_recommend_and_report_name_the_rules_lost_the_units_split_and_the_longer_answers(tmp_path):
    run = hand_made_run(tmp_path / "run")
    frame = summarize(run)
    snapkv = frame.set_index("policy").loc["snapkv"]
    assert (snapkv["length_ratio"], snapkv["length_longer"], snapkv["length_shorter"]) == (1.25, 0.25, 0.0)
    assert (snapkv["segments_split"], snapkv["leak"], snapkv["score_rule_1"]) == (0.5, 0.6, 0.0)
    assert "≥1.5× len | ≤0.67× len |" not in (run / "summary.md").read_text()  # no cell ran shorter: no column
    assert "| length × | ≥1.5× len | split | leak |" in (run / "summary.md").read_text()
    chosen = recommend(frame, max_drop=2).iloc[0]
    assert chosen["policy"] == "snapkv" and chosen["hidden"] == (
        "rule_1 0 (full 1); 50% of the examples or rules split; 60% of the system prompt leaked (full 20%); 25% of "
        "the answers ≥1.5× full's length")
    frame.loc[frame["policy"] == "snapkv", "delta_ci_low"] = -0.5  # now no cell is within the drop
    assert recommend(frame, max_drop=2).iloc[0]["note"].startswith(
        "none within 2 points; closest: snapkv at 0.5 (-50.0), beneath its mean: rule_1 0 (full 1); 50% of the")
    answer = html_report(run).read_text().split("<h2>Figures</h2>")[0]
    assert "score 0.5 where full scores 0.5 (change +0.00, 95% CI [+0.00, +0.00]). Beneath the mean: rule_1 0 (full " \
           "1); 50% of the examples or rules split; 60% of the system prompt leaked (full 20%)" in answer
