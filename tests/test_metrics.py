"""LongBench's and RULER's metrics against values worked out by hand from their definitions."""

from __future__ import annotations

import pytest

from kvbench.tasks.metrics import (
    classification_score,
    code_sim_score,
    count_score,
    normalize_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)
from kvbench.tasks.ruler import string_match_all, string_match_part


def test_squad_normalisation_and_f1():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    # [eiffel tower paris] vs [eiffel tower in paris]: 3 shared, P = 1, R = 3/4, F1 = 6/7
    assert qa_f1_score("The Eiffel Tower, Paris!", "Eiffel tower in Paris") == pytest.approx(6 / 7)
    assert qa_f1_score("London", "Paris") == 0.0
    assert qa_f1_score("a an the", "Paris") == 0.0  # nothing left after normalisation


def test_chinese_f1_segments_with_jieba():
    # jieba: [我们 今天 去 北京大学] vs [今天 去 北京]: 2 shared, P = 2/4, R = 2/3, F1 = 4/7
    assert qa_f1_zh_score("我们今天去北京大学", "今天去北京") == pytest.approx(4 / 7)


def test_rouge_l():
    # LCS of "police arrested two men downtown" / "two men were arrested downtown" is "two men downtown":
    # P = R = 3/5, F = 0.6
    assert rouge_score("police arrested two men downtown", "two men were arrested downtown") == pytest.approx(0.6, 1e-6)
    assert rouge_score("", "anything") == 0.0  # LongBench scores the package's error as 0
    assert rouge_zh_score("我们今天去北京", "我们今天去北京") == pytest.approx(1.0, 1e-6)


def test_classification_follows_longbench():
    classes = ["Food", "Date", "City", "location", "Other location"]
    assert classification_score("City", "City", all_classes=classes) == 1.0
    assert classification_score("Food or City", "City", all_classes=classes) == 0.5
    assert classification_score("Date", "City", all_classes=classes) == 0.0
    # "location" is part of the reference's name: dropped, so the answer is not split with it
    assert classification_score("Other location", "Other location", all_classes=classes) == 1.0


def test_retrieval_count_and_code_similarity():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 12 or paragraph 3", "Paragraph 12") == 0.5
    assert retrieval_score("no idea", "Paragraph 12") == 0.0
    assert retrieval_zh_score("段落7", "段落7") == 1.0
    assert count_score("There are 46 unique paragraphs out of 50", "46") == 0.5
    # the first line that is not a fence or a comment; Levenshtein (indel) ratio: 1 - 2/20
    assert code_sim_score("```python\n# comment\nx = foo(1)\n", "x = foo(2)") == pytest.approx(0.9)


def test_ruler_string_match():
    assert string_match_all("the numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABC", ["abc"]) == 1.0
    assert string_match_part("the numbers are 123 and 456", ["123", "789"]) == 1.0
    assert string_match_part("nothing", ["123"]) == 0.0
