"""lm-evaluation-harness tasks as sweep cells: each doc of each named lm-eval task is a sample, run by the `kvbench`
lm-eval model (tasks/lmeval_model.py) under the cell's policy and budget; lm-eval builds the requests and scores them.

The cell's context length is lm-eval's length knob where a task has one (a task that generates its data, as
RULER's do, gets it as `max_seq_lengths` metadata, with the model's tokenizer); a task with fixed data has none:
its docs run as they are, and a sweep must list one context length for it, the longest prompt a cell may feed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, register


@register
@dataclass
class LmEval(Task):
    """Any lm-evaluation-harness task under the policy's compressed cache, one sample per doc; score = the task's
    headline metric (`metric`, else its first, or for RULER the context length's)."""

    name = "lm_eval"
    shares_prefill = False
    tasks: list[str] = field(default_factory=list)  # lm-eval task names
    include_path: str | None = None  # a folder of task YAML files (local tasks)
    limit: int | None = None  # docs per task (default: the sweep's samples)
    num_fewshot: int | None = None
    metric: str | None = None
    apply_chat_template: bool = False
    score_chunk: int = 1  # continuation tokens scored per forward (1: each evicted for as if generated)
    stream_chunk: int = 64  # loglikelihood_rolling: tokens streamed per forward
    # `question: agnostic` cells cut each context at the last occurrence of this marker (`re:<pattern>`: a regular
    # expression), compress the text before it and append the rest; `aware` cells compress each context whole
    split_at: str | None = None

    def __post_init__(self) -> None:
        if not self.tasks:
            raise KvbenchError("task 'lm_eval' needs `tasks`: a list of lm-eval task names")
        if self.limit is not None and self.limit < 1:
            raise KvbenchError(f"task 'lm_eval' parameter 'limit' must be at least 1, got {self.limit}")
        if self.split_at is not None:
            bridge().marker_pattern(self.split_at)  # a bad regular expression fails the config, not every cell

    def _loaded(self, tokenizer, context_length: int) -> tuple[Any, dict[str, Any]]:
        return _tasks(tuple(self.tasks), self.include_path, context_length, getattr(tokenizer, "name_or_path", None))

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        out = []
        for name, task in self._loaded(tokenizer, context_length)[1].items():
            docs = min(len(task.eval_docs), self.limit or count)
            out += [Sample(id=f"{name}-{doc}", context="", question="", answers=[], max_new_tokens=0,
                           meta={"lm_eval_task": name, "doc_id": doc, "context_length": context_length})
                    for doc in range(docs)]
        return out

    def sample_count(self, count: int) -> int:
        return len(self.tasks) * (self.limit or count)

    def check_lengths(self, context_lengths: list[int]) -> None:
        tasks = _tasks(tuple(self.tasks), self.include_path, context_lengths[0], None)[1]
        fixed = [name for name, task in tasks.items() if not has_length_knob(task)]
        if fixed and len(context_lengths) > 1:
            raise KvbenchError(f"task 'lm_eval': lm-eval task '{fixed[0]}' has fixed data and no length knob: list "
                               f"one context length (the longest prompt a cell may feed), got {context_lengths}")

    def run(self, lm, policy, sample, settings, shared=None):
        from kvbench.engine.generation import Generation

        if settings.question == "agnostic" and self.split_at is None:
            raise KvbenchError("task 'lm_eval' with question: agnostic needs `split_at`: lm-eval requests carry no "
                               "context/question split, the marker's last occurrence in each context makes one")
        name, length = sample.meta["lm_eval_task"], sample.meta["context_length"]
        manager, tasks = self._loaded(lm.tokenizer, length)
        task = tasks[name]
        logged, requests = bridge().evaluate_doc(lm, policy, settings, manager, task, name, sample.meta["doc_id"],
                                        self.num_fewshot, self.apply_chat_template, self.score_chunk,
                                        self.stream_chunk, self.split_at if settings.question == "agnostic" else None)
        longest = max(requests, key=lambda r: r["prompt_tokens"])
        if not has_length_knob(task) and longest["prompt_tokens"] > length:
            raise KvbenchError(f"task 'lm_eval': a '{name}' prompt has {longest['prompt_tokens']} tokens, more than "
                               f"the context length {length}")
        measured = {key: value for key, value in longest.items()
                    if key not in ("request_type", "task", "doc_id", "logprob", "is_greedy", "generated", "tokens",
                                   "question_tokens")}
        metrics = {key: logged[key] for key in logged["metrics"]}
        headline = self.metric or (str(length) if str(length) in metrics else task.config.metric_list[0]["metric"])
        if headline not in metrics:
            raise KvbenchError(f"task 'lm_eval': '{name}' reports no metric '{headline}' (it has "
                               f"{', '.join(metrics)})")
        responses = [r.get("generated", r.get("logprob")) for r in requests]
        return Generation(str(logged["filtered_resps"][0]), [], None, measured,
                          extra={"metrics": metrics, "headline": headline, "target": logged["target"],
                                 "arguments": logged["arguments"], "responses": responses})

    def outcome(self, generation, sample: Sample) -> dict[str, Any]:
        extra = generation.extra
        scores = {key: float(value) for key, value in extra["metrics"].items() if isinstance(value, (int, float))}
        return {"prediction": generation.prediction, "references": [str(extra["target"])],
                "scores": {"score": float(extra["metrics"][extra["headline"]]), **scores},
                "lm_eval": {"task": sample.meta["lm_eval_task"], "doc_id": sample.meta["doc_id"],
                            "metric": extra["headline"], "metrics": extra["metrics"],
                            "arguments": [list(map(str, a)) for a in extra["arguments"]],
                            "responses": extra["responses"]}}


def has_length_knob(task: Any) -> bool:
    """A task that generates its own data (RULER's) sizes it by `max_seq_lengths`; fixed data has no knob."""
    return task.config.custom_dataset is not None


def bridge() -> ModuleType:
    """tasks/lmeval_model.py, which imports lm-evaluation-harness."""
    try:
        import kvbench.tasks.lmeval_model
    except ImportError:
        raise KvbenchError("task 'lm_eval' needs lm-evaluation-harness: pip install -e '.[lmeval]' in the kvbench "
                           "checkout") from None
    return kvbench.tasks.lmeval_model


@functools.lru_cache(maxsize=8)
def _tasks(names: tuple[str, ...], include_path: str | None, context_length: int, tokenizer: str | None):
    metadata = {"max_seq_lengths": [context_length], **({"tokenizer": tokenizer} if tokenizer else {})}
    return bridge().lm_eval_tasks(names, include_path, metadata)
