"""LongBench v1 (Bai et al., 2023): 21 real long-context datasets, and LongBench-E's length buckets.

Everything follows LongBench's `pred.py` / `eval.py`: the per-dataset prompt templates and generation
lengths, middle truncation of the prompt to the context length, no chat template for the few-shot and
code datasets (trec, triviaqa, samsum, lsht, lcc, repobench-p), only the first line of the answer for
trec, triviaqa, samsum and lsht, and the official metrics (see metrics.py), best over the references.
Rows come from a folder of LongBench JSONL files (`data_dir`) or from the hub through `datasets`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, encode_prompt, register
from kvbench.tasks.metrics import METRICS

_QA = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
       "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
       "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
_CODE = "Please complete the code given below. \n{context}"
# dataset -> (prompt template, max new tokens, metric)
DATASETS: dict[str, tuple[str, int, str]] = {
    "narrativeqa": ("You are given a story, which can be either a novel or a movie script, and a question. Answer "
                    "the question as concisely as you can, using a single phrase if possible. Do not provide any "
                    "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely "
                    "as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                    "{input}\n\nAnswer:", 128, "qa_f1"),
    "qasper": ("You are given a scientific article and a question. Answer the question as concisely as you can, "
               "using a single phrase or sentence if possible. If the question cannot be answered based on the "
               "information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
               "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n "
               "Answer the question based on the above article as concisely as you can, using a single phrase or "
               "sentence if possible. If the question cannot be answered based on the information in the article, "
               "write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
               "\"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:", 128, "qa_f1"),
    "multifieldqa_en": ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
                        "question based on the above text, only give me the answer and do not output any other "
                        "words.\n\nQuestion: {input}\nAnswer:", 64, "qa_f1"),
    "multifieldqa_zh": ("阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"  # noqa: E501
                        "不要输出任何其他字词。\n\n问题：{input}\n回答：", 64, "qa_f1_zh"),
    "hotpotqa": (_QA, 32, "qa_f1"),
    "2wikimqa": (_QA, 32, "qa_f1"),
    "musique": (_QA, 32, "qa_f1"),
    "dureader": ("请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
                 128, "rouge_zh"),
    "gov_report": ("You are given a report by a government agency. Write a one-page summary of the report.\n\n"
                   "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:", 512, "rouge"),
    "qmsum": ("You are given a meeting transcript and a query containing a question or instruction. Answer the "
              "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
              "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:", 512, "rouge"),
    "multi_news": ("You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
                   "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:", 512, "rouge"),
    "vcsum": ("下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：", 512, "rouge_zh"),  # noqa: E501
    "trec": ("Please determine the type of the question below. Here are some examples of questions.\n\n"
             "{context}\n{input}", 64, "classification"),
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output any "
                 "other words. The following are some examples.\n\n{context}\n\n{input}", 32, "qa_f1"),
    "samsum": ("Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}"
               "\n\n{input}", 128, "rouge"),
    "lsht": ("请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}", 64, "classification"),
    "passage_count": ("There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
                      "Please carefully read these paragraphs and determine how many unique paragraphs there are "
                      "after removing duplicates. In other words, how many non-repeating paragraphs are there in "
                      "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
                      "duplicates. The output format should only contain the number, such as 1, 2, 3, and so on."
                      "\n\nThe final answer is: ", 32, "count"),
    "passage_retrieval_en": ("Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
                             "which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract."
                             "\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. "
                             "The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer "
                             "is: ", 32, "retrieval"),
    "passage_retrieval_zh": ("以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要"  # noqa: E501
                             "\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
                             32, "retrieval_zh"),
    "lcc": (_CODE + "Next line of code:\n", 64, "code_sim"),
    "repobench-p": (_CODE + "{input}Next line of code:\n", 64, "code_sim"),
}
NO_CHAT_TEMPLATE = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}
LONGBENCH_E = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
               "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
ENGLISH = tuple(d for d in DATASETS if not d.endswith("_zh") and d not in ("dureader", "vcsum", "lsht"))
# names that stand for several datasets
GROUPS = {"all": tuple(DATASETS), "en": ENGLISH, "zh": tuple(d for d in DATASETS if d not in ENGLISH),
          "e": LONGBENCH_E}
FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
HUB = "Xnhyacinth/LongBench"  # a parquet mirror; THUDM/LongBench's loading script no longer runs on datasets 4


# the rows of LongBench's smallest dataset (multifieldqa_en, 150; LongBench-E's too), v1 and -E alike
FEWEST_ROWS = 150


@register
@dataclass
class LongBench(Task):
    """LongBench v1 datasets (or LongBench-E with `e: true`) with the official prompts, truncation and
    metrics; the first `samples` rows of each dataset; score = the official metric as a fraction."""

    name = "longbench"
    datasets: list[str] = field(default_factory=lambda: ["en"])  # names, or the groups all / en / zh / e
    data_dir: str | None = None  # a folder of <dataset>.jsonl (LongBench's data.zip); none: the hub
    e: bool = False  # LongBench-E: <dataset>_e rows, also scored per length bucket (0-4k, 4-8k, 8k+)
    hub: str = HUB

    def __post_init__(self) -> None:
        names = [n for name in self.datasets for n in GROUPS.get(name, (name,))]
        unknown = [n for n in names if n not in DATASETS]
        if unknown or not names:
            raise KvbenchError(f"task 'longbench': unknown dataset '{unknown[0] if unknown else ''}' "
                               f"(choose from {', '.join(DATASETS)} or {', '.join(GROUPS)})")
        if self.e and any(n not in LONGBENCH_E for n in names):
            odd = next(n for n in names if n not in LONGBENCH_E)
            raise KvbenchError(f"task 'longbench': '{odd}' is not in LongBench-E ({', '.join(LONGBENCH_E)})")
        self.names = list(dict.fromkeys(names))
        if self.data_dir is not None:  # a group takes the datasets the folder has; a named one must be there
            present = [n for n in self.names if n in self.datasets or self._path(n).is_file()]
            if not present:
                raise KvbenchError(f"task 'longbench': no LongBench files for {self.datasets} in {self.data_dir}")
            self.names = present

    def sample_count(self, count: int) -> int:
        if self.data_dir is None and count <= FEWEST_ROWS:  # every hub dataset has that many: no download to count
            return count * len(self.names)
        return sum(min(count, len(self._rows(name))) for name in self.names)

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        """The first `count` rows of each dataset (LongBench is scored on fixed rows; `seed` is unused)."""
        return [self._sample(tokenizer, name, index, row, context_length)
                for name in self.names for index, row in enumerate(self._rows(name)[:count])]

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        generated = [DATASETS[name][1] for name in self.names]
        return context_length, max_new_tokens or round(sum(generated) / len(generated))

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        dataset = sample.meta["dataset"]
        metric = METRICS[DATASETS[dataset][2]]
        if dataset in FIRST_LINE:
            prediction = prediction.lstrip("\n").split("\n")[0]
        value = max((metric(prediction, ref, all_classes=sample.meta["all_classes"]) for ref in sample.answers),
                    default=0.0)
        scores = {"score": value, dataset: value}
        if self.e:
            scores[f"length_{sample.meta['bucket']}"] = value
        return scores

    def _sample(self, tokenizer, dataset: str, index: int, row: dict[str, Any], context_length: int) -> Sample:
        template, max_new_tokens, _ = DATASETS[dataset]
        chat = dataset not in NO_CHAT_TEMPLATE
        prompt = template.replace("{context}", row["context"]).replace("{input}", row["input"])
        # LongBench truncates the prompt before wrapping it: leave room for the wrapping
        wrapping = sum(map(len, encode_prompt(tokenizer, Sample("", "", "", [], chat=chat, separator=""))))
        limit = context_length - wrapping
        if limit < 64:
            raise KvbenchError(f"task 'longbench': context length {context_length} is too short (minimum "
                               f"{wrapping + 64})")
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        if len(ids) > limit:  # keep the first and the last half: instructions and question survive
            half = limit // 2
            prompt = (tokenizer.decode(ids[:half], skip_special_tokens=True)
                      + tokenizer.decode(ids[-half:], skip_special_tokens=True))
        # the part after {context} is the question (for `question: agnostic`), when truncation left it whole
        question = template.split("{context}", 1)[1].replace("{input}", row["input"])
        context = prompt[: -len(question)] if question and prompt.endswith(question) else prompt
        length = row.get("length") or 0
        meta = {"dataset": dataset, "row_id": row.get("_id"), "length": length, "language": row.get("language"),
                "all_classes": row.get("all_classes"), "truncated": len(ids) > limit}
        if self.e:
            meta["bucket"] = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        return Sample(
            id=f"longbench-{dataset}-{index}", context=context, question=prompt[len(context):],
            answers=list(row["answers"]), max_new_tokens=max_new_tokens, stop=("\n",) if dataset in FIRST_LINE else (),
            chat=chat, separator="", meta=meta,
        )

    def _rows(self, dataset: str) -> list[dict[str, Any]]:
        if self.data_dir is not None:
            return _local_rows(str(self._path(dataset)))
        return _hub_rows(self.hub, f"{dataset}_e" if self.e else dataset)

    def _path(self, dataset: str) -> Path:
        return Path(self.data_dir).expanduser() / f"{dataset}{'_e' if self.e else ''}.jsonl"


@functools.lru_cache(maxsize=64)
def _local_rows(path: str) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        raise KvbenchError(f"task 'longbench': no data file {path}")
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KvbenchError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            _check_row(row, f"{path}:{number}")
            rows.append(row)
    return rows


@functools.lru_cache(maxsize=64)
def _hub_rows(hub: str, name: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise KvbenchError("task 'longbench' without data_dir loads the hub through `datasets`: "
                           "pip install -e '.[data]' in the kvbench checkout, or set data_dir to LongBench's JSONL "
                           "files") from None
    try:
        rows = list(datasets.load_dataset(hub, name, split="test"))
    except Exception as exc:  # offline, renamed: one line that says which
        raise KvbenchError(f"task 'longbench': cannot load {hub} '{name}': {str(exc).splitlines()[0]}") from None
    for number, row in enumerate(rows, 1):
        _check_row(row, f"{hub}/{name} row {number}")
    return rows


def _check_row(row: dict[str, Any], where: str) -> None:
    missing = [f for f in ("input", "context", "answers") if f not in row]
    if missing:
        raise KvbenchError(f"{where}: a LongBench row needs the field '{missing[0]}' (fields: {', '.join(FIELDS)})")
