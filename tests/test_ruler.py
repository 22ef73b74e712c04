"""RULER generators: exact lengths, answers where they belong, seeded."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvbench.engine.models import byte_tokenizer
from kvbench.errors import KvbenchError
from kvbench.tasks import build_task, encode_prompt
from kvbench.tasks.ruler import SUBTASKS
from tests.conftest import needs_embedded


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def prompt_length(tokenizer, sample) -> int:
    context, question = encode_prompt(tokenizer, sample)
    return len(context) + len(question)


@pytest.mark.parametrize("length", [2048, 4096])
def test_every_subtask_fits_the_length_within_one_percent(tokenizer, length):
    samples = build_task("ruler").samples(tokenizer, length, count=1, seed=0)
    assert [s.meta["subtask"] for s in samples] == list(SUBTASKS)
    for sample in samples:
        assert abs(prompt_length(tokenizer, sample) - length) <= 0.01 * length, sample.id


@needs_embedded
def test_lengths_with_a_real_tokenizer(smollm):
    for length in (512, 1500):
        for sample in build_task("ruler").samples(smollm.tokenizer, length, count=1, seed=3):
            # a cwe list grows by whole entries ("12. word", ~4-8 tokens): within one entry at 512
            slack = 8 if sample.meta["subtask"] == "cwe" and length < 1000 else 0.01 * length
            assert abs(prompt_length(smollm.tokenizer, sample) - length) <= slack, sample.id


def test_needles_hold_the_answers_at_their_depths(tokenizer):
    task = build_task("ruler", {"subtasks": ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]})
    for sample in task.samples(tokenizer, 8000, count=1, seed=0):
        needles = re.findall(r"One of the special magic numbers for ([\w-]+) is: (\d+)\.", sample.context)
        kind = sample.meta["subtask"]
        assert len(needles) == (1 if kind == "niah_single" else 4)
        asked = [key for key, _ in needles if key in sample.question]
        assert sorted(sample.answers) == sorted(value for key, value in needles if key in asked)
        assert len(sample.answers) == {"niah_single": 1, "niah_multikey": 1}.get(kind, 4)
        assert not any(answer in sample.question for answer in sample.answers)
        for (_, value), depth in zip(needles, sample.meta["depths"], strict=True):
            where = sample.context.index(value) / len(sample.context)
            assert abs(where - depth) < 0.1


def test_variable_tracking_chain_is_in_order(tokenizer):
    sample = build_task("ruler", {"subtasks": ["vt"], "vt_hops": 3}).samples(tokenizer, 2000, 1, seed=0)[0]
    first, *rest = sample.answers
    assert len(sample.answers) == 4
    value = re.search(rf"VAR {first} = (\d+)\.", sample.context).group(1)
    assert value in sample.question
    places = [sample.context.index(f"VAR {first} = {value}.")]
    for previous, name in zip(sample.answers, rest, strict=False):
        places.append(sample.context.index(f"VAR {name} = VAR {previous}."))
    assert places == sorted(places)


def test_word_extraction_answers_are_the_most_frequent(tokenizer):
    cwe, fwe = build_task("ruler", {"subtasks": ["cwe", "fwe"]}).samples(tokenizer, 4000, 1, seed=0)
    listed = Counter(re.findall(r"\d+\. (\w+)", cwe.context))
    top = [word for word, _ in listed.most_common(10)]
    assert sorted(top) == sorted(cwe.answers) and listed.most_common(11)[-1][1] <= 3 < listed[cwe.answers[0]]
    coded = Counter(fwe.context.split())
    ranked = [word for word, _ in coded.most_common() if word != "...."]
    assert ranked[:3] == fwe.answers and coded.most_common(1)[0][0] == "...."


def test_seeded_and_scored(tokenizer):
    task = build_task("ruler", {"subtasks": ["niah_single", "vt"]})
    first, again = task.samples(tokenizer, 1500, 2, seed=1), task.samples(tokenizer, 1500, 2, seed=1)
    other = task.samples(tokenizer, 1500, 2, seed=2)
    assert [s.context for s in first] == [s.context for s in again]
    assert [s.answers for s in first] != [s.answers for s in other]
    assert task.sample_count(2) == len(first) == 4
    vt = first[2]
    assert task.score(" ".join(vt.answers[:2]), vt) == {"score": 2 / 5, "vt": 2 / 5}  # 4 hops: 5 variables


def test_bad_ruler_input(tokenizer):
    with pytest.raises(KvbenchError, match="unknown subtask 'qa'"):
        build_task("ruler", {"subtasks": ["qa"]})
    with pytest.raises(KvbenchError, match="too short"):
        build_task("ruler", {"subtasks": ["niah_multikey"]}).samples(tokenizer, 200, 1, 0)
