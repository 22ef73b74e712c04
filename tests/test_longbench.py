"""LongBench: local JSONL rows, official prompts and truncation, scoring rules, and real rows end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.engine.models import byte_tokenizer
from kvbench.engine.settings import RunSettings
from kvbench.errors import KvbenchError
from kvbench.policies import build_policy
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task, encode_prompt
from kvbench.tasks.longbench import DATASETS, ENGLISH, LONGBENCH_E

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "longbench-mini"


def write_rows(folder: Path, name: str, rows: list[dict]) -> None:
    folder.mkdir(exist_ok=True)
    base = {"length": 100, "language": "en", "all_classes": None}
    lines = [json.dumps({**base, "dataset": name, "_id": f"{name}-{i}", **row}) for i, row in enumerate(rows)]
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "lb"
    write_rows(folder, "hotpotqa", [{"input": "Who wrote it?", "context": "Passage 1:\nAnne wrote it. " * 20,
                                     "answers": ["Anne"]}])
    write_rows(folder, "trec", [{"input": "Question: Who is Zeus ?\nType:", "context": "Question: Q1 ?\nType: City",
                                 "answers": ["Individual"], "all_classes": ["City", "Individual"]}])
    return folder


def test_the_official_prompt_and_template_rules(data):
    tokenizer = byte_tokenizer()
    task = build_task("longbench", {"datasets": ["hotpotqa", "trec"], "data_dir": str(data)})
    hotpot, trec = task.samples(tokenizer, 4000, count=5, seed=0)
    assert hotpot.context + hotpot.question == DATASETS["hotpotqa"][0].replace(
        "{context}", "Passage 1:\nAnne wrote it. " * 20).replace("{input}", "Who wrote it?")
    assert hotpot.question.endswith("Question: Who wrote it?\nAnswer:") and hotpot.chat and hotpot.stop == ()
    assert hotpot.max_new_tokens == 32 and hotpot.answers == ["Anne"] and hotpot.meta["dataset"] == "hotpotqa"
    assert not trec.chat and trec.stop == ("\n",) and trec.max_new_tokens == 64
    assert task.sample_count(5) == 2
    # first line only for trec; the official classification metric
    assert task.score("Individual\nCity", trec) == {"score": 1.0, "trec": 1.0}
    assert task.score("City or Individual", trec)["score"] == 0.5
    assert task.score("Anne, of course", hotpot)["score"] == 0.5  # [anne of course] vs [anne]: P 1/3, R 1


def test_middle_truncation_keeps_the_instructions_and_the_question(data):
    tokenizer = byte_tokenizer()
    write_rows(data, "narrativeqa", [{"input": "Why?", "context": "start " + "middle " * 2000 + "end",
                                      "answers": ["because"]}])
    sample = build_task("longbench", {"datasets": ["narrativeqa"], "data_dir": str(data)}).samples(
        tokenizer, 1000, 1, 0)[0]
    context, question = encode_prompt(tokenizer, sample)
    assert abs(len(context) + len(question) - 1000) <= 2 and sample.meta["truncated"]
    assert sample.context.startswith("You are given a story") and "Story: start middle" in sample.context
    assert sample.question.endswith("Question: Why?\n\nAnswer:")


def test_chat_template_is_applied_except_where_longbench_skips_it(data):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
    hotpot, trec = build_task("longbench", {"datasets": ["hotpotqa", "trec"], "data_dir": str(data)}).samples(
        tokenizer, 4000, 1, 0)
    assert tokenizer.decode(sum(encode_prompt(tokenizer, hotpot), [])).startswith("<u>Answer the question")
    assert tokenizer.decode(sum(encode_prompt(tokenizer, trec), [])).startswith("Please determine the type")


def test_longbench_e_buckets_and_groups(tmp_path):
    write_rows(tmp_path, "trec_e", [{"input": "q", "context": "c", "answers": ["City"], "length": n,
                                     "all_classes": ["City"]} for n in (1200, 5000, 9000)])
    task = build_task("longbench", {"datasets": ["trec"], "data_dir": str(tmp_path), "e": True})
    samples = task.samples(byte_tokenizer(), 600, 3, 0)
    assert [s.meta["bucket"] for s in samples] == ["0-4k", "4-8k", "8k+"]
    assert task.score("City", samples[1]) == {"score": 1.0, "trec": 1.0, "length_4-8k": 1.0}
    assert len(DATASETS) == 21 and len(LONGBENCH_E) == 13 and len(ENGLISH) == 16
    with pytest.raises(KvbenchError, match="'narrativeqa' is not in LongBench-E"):
        build_task("longbench", {"datasets": ["narrativeqa"], "e": True})


def test_bad_longbench_input_is_named(data, tmp_path):
    with pytest.raises(KvbenchError, match="unknown dataset 'hotpot'"):
        build_task("longbench", {"datasets": ["hotpot"]})
    with pytest.raises(KvbenchError, match="no data file .*musique.jsonl"):
        build_task("longbench", {"datasets": ["musique"], "data_dir": str(data)}).samples(byte_tokenizer(), 900, 1, 0)
    (data / "qasper.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{"input": broken\n')
    with pytest.raises(KvbenchError, match=r"qasper.jsonl:2: not valid JSON"):
        build_task("longbench", {"datasets": ["qasper"], "data_dir": str(data)}).samples(byte_tokenizer(), 900, 1, 0)
    (data / "musique.jsonl").write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(KvbenchError, match=r"musique.jsonl:1: a LongBench row needs the field 'answers'"):
        build_task("longbench", {"datasets": ["musique"], "data_dir": str(data)}).samples(byte_tokenizer(), 900, 1, 0)


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/longbench-mini is not here")
def test_real_rows_end_to_end(tiny_llama):
    task = build_task("longbench", {"datasets": ["en"], "data_dir": str(SHARED)})
    samples = task.samples(tiny_llama.tokenizer, 1500, count=1, seed=0)
    assert {s.meta["dataset"] for s in samples} == {d for d in ENGLISH if (SHARED / f"{d}.jsonl").is_file()}
    for sample in samples[:4]:
        record = evaluate(tiny_llama, task, build_policy("snapkv"), sample, RunSettings(budget=0.25, max_new_tokens=4),
                          1500, seed=0)
        assert record["prompt_tokens"] <= 1502 and 0.0 <= record["scores"]["score"] <= 1.0
        assert record["references"] == sample.answers and record["cache_ratio"] < 0.5


def test_rows_from_the_hub_through_datasets(monkeypatch):
    import sys
    import types

    from kvbench.tasks import longbench

    calls = []
    row = {"input": "Who?", "context": "Anne did.", "answers": ["Anne"], "length": 9000, "_id": "x"}
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda hub, name, split: calls.append((hub, name, split)) or [row]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    longbench._hub_rows.cache_clear()
    task = build_task("longbench", {"datasets": ["hotpotqa"], "e": True})
    sample = task.samples(byte_tokenizer(), 900, 1, 0)[0]
    assert calls == [("Xnhyacinth/LongBench", "hotpotqa_e", "test")] and sample.meta["bucket"] == "8k+"
    longbench._hub_rows.cache_clear()
