from __future__ import annotations

import pytest

from kvbench.engine.models import byte_tokenizer
from kvbench.errors import KvbenchError
from kvbench.tasks import TASKS, build_task, encode_prompt
from kvbench.tasks.base import Sample


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.mark.parametrize("haystack", ["text", "noise"])
@pytest.mark.parametrize("length", [600, 2000])
def test_prompt_fits_the_context_length_and_hides_the_needle_at_depth(tokenizer, haystack, length):
    task = build_task("niah", {"depths": [0.0, 0.5, 1.0], "haystack": haystack})
    samples = task.samples(tokenizer, length, count=2, seed=0)
    assert len(samples) == 6 and len({s.id for s in samples}) == 6
    for sample in samples:
        context, question = encode_prompt(tokenizer, sample)
        assert abs(len(context) + len(question) - length) <= 2
        where = sample.context.index(sample.meta["needle"]) / len(sample.context)
        assert abs(where - sample.meta["depth"]) < 0.25  # nearest sentence boundary
        assert sample.answers[0] in sample.meta["needle"] and sample.answers[0] not in question


def test_samples_are_seeded(tokenizer):
    task = build_task("niah")
    first, again = task.samples(tokenizer, 500, 2, seed=1), task.samples(tokenizer, 500, 2, seed=1)
    other = task.samples(tokenizer, 500, 2, seed=2)
    assert [s.answers for s in first] == [s.answers for s in again] != [s.answers for s in other]


def test_context_and_question_split_is_the_whole_prompt():
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
    sample = Sample("s", "some context.", "the question?", ["x"], answer_prefix=" Answer:")
    context, question = encode_prompt(tok, sample)
    assert tok.decode(context + question) == "<u>some context.\n\nthe question?</u><a> Answer:"


def test_scores():
    task = TASKS.get("niah")()
    sample = Sample("s", "", "", ["4242424"])
    assert task.score("4242424.", sample) == {"score": 1.0, "recall": 1.0}
    assert task.score("It is 424242.", sample)["score"] == 0.0
    words = Sample("s", "", "", ["blue whale"])
    assert task.score("a whale", words) == {"score": 0.0, "recall": 0.5}


def test_bad_task_input_is_named(tokenizer, tmp_path):
    with pytest.raises(KvbenchError, match="depths"):
        build_task("niah", {"depths": [1.5]})
    with pytest.raises(KvbenchError, match="corpus not found"):
        build_task("niah", {"corpus": str(tmp_path / "missing.txt")}).samples(tokenizer, 500, 1, 0)
    with pytest.raises(KvbenchError, match="too short"):
        build_task("niah").samples(tokenizer, 100, 1, 0)
    with pytest.raises(KvbenchError, match="unknown task 'nia'"):
        build_task("nia")


def test_user_corpus_file_and_folder(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("Alpha beta gamma. " * 200)
    task = build_task("niah", {"corpus": str(tmp_path), "depths": [0.5]})
    sample = task.samples(tokenizer, 800, 1, 0)[0]
    assert "Alpha beta gamma." in sample.context
