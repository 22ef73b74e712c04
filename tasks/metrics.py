"""LongBench's official metrics (THUDM/LongBench `metrics.py`), same normalisation, same quirks.

ROUGE-L is the `rouge` package's (LongBench's own dependency), code similarity rapidfuzz's `fuzz.ratio`
(the Levenshtein ratio fuzzywuzzy computes), Chinese segmentation jieba's. Each metric scores one
prediction against one reference in [0, 1]; a sample's score is the best over its references.
"""

from __future__ import annotations

import importlib
import logging
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvbench.errors import KvbenchError

_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise KvbenchError(f"LongBench metrics need '{module}': pip install -e '.[longbench]' in the kvbench "
                           "checkout") from None


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def normalize_zh_answer(text: str) -> str:
    punctuation = set(string.punctuation + _ZH_PUNCTUATION)
    return "".join("".join(ch for ch in text.lower() if ch not in punctuation).split())


def _f1(prediction: list[str], reference: list[str]) -> float:
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str, **_: Any) -> float:
    return _f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh_score(prediction: str, reference: str, **_: Any) -> float:
    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh_answer(w) for w in _cut_zh(text)) if t]

    return _f1(tokens(prediction), tokens(reference))


def rouge_score(prediction: str, reference: str, **_: Any) -> float:
    """ROUGE-L F of the `rouge` package; 0 where it raises (an empty prediction), as LongBench does."""
    rouge = _require("rouge")
    try:
        return rouge.Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:  # noqa: BLE001 - LongBench scores any failure (empty or punctuation-only text) as 0
        return 0.0


def rouge_zh_score(prediction: str, reference: str, **_: Any) -> float:
    return rouge_score(" ".join(_cut_zh(prediction)), " ".join(_cut_zh(reference)))


def classification_score(prediction: str, reference: str, all_classes: list[str] | None = None, **_: Any) -> float:
    """1 / (classes named in the prediction) if the reference is among them. Classes that are part of the
    reference's name are dropped first, while iterating the same list, as LongBench does (so the one after
    a dropped class escapes the check): the official numbers depend on it."""
    matches = [name for name in all_classes or [] if name in prediction]
    for name in matches:
        if name in reference and name != reference:
            matches.remove(name)
    return 1.0 / len(matches) if reference in matches else 0.0


def _numbers_equal_to(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, reference: str, **_: Any) -> float:
    return _numbers_equal_to(prediction, re.findall(r"Paragraph (\d+)", reference)[0])


def retrieval_zh_score(prediction: str, reference: str, **_: Any) -> float:
    return _numbers_equal_to(prediction, re.findall(r"段落(\d+)", reference)[0])


def count_score(prediction: str, reference: str, **_: Any) -> float:
    return _numbers_equal_to(prediction, str(reference))


def code_sim_score(prediction: str, reference: str, **_: Any) -> float:
    """Levenshtein ratio of the first line that is not a comment or a code fence."""
    fuzz = _require("rapidfuzz.fuzz")
    lines = prediction.lstrip("\n").split("\n")
    first = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz.ratio(first, reference) / 100


def _cut_zh(text: str) -> list[str]:
    jieba = _require("jieba")
    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score, "qa_f1_zh": qa_f1_zh_score, "rouge": rouge_score, "rouge_zh": rouge_zh_score,
    "classification": classification_score, "retrieval": retrieval_score, "retrieval_zh": retrieval_zh_score,
    "count": count_score, "code_sim": code_sim_score,
}
