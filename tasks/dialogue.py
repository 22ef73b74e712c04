"""A multi-turn conversation held in one cache while the policy compresses it.

The user states facts (a name, a number, a city...) in the first turns, then shares passages of a
corpus, and later asks about the facts, interleaved with more passages. Every user turn is appended to
the cache as a chunk and compressed as a prefill chunk would be (so SnapKV re-selects by the latest
turn's window); every assistant reply is generated greedily into the same cache, where a decode-time
policy keeps evicting. Nothing is ever re-run: the cache sees each token once, replies included.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, register
from kvbench.tasks.corpus import haystack_text, load_corpus
from kvbench.tasks.metrics import normalize_answer

_NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ines", "Jonas", "Kavya",
          "Lucas", "Maya", "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Samir", "Tamsin")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Kyoto", "Toronto", "Valencia", "Krakow", "Lima", "Hanoi", "Dublin",
           "Marseille", "Adelaide", "Tbilisi", "Bergen", "Quito")
_COLOURS = ("turquoise", "maroon", "ochre", "lavender", "crimson", "teal", "amber", "indigo", "olive", "scarlet")
_PETS = ("Biscuit", "Pepper", "Waffles", "Juniper", "Mochi", "Rascal", "Noodle", "Clover", "Pickles", "Ziggy")
_INSTRUMENTS = ("cello", "banjo", "oboe", "harp", "trombone", "ukulele", "clarinet", "accordion")
# (statement, question, values): a fact the user states, and how it is asked for
FACTS = (
    ("My name is {value}.", "What is my name?", _NAMES),
    ("My locker number is {value}.", "What is my locker number?", None),
    ("I live in {value}.", "Which city do I live in?", _CITIES),
    ("My favourite colour is {value}.", "What is my favourite colour?", _COLOURS),
    ("My dog is called {value}.", "What is my dog called?", _PETS),
    ("I play the {value} in a band.", "Which instrument do I play in the band?", _INSTRUMENTS),
)
_REMEMBER = " Please remember this, I will ask you about it later."
_ASK = " Answer with just the answer."
_PASSAGE = "Here is a passage I am reading:\n\n{passage}\n\nSay in one short sentence what it is about."
_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)


@register
@dataclass
class Dialogue(Task):
    """Facts stated in early user turns, passages in between, questions about the facts later, all in
    one cache under the policy; score = fraction of facts recalled (exact match after normalisation),
    also by the distance in tokens between a fact and its question."""

    name = "dialogue"
    scenario = "dialogue"
    shares_prefill = False
    facts: int = 4
    passage_tokens: int = 256
    reply_tokens: int = 32
    answer_tokens: int = 16
    corpus: str = "embedded"

    def __post_init__(self) -> None:
        if not 1 <= self.facts <= len(FACTS):
            raise KvbenchError(f"task 'dialogue' parameter 'facts' must be in [1, {len(FACTS)}], got {self.facts}")
        if self.passage_tokens < 16 or self.reply_tokens < 1 or self.answer_tokens < 1:
            raise KvbenchError("task 'dialogue': passage_tokens >= 16, reply_tokens >= 1 and answer_tokens >= 1")

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        """`context_length` counts the user turns (with the chat template); the replies come on top."""
        template = turn_template(tokenizer)
        wrapping = len(tokenizer(template.close + template.user(_PASSAGE.format(passage="")),
                                 add_special_tokens=False).input_ids)
        out = []
        for index in range(count):
            rng = random.Random(f"{seed}:{index}")
            facts = []
            for statement, question, values in rng.sample(FACTS, self.facts):
                value = rng.choice(values) if values else str(rng.randint(100, 999))
                facts.append({"statement": statement.format(value=value), "question": question, "value": value})
            turns = [{"text": f["statement"] + _REMEMBER, "fact": i} for i, f in enumerate(facts)]
            asks = [{"text": f["question"] + _ASK, "asks": i} for i, f in enumerate(facts)]
            fixed = sum(len(tokenizer(template.user(t["text"]), add_special_tokens=False).input_ids)
                        for t in turns + asks)
            passages = (context_length - fixed) // (self.passage_tokens + wrapping)
            if passages < 2:
                raise KvbenchError(f"task 'dialogue': context length {context_length} is too short for "
                                   f"{self.facts} facts and two passages of {self.passage_tokens} tokens")
            # the passages share what whole passages leave over, so the user turns fill the context length
            size = (context_length - fixed - passages * wrapping) // passages
            text = load_corpus(self.corpus)
            fillers = []
            for _ in range(passages):
                start = text.find(" ", rng.randrange(max(1, len(text) - size * 12))) + 1
                passage, _ = haystack_text(tokenizer, text[start : start + size * 12], size)
                fillers.append({"text": _PASSAGE.format(passage=passage)})
            # the first half of the passages, then questions spread at random among the rest
            later = fillers[passages // 2 :] + asks
            rng.shuffle(later)
            turns += fillers[: passages // 2] + later
            out.append(Sample(id=f"dialogue-{context_length}-s{index}", context="", question="",
                              answers=[f["value"] for f in facts], max_new_tokens=self.answer_tokens,
                              turns=turns, meta={"facts": facts, "turns": len(turns)}))
        return out

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        passages = context_length // (self.passage_tokens + 40)
        return context_length, passages * self.reply_tokens + self.facts * (self.reply_tokens + self.answer_tokens)

    def run(self, lm, policy, sample, settings, shared=None):
        from kvbench.engine.generation import Generation
        from kvbench.engine.session import Session

        template = turn_template(lm.tokenizer)
        turn_ids = [lm.tokenizer(template.user(turn["text"], first=i == 0), add_special_tokens=False).input_ids
                    for i, turn in enumerate(sample.turns)]
        eos = lm.eos_token_ids
        close = lm.tokenizer(template.close, add_special_tokens=False).input_ids
        # a turn arrives with the last reply's pending token and the template's end of that reply
        session = Session(lm, policy, settings, prompt_tokens=sum(map(len, turn_ids)), chunked=True,
                          arrival=max(map(len, turn_ids)) + len(close) + 1)
        answers, fact_at, asked_at = {}, {}, {}
        with session:
            for number, (turn, ids) in enumerate(zip(sample.turns, turn_ids, strict=True)):
                if "fact" in turn:
                    fact_at[turn["fact"]] = session.seen
                session.prefill(close + ids if number else ids)
                asks = "asks" in turn
                if asks:
                    asked_at[turn["asks"]] = session.seen
                tokens = session.decode(self.answer_tokens if asks else self.reply_tokens, eos,
                                        ("\n",) if asks else ())[0]
                if asks:
                    answers[turn["asks"]] = answer_line(lm.tokenizer, tokens, eos)
        questions = []
        for index, fact in enumerate(sample.meta["facts"]):
            correct = _matches(answers[index], fact["value"])
            questions.append({"question": fact["question"], "expected": fact["value"], "answer": answers[index],
                              "correct": correct, "distance": asked_at[index] - fact_at[index]})
        prediction = " | ".join(answers[i] for i in range(len(sample.meta["facts"])))
        return Generation(prediction, [], session.logits, session.measurements(), extra={"questions": questions})

    def outcome(self, generation, sample: Sample) -> dict[str, Any]:
        questions = generation.extra["questions"]
        scores = {"score": sum(q["correct"] for q in questions) / len(questions)}
        by_bucket: dict[str, list[bool]] = {}
        for q in questions:
            by_bucket.setdefault(_bucket(q["distance"]), []).append(q["correct"])
        scores |= {f"distance_{name}": sum(v) / len(v) for name, v in by_bucket.items()}
        return {"prediction": generation.prediction, "references": sample.answers, "scores": scores,
                "questions": questions}


@dataclass(frozen=True)
class _TurnTemplate:
    """The chat template cut into the pieces an incremental conversation needs."""

    head: str  # before the first user message (system prompt, BOS)
    open_reply: str  # after a user message: the assistant's header
    close: str  # after a reply: the end of the assistant's turn and the next user header

    def user(self, text: str, first: bool = False) -> str:
        return f"{self.head if first else ''}{text}{self.open_reply}"


def answer_line(tokenizer, tokens: list[int], eos: set[int]) -> str:
    """A short answer's text: its first line, without end-of-sequence tokens."""
    return tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True).strip().split("\n")[0]


def turn_template(tokenizer) -> _TurnTemplate:
    if not tokenizer.chat_template:
        return _TurnTemplate(head="User: ", open_reply="\nAssistant:", close="\nUser: ")
    marks = ["\x01U\x01", "\x01A\x01", "\x01V\x01"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": marks[0]}, {"role": "assistant", "content": marks[1]},
         {"role": "user", "content": marks[2]}], tokenize=False, add_generation_prompt=True)
    head, rest = rendered.split(marks[0])
    open_reply, rest = rest.split(marks[1])
    close, _ = rest.split(marks[2])
    return _TurnTemplate(head=head, open_reply=open_reply, close=close)


def _matches(answer: str, value: str) -> bool:
    """Exact match after SQuAD normalisation, of the value as whole words anywhere in the answer."""
    return re.search(rf"(^| ){re.escape(normalize_answer(value))}( |$)", normalize_answer(answer)) is not None


def _bucket(distance: int) -> str:
    low = 0
    for high in _BUCKETS:
        if distance < high:
            return f"{low}-{high}"
        low = high
    return f"{low}+"
