"""One context asked many times (SCBench's shared-context setting): `facts` needles spread over a long context,
which is compressed once, then a question about each, by access pattern.

  multi_turn     the questions one after another in one conversation: each answer is generated into the cache
                 and the next question follows it (a chat over a document);
  multi_request  every question from a fork of the same compressed context (a prefix-cached server): no request
                 sees another's question or answer.

`pattern` orders the questions: `sequential` (document order), `random` (a seeded permutation) or `hotspot`
(`hotspot_share` of them about the facts of one quarter of the document, the rest about any other). Questions
after the first arrive in the decode phase: a prefill-time policy compressed the context once, before any of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, check_context_length, encode_prompt, prompt_overhead, register
from kvbench.tasks.corpus import haystack_text, load_corpus
from kvbench.tasks.dialogue import answer_line, turn_template
from kvbench.tasks.niah import sentence_boundary
from kvbench.tasks.words import word_key

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"


@register
@dataclass
class MultiQuery(Task):
    """`facts` numbers keyed by words, spread over one context compressed once, then asked one by one (in one
    conversation, or each from a fork) in a given access pattern; score = share found, also per query index."""

    name = "multiquery"
    shares_prefill = False
    facts: int = 4
    mode: Literal["multi_turn", "multi_request"] = "multi_request"
    pattern: Literal["sequential", "random", "hotspot"] = "sequential"
    hotspot_share: float = 0.8
    queries: int | None = None  # how many questions (default: one per fact)
    answer_tokens: int = 12
    corpus: str = "embedded"

    def __post_init__(self) -> None:
        if self.facts < 1 or (self.queries is not None and self.queries < 1) or self.answer_tokens < 1:
            raise KvbenchError("task 'multiquery': facts, queries and answer_tokens must be at least 1")
        if self.mode not in ("multi_turn", "multi_request"):
            raise KvbenchError(f"task 'multiquery' parameter 'mode' must be multi_turn or multi_request, "
                               f"got '{self.mode}'")
        if self.pattern not in ("sequential", "random", "hotspot"):
            raise KvbenchError(f"task 'multiquery' parameter 'pattern' must be sequential, random or hotspot, "
                               f"got '{self.pattern}'")
        if not 0 <= self.hotspot_share <= 1:
            raise KvbenchError(f"task 'multiquery' parameter 'hotspot_share' must be in [0, 1], "
                               f"got {self.hotspot_share}")

    def workload(self) -> str:
        # a chat over a document generates into the cache; a prefix-cached server asks each question afresh
        return "generation-heavy" if self.mode == "multi_turn" else "shared-context"

    def order(self, rng: random.Random) -> list[int]:
        """Which fact each question asks about, by the access pattern."""
        count = self.queries or self.facts
        if self.pattern == "sequential":
            return [i % self.facts for i in range(count)]
        if self.pattern == "random":
            order = [i % self.facts for i in range(count)]
            rng.shuffle(order)
            return order
        width = max(1, -(-self.facts // 4))  # a quarter of the document's facts
        start = rng.randrange(self.facts - width + 1)
        hot, cold = list(range(start, start + width)), [i for i in range(self.facts) if not start <= i < start + width]
        return [rng.choice(hot) if not cold or rng.random() < self.hotspot_share else rng.choice(cold)
                for _ in range(count)]

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        out = []
        for index in range(count):
            rng = random.Random(f"{seed}:{index}")
            facts = [{"key": word_key(rng), "value": str(rng.randrange(10**6, 10**7))} for _ in range(self.facts)]
            needles = [NEEDLE.format(**fact) for fact in facts]
            overhead = prompt_overhead(tokenizer, QUESTION.format(key=facts[0]["key"]),
                                       ANSWER_PREFIX.format(key=facts[0]["key"]))
            overhead += sum(len(tokenizer(f" {needle} ").input_ids) for needle in needles)
            check_context_length(self.name, context_length, overhead + 16)
            haystack, offsets = haystack_text(tokenizer, load_corpus(self.corpus), context_length - overhead)
            cuts = [sentence_boundary(haystack, offsets, (i + 0.5) / self.facts) for i in range(self.facts)]
            pieces, last = [], 0
            for cut, needle in zip(cuts, needles, strict=True):
                pieces += [haystack[last:cut], f" {needle} "]
                last = cut
            context = ("".join(pieces) + haystack[last:]).strip()
            order = self.order(rng)
            for fact, cut in zip(facts, cuts, strict=True):
                fact["depth"] = round(cut / max(1, len(haystack)), 3)
            out.append(Sample(id=f"multiquery-{context_length}-s{index}", context=context,
                              question=QUESTION.format(key=facts[order[0]]["key"]),
                              answers=[facts[i]["value"] for i in order], max_new_tokens=self.answer_tokens,
                              answer_prefix=ANSWER_PREFIX.format(key=facts[order[0]]["key"]),
                              meta={"facts": facts, "order": order, "mode": self.mode, "pattern": self.pattern}))
        return out

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        queries = self.queries or self.facts
        return context_length, queries * (max_new_tokens or self.answer_tokens)

    def run(self, lm, policy, sample, settings, shared=None):
        from kvbench.engine.generation import Generation
        from kvbench.engine.session import Session

        facts, order = sample.meta["facts"], sample.meta["order"]
        context_ids, first = encode_prompt(lm.tokenizer, sample)
        template = turn_template(lm.tokenizer)
        close = lm.tokenizer(template.close, add_special_tokens=False).input_ids

        def question_ids(fact: int) -> list[int]:
            question, prefix = QUESTION.format(key=facts[fact]["key"]), ANSWER_PREFIX.format(key=facts[fact]["key"])
            if self.mode == "multi_turn":  # a new user turn after the last answer
                return close + lm.tokenizer(template.user(question) + prefix, add_special_tokens=False).input_ids
            return encode_prompt(lm.tokenizer, Sample("q", sample.context, question, [], answer_prefix=prefix))[1]

        asks = [first] + [question_ids(fact) for fact in order[1:]]
        eos, limit = lm.eos_token_ids, settings.max_new_tokens or self.answer_tokens

        def ask(asker: Session, ids: list[int]) -> tuple[int, str]:
            position = asker.seen
            asker.append(ids)
            return position, answer_line(lm.tokenizer, asker.decode(limit, eos, ("\n",))[0], eos)

        # each ask, the answer's pending token and the answer (an ask is under 64 tokens)
        session = Session(lm, policy, settings, prompt_tokens=len(context_ids), arrival=max(map(len, asks)) + 1,
                          adds=len(asks) * (limit + 64))
        questions = []
        with session:
            session.prefill(context_ids)  # compressed once, before any question
            for number, (fact, ids) in enumerate(zip(order, asks, strict=True)):
                if self.mode == "multi_request":
                    with session.fork() as fork:
                        position, answer = ask(fork, ids)
                else:
                    position, answer = ask(session, ids)
                questions.append({"index": number, "fact": fact, "depth": facts[fact]["depth"],
                                  "expected": facts[fact]["value"], "answer": answer, "position": position,
                                  "correct": facts[fact]["value"] in answer})
        prediction = " | ".join(q["answer"] for q in questions)
        return Generation(prediction, [], session.logits, session.measurements(), extra={"questions": questions})

    def outcome(self, generation, sample: Sample) -> dict[str, Any]:
        questions = generation.extra["questions"]
        scores = {"score": sum(q["correct"] for q in questions) / len(questions)}
        scores |= {f"q{q['index']}": float(q["correct"]) for q in questions}
        return {"prediction": generation.prediction, "references": sample.answers, "scores": scores,
                "questions": questions, "query_order": sample.meta["order"]}
