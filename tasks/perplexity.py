"""Perplexity of a long text streamed through the cache under a policy, as StreamingLLM measures it.

The text goes through the model `chunk` tokens at a time (one in `exact` mode). Each step's tokens are
scored against the cache as it stands (plus causal attention among themselves). The first chunk is the
prompt, compressed as one; the rest is a continuation, where a decode-time policy evicts to its budget after
every step and a prefill-time one (SnapKV) lets the cache grow, as it would over a generation
(`budget_scope` says which). `exact` is the definition: every token is predicted from a cache evicted right
before it. `chunked` is ~`chunk` times faster; within a chunk the cache holds up to `budget + chunk`
entries, so its perplexity is a little lower than `exact`'s at the same budget (the gap shrinks as
chunk / budget does).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Literal

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, register
from kvbench.tasks.corpus import load_corpus

_CHARS_PER_TOKEN = 12  # no tokenizer spends more characters of English text on one token


@register
@dataclass
class Perplexity(Task):
    """Negative log-likelihood of every token of a `context_length`-token stretch of a corpus, under the
    policy's cache; score = perplexity (lower is better), also over the tokens past the budget."""

    name = "perplexity"
    higher_is_better = False
    scenario = "streaming"
    shares_prefill = False
    corpus: str = "embedded"  # `embedded`, a text file, a folder of .txt files, `hf:pg19`, `hf:wikitext`
    mode: Literal["exact", "chunked"] = "chunked"
    chunk: int = 64

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "chunked"):
            raise KvbenchError(f"task 'perplexity' parameter 'mode' must be exact or chunked, got '{self.mode}'")
        if self.chunk < 1:
            raise KvbenchError(f"task 'perplexity' parameter 'chunk' must be at least 1, got {self.chunk}")

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        if context_length < 2:
            raise KvbenchError(f"task 'perplexity': context length {context_length} is too short (minimum 2)")
        text = load_corpus(self.corpus)
        chars = context_length * _CHARS_PER_TOKEN
        out = []
        for index in range(count):
            rng = random.Random(f"{seed}:{index}")
            start = rng.randrange(max(1, len(text) - chars))
            start = text.find(" ", start) + 1 if start else 0  # begin at a word
            ids = tokenizer(text[start : start + chars], add_special_tokens=False).input_ids[:context_length]
            if len(ids) < context_length:
                raise KvbenchError(f"task 'perplexity': corpus '{self.corpus}' has only {len(ids)} tokens from "
                                   f"offset {start}, fewer than the context length {context_length}")
            out.append(Sample(id=f"ppl-{context_length}-s{index}", context="", question="", answers=[],
                              token_ids=ids, meta={"offset_chars": start}))
        return out

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        return (0, context_length) if self.mode == "exact" else (context_length, 0)

    def run(self, lm, policy, sample, settings, shared=None):
        from kvbench.engine.generation import Generation
        from kvbench.engine.session import Session

        ids = sample.token_ids
        step = 1 if self.mode == "exact" else self.chunk
        session = Session(lm, policy, settings, prompt_tokens=len(ids), arrival=step)
        with session:  # a fresh session streams the text: the first step is the prompt, compressed once
            nll = (-session.score(ids, chunk=step).logprobs).tolist()
        # every token is read as prompt; `exact` times each one-token step as a decode step
        return Generation("", [], session.logits, session.measurements(), extra={"nll_by_position": nll})

    def outcome(self, generation, sample: Sample) -> dict[str, Any]:
        nll = generation.extra["nll_by_position"]
        budget = generation.measurements["budget_tokens"]
        scores = {"score": _perplexity(nll), "nll": sum(nll) / len(nll)}
        # nll[i] scores token i + 1, predicted from i + 1 tokens: evicted ones once i + 1 > budget
        if budget is not None and budget < len(nll):
            scores["ppl_past_budget"] = _perplexity(nll[budget:])
        return {"prediction": "", "references": [], "scores": scores,
                "nll_by_position": [round(value, 4) for value in nll]}


def _perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))
