"""Needle in a haystack: one fact hidden at a depth of a long context, asked for at the end."""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass, field
from typing import Literal

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, check_context_length, prompt_overhead, register
from kvbench.tasks.corpus import NOISE, haystack_text, load_corpus
from kvbench.tasks.words import word_key

_WORD = re.compile(r"\w+")


@register
@dataclass
class NeedleInAHaystack(Task):
    """A random number keyed by a random word, hidden at `depths`; score 1 if the answer has it."""

    name = "niah"
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    haystack: Literal["text", "noise"] = "text"
    corpus: str = "embedded"  # `embedded`, a text file or a folder of .txt files (haystack: text)
    needle: str = "One of the special magic numbers for {key} is: {value}."
    question: str = "What is the special magic number for {key} mentioned in the provided text?"
    answer_prefix: str = "The special magic number for {key} mentioned in the provided text is"
    digits: int = 7
    max_new_tokens: int = 12

    def __post_init__(self) -> None:
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad or not self.depths:
            raise KvbenchError(f"task 'niah' parameter 'depths' must be values in [0, 1], got {self.depths}")
        for template, fields in (("needle", ("{key}", "{value}")), ("question", ("{key}",))):
            missing = [f for f in fields if f not in getattr(self, template)]
            if missing:
                raise KvbenchError(f"task 'niah' parameter '{template}' must contain {missing[0]}")

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        out = []
        for index in range(count):
            rng = random.Random(f"{seed}:{index}")
            key = word_key(rng)
            value = str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))
            fill = {"key": key, "value": value}
            needle, question = self.needle.format(**fill), self.question.format(**fill)
            answer_prefix = self.answer_prefix.format(**fill)
            overhead = prompt_overhead(tokenizer, question, answer_prefix) + len(tokenizer(f" {needle} ").input_ids)
            check_context_length(self.name, context_length, overhead + 16)
            haystack, offsets = self._haystack(tokenizer, context_length - overhead)
            for depth in self.depths:
                at = sentence_boundary(haystack, offsets, depth)
                out.append(Sample(
                    id=f"niah-{context_length}-d{depth:g}-s{index}",
                    context=f"{haystack[:at]} {needle} {haystack[at:]}".strip(),
                    question=question,
                    answers=[value],
                    max_new_tokens=self.max_new_tokens,
                    answer_prefix=answer_prefix,
                    meta={"depth": depth, "key": key, "needle": needle},
                ))
        return out

    def sample_count(self, count: int) -> int:
        return count * len(self.depths)

    def _haystack(self, tokenizer, tokens: int) -> tuple[str, list[int]]:
        return haystack_text(tokenizer, NOISE if self.haystack == "noise" else load_corpus(self.corpus), tokens)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        found = [word.lower() for word in _WORD.findall(prediction)]
        expected = [word.lower() for answer in sample.answers for word in _WORD.findall(answer)]
        recall = sum(word in found for word in expected) / len(expected) if expected else 0.0
        exact = float(all(answer in prediction for answer in sample.answers))
        return {"score": exact, "recall": recall}


def sentence_boundary(text: str, token_ends: list[int], depth: float) -> int:
    """Character index of the sentence boundary whose token position is nearest `depth`."""
    boundaries = [0] + [m.end() for m in re.finditer(r"[.!?]\s", text)] + [len(text)]
    target = depth * len(token_ends)
    return min(boundaries, key=lambda at: abs(bisect.bisect_left(token_ends, at) - target))
