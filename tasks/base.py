"""The task contract: a task makes samples fitted to a context length and scores predictions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvbench.errors import KvbenchError
from kvbench.registry import Registry, declared_params

# Splits the rendered chat prompt into the context part and the question part (see encode_prompt).
_SPLIT = "\x00KVBENCH-QUESTION\x00"


@dataclass
class Sample:
    id: str
    context: str
    question: str
    answers: list[str]
    max_new_tokens: int = 16
    answer_prefix: str = ""
    stop: tuple[str, ...] = ("\n",)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: ClassVar[str]

    def samples(self, tokenizer: PreTrainedTokenizerBase, context_length: int, count: int,
                seed: int) -> list[Sample]:
        raise NotImplementedError

    def sample_count(self, count: int) -> int:
        """How many samples `samples(..., count, ...)` makes."""
        return count

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        """Scores in [0, 1]; the key `score` is the headline number."""
        raise NotImplementedError

    @classmethod
    def params(cls) -> dict[str, Any]:
        return declared_params(cls)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}


TASKS: Registry[Task] = Registry("task")
register = TASKS.register
build_task = TASKS.build


def encode_prompt(tokenizer: PreTrainedTokenizerBase, sample: Sample) -> tuple[list[int], list[int]]:
    """Token ids of (context part, question part). Their concatenation is the whole prompt; the split
    lets `question: agnostic` compress the context before the question arrives, on the same tokens."""
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{sample.context}\n\n{_SPLIT}{sample.question}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        context_text, question_text = rendered.split(_SPLIT)
        add_special = False  # the template carries its own special tokens
    else:
        context_text, question_text = f"{sample.context}\n\n", f"{sample.question}\n"
        add_special = True
    question_text += sample.answer_prefix
    context_ids = tokenizer(context_text, add_special_tokens=add_special).input_ids
    question_ids = tokenizer(question_text, add_special_tokens=False).input_ids
    return context_ids, question_ids


def prompt_overhead(tokenizer: PreTrainedTokenizerBase, question: str, answer_prefix: str) -> int:
    """Tokens a prompt spends outside its context (template, question, answer prefix)."""
    context_ids, question_ids = encode_prompt(tokenizer, Sample("probe", "", question, [], answer_prefix=answer_prefix))
    return len(context_ids) + len(question_ids)


def check_context_length(task: str, context_length: int, minimum: int) -> None:
    if context_length < minimum:
        raise KvbenchError(f"task '{task}': context length {context_length} is too short (minimum {minimum})")
