"""Long generation: continue a passage of a corpus for `length` tokens, where a decode-time policy's budget holds
for the whole generation and a prefill-time one lets the cache grow.

Two measures: the perplexity of the corpus's own continuation of the passage, teacher-forced through the policy's
cache (`Session.score`, token by token as if generated: the quality), and the greedy generation itself (its
length, and with `diagnostics: [fidelity]` how far it drifts from the full cache's along the way).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, register
from kvbench.tasks.corpus import load_corpus


@register
@dataclass
class LongGen(Task):
    """Continue a `context_length`-token passage for `length` tokens; score = perplexity of the corpus's own
    continuation under the policy's cache (lower is better), and the generation's length."""

    name = "longgen"
    higher_is_better = False
    scenario = "generation-heavy"
    shares_prefill = False  # its prompt is token ids, scored and generated in two sessions
    length: int = 256
    corpus: str = "embedded"

    def __post_init__(self) -> None:
        if self.length < 2:
            raise KvbenchError(f"task 'longgen' parameter 'length' must be at least 2, got {self.length}")

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        text, total = load_corpus(self.corpus), context_length + self.length
        out = []
        for index in range(count):
            rng = random.Random(f"{seed}:{index}")
            start = text.find(" ", rng.randrange(max(1, len(text) - total * 12))) + 1
            ids = tokenizer(text[start : start + total * 12], add_special_tokens=False).input_ids[:total]
            if len(ids) < total:
                raise KvbenchError(f"task 'longgen': corpus '{self.corpus}' has only {len(ids)} tokens from offset "
                                   f"{start}, fewer than {total}")
            out.append(Sample(id=f"longgen-{context_length}-s{index}", context="", question="", answers=[],
                              max_new_tokens=self.length, token_ids=ids[:context_length],
                              meta={"offset_chars": start, "continuation": ids[context_length:]}))
        return out

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        return 2 * context_length, 2 * self.length  # the reference scored, and the generation

    def run(self, lm, policy, sample, settings, shared=None):
        import dataclasses

        from kvbench.engine.generation import generate
        from kvbench.engine.session import Session

        prompt, reference = sample.token_ids, sample.meta["continuation"]
        scorer = Session(lm, dataclasses.replace(policy), settings, prompt_tokens=len(prompt),
                         adds=len(reference))
        with scorer:
            scorer.prefill(prompt)
            nll = (-scorer.score(reference, chunk=1).logprobs).tolist()
        generation = generate(lm, policy, prompt, [], settings, max_new_tokens=settings.max_new_tokens or self.length)
        generation.extra = {"nll": nll}
        return generation

    def outcome(self, generation, sample: Sample) -> dict[str, Any]:
        nll = generation.extra["nll"]
        scores = {"score": math.exp(sum(nll) / len(nll)), "nll": sum(nll) / len(nll)}
        return {"prediction": generation.prediction, "references": [], "scores": scores,
                "nll_by_position": [round(value, 4) for value in nll]}
