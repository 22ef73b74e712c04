"""The task contract: a task makes samples fitted to a context length and scores predictions."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvbench.engine.segments import Segment
from kvbench.errors import KvbenchError
from kvbench.registry import Registry, declared_params

if TYPE_CHECKING:
    from kvbench.engine.generation import Generation
    from kvbench.engine.models import LoadedModel
    from kvbench.engine.settings import RunSettings
    from kvbench.engine.sharing import SharedPrefill
    from kvbench.policies.base import Policy

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
    chat: bool = True  # wrap in the tokenizer's chat template, when it has one
    separator: str = "\n\n"  # between context and question
    token_ids: list[int] | None = None  # a task that fixes the exact tokens (perplexity) sets them
    turns: list[dict[str, Any]] | None = None  # a conversation's user turns (dialogue)
    system: str | None = None  # a system prompt: the chat template's system turn, or the text before the context


@dataclass
class Task:
    name: ClassVar[str]
    # the headline `score` of `score()`: a fraction in [0, 1] where higher is better, or (perplexity) not
    higher_is_better: ClassVar[bool] = True
    # a sample is one prompt and one answer, so cells of a sweep may share the prompt's forward
    shares_prefill: ClassVar[bool] = True
    # the workload it stands for (`kvbench report` recommends a policy per scenario): "prompt-heavy" (the prompt
    # holds everything: retrieval, summaries), "generation-heavy" (what matters appears while generating),
    # "dialogue", "shared-context" (one context, many requests), "streaming" (language modelling)
    scenario: ClassVar[str] = "prompt-heavy"

    def samples(self, tokenizer: PreTrainedTokenizerBase, context_length: int, count: int,
                seed: int) -> list[Sample]:
        raise NotImplementedError

    def sample_count(self, count: int) -> int:
        """How many samples `samples(..., count, ...)` makes."""
        return count

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        """(prompt tokens, generated tokens) one sample costs: what a sweep's time estimate counts."""
        return context_length, max_new_tokens or getattr(self, "max_new_tokens", None) or 16

    def check_lengths(self, context_lengths: list[int]) -> None:
        """Raise KvbenchError when this task cannot run at these context lengths (a sweep checks its grid)."""

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        """Scores in [0, 1]; the key `score` is the headline number."""
        raise NotImplementedError

    def run(self, lm: LoadedModel, policy: Policy, sample: Sample, settings: RunSettings,
            shared: SharedPrefill | None = None) -> Generation:
        """Run one sample under `policy` in an engine session (kvbench/engine/session.py): by default prefill its
        prompt (the context alone first with `question: agnostic`) and generate one answer greedily."""
        return self.run_rows(lm, policy, [sample], settings, shared)[0]

    @property
    def batches(self) -> bool:
        """Whether a sweep may run samples of this task together (`run_rows`): not where the task runs its samples
        its own way (it overrides `run`)."""
        return type(self).run is Task.run

    def run_rows(self, lm: LoadedModel, policy: Policy, samples: list[Sample], settings: RunSettings,
                 shared: SharedPrefill | None = None) -> list[Generation]:
        """`run` for several samples at once, left-padded into one batch (`shared`: their shared prefill, in this
        order): each one's answer as `run` gives it alone."""
        from kvbench.engine.generation import Prompt, generate_rows

        prompts = [Prompt(*encode_prompt(lm.tokenizer, sample), settings.max_new_tokens or sample.max_new_tokens,
                          sample.stop) for sample in samples]
        return generate_rows(lm, policy, prompts, settings, shared=shared)

    def outcome(self, generation: Generation, sample: Sample) -> dict[str, Any]:
        """The record's task fields: the prediction, the references and the scores (and any series)."""
        return {"prediction": generation.prediction, "references": sample.answers,
                "scores": self.score(generation.prediction, sample)}

    def workload(self) -> str:
        """This task's scenario (a task whose parameters change it says so)."""
        return self.scenario

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
    context_text, question_text, add_special = _prompt_text(tokenizer, sample)
    context_ids = tokenizer(context_text, add_special_tokens=add_special).input_ids
    question_ids = tokenizer(question_text, add_special_tokens=False).input_ids
    return context_ids, question_ids


def prompt_segments(tokenizer: PreTrainedTokenizerBase, sample: Sample, pieces: list[tuple[str, str]],
                    ) -> tuple[Segment, ...]:
    """The positions of `pieces` ((label, text), in the order they appear in the sample's system prompt and context)
    in the context part `encode_prompt` makes: each segment covers the tokens its text overlaps."""
    context_text, _, add_special = _prompt_text(tokenizer, sample)
    offsets = tokenizer(context_text, add_special_tokens=add_special, return_offsets_mapping=True).offset_mapping
    token_starts, token_ends = [start for start, _ in offsets], [end for _, end in offsets]
    segments, at = [], 0
    for label, text in pieces:
        start = context_text.index(text, at)
        at = start + len(text)
        segments.append(Segment(label, bisect.bisect_right(token_ends, start), bisect.bisect_left(token_starts, at)))
    return tuple(segments)


def _prompt_text(tokenizer: PreTrainedTokenizerBase, sample: Sample) -> tuple[str, str, bool]:
    """The prompt as text, (context part, question part), and whether the tokenizer adds its special tokens to it."""
    if tokenizer.chat_template and sample.chat:
        system = [{"role": "system", "content": sample.system}] if sample.system else []
        rendered = tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": f"{sample.context}{sample.separator}{_SPLIT}{sample.question}"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        context_text, question_text = rendered.split(_SPLIT)
        return context_text, question_text + sample.answer_prefix, False  # the template carries its special tokens
    system = f"{sample.system}\n\n" if sample.system else ""
    question_text = f"{sample.question}\n{sample.answer_prefix}" if sample.answer_prefix else sample.question
    return f"{system}{sample.context}{sample.separator}", question_text, True


def prompt_overhead(tokenizer: PreTrainedTokenizerBase, question: str, answer_prefix: str) -> int:
    """Tokens a prompt spends outside its context (template, question, answer prefix)."""
    context_ids, question_ids = encode_prompt(tokenizer, Sample("probe", "", question, [], answer_prefix=answer_prefix))
    return len(context_ids) + len(question_ids)


def check_context_length(task: str, context_length: int, minimum: int) -> None:
    if context_length < minimum:
        raise KvbenchError(f"task '{task}': context length {context_length} is too short (minimum {minimum})")
