"""Few-shot examples as units ("Semantic Integrity Matters", KVFundaBench, ICML 2026): worked examples of a small task
fill the context, then a new instance. Exact match; each example is a segment of the prompt (engine/segments.py), so
the record says per sample which examples eviction split (kept some of their entries but not all, in some layer and
KV head) and the share it split (`segments_split`). `whole_segments` keeps or drops them whole.

  kebab   `words` consecutive corpus words joined by hyphens: `applied user defined` -> `applied-user-defined`
  title   the same words capitalised: `Applied User Defined`
  add     the sum of two `digits`-digit numbers: `482 + 317` -> `799`

The embedded models do the first two at full cache and not the third; a larger model takes `add`. The examples are
plain text (no chat template), as lm-eval's few-shot prompts are, and their count is what the context length holds.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Literal

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, check_context_length, encode_prompt, prompt_segments, register
from kvbench.tasks.corpus import load_corpus

_BETWEEN = "\n\n"  # between two examples (no example holds it: the context splits back into its examples)


@register
@dataclass
class FewShot(Task):
    """Worked examples of a transformation or a sum, as many as the context holds, then a new instance; score = exact
    match (the record's `segments_split`: the share of the examples eviction split)."""

    name = "fewshot"
    operation: Literal["kebab", "title", "add"] = "kebab"
    words: int = 3  # kebab, title: corpus words per instance
    digits: int = 3  # add: digits of each number
    answer_tokens: int = 16
    corpus: str = "embedded"

    def __post_init__(self) -> None:
        if self.words < 1 or self.digits < 1 or self.answer_tokens < 1:
            raise KvbenchError("task 'fewshot': words, digits and answer_tokens must be at least 1")

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        out = []
        for index in range(count):
            rng = random.Random(f"{seed}:{index}")
            query, answer = self.instance(rng)
            room = context_length - _length(tokenizer, self._sample(query, answer, []))
            # whole examples until the context is full (each tokenized alone, as it nearly is in the prompt), then the
            # last ones dropped while the prompt as tokenized runs over
            examples: list[str] = []
            while room > 0 or len(examples) < 2:
                examples.append("Input: {}\nOutput: {}".format(*self.instance(rng)))
                room -= len(tokenizer(examples[-1] + _BETWEEN, add_special_tokens=False).input_ids)
            sample = self._sample(query, answer, examples)
            while len(examples) > 2 and _length(tokenizer, sample) > context_length:
                examples.pop()
                sample = self._sample(query, answer, examples)
            check_context_length(self.name, context_length, _length(tokenizer, sample))
            sample.id = f"fewshot-{context_length}-s{index}"
            out.append(sample)
        return out

    def _sample(self, query: str, answer: str, examples: list[str]) -> Sample:
        return Sample(id="", context=_BETWEEN.join(examples), question=f"Input: {query}", answers=[answer],
                      max_new_tokens=self.answer_tokens, answer_prefix="Output:", chat=False,
                      meta={"operation": self.operation, "examples": len(examples)})

    def instance(self, rng: random.Random) -> tuple[str, str]:
        """One (input, output) of the operation."""
        if self.operation == "add":
            low, high = 10 ** (self.digits - 1), 10**self.digits
            a, b = rng.randrange(low, high), rng.randrange(low, high)
            return f"{a} + {b}", str(a + b)
        words = corpus_words(self.corpus)
        start = rng.randrange(len(words) - self.words)
        picked = words[start : start + self.words]
        output = "-".join(picked) if self.operation == "kebab" else " ".join(map(str.capitalize, picked))
        return " ".join(picked), output

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        return context_length, max_new_tokens or self.answer_tokens

    def run(self, lm, policy, sample, settings, shared=None):
        from kvbench.engine.generation import generate

        examples = [(f"example {i + 1}", text) for i, text in enumerate(sample.context.split(_BETWEEN))]
        return generate(lm, policy, *encode_prompt(lm.tokenizer, sample), settings,
                        settings.max_new_tokens or sample.max_new_tokens, sample.stop, shared=shared,
                        segments=prompt_segments(lm.tokenizer, sample, examples))

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {"score": float(prediction.strip() == sample.answers[0])}


def _length(tokenizer, sample: Sample) -> int:
    return sum(map(len, encode_prompt(tokenizer, sample)))


@functools.lru_cache(maxsize=4)
def corpus_words(source: str) -> tuple[str, ...]:
    """The corpus's words in order, lower case, letters only."""
    return tuple(re.findall(r"[a-z]+", load_corpus(source).lower()))
