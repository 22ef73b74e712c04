"""RULER-style synthetic tasks (Hsieh et al., 2024), generated offline and fitted to the exact context
length with the model's own tokenizer.

Templates and answer prefixes are RULER's. Scores follow RULER's `string_match_all` (the fraction of
the references found in the prediction, case-insensitive) and `string_match_part` (1 if any is found);
kvbench reports them as fractions in [0, 1] where RULER prints x100. A cell of the `ruler` task runs
every listed subtask `samples` times: its score is the average over the suite, and the summary keeps
one `score_<subtask>` column per subtask.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvbench.errors import KvbenchError
from kvbench.tasks.base import Sample, Task, encode_prompt, register
from kvbench.tasks.corpus import NOISE, haystack_text, load_corpus
from kvbench.tasks.niah import sentence_boundary
from kvbench.tasks.words import english_words, pseudo_words, word_key

SUBTASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
_NIAH = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the {kind} afterwards.")
_NIAH_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
_NIAH_PREFIX = "The special magic {kind} for {query} mentioned in the provided text are"
_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_VT = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
              "are assigned the value {value}, they are: ")
_CWE = ("Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.")
_CWE_QUESTION = "Question: What are the {count} most common words in the above list?"
_CWE_PREFIX = "Answer: The top {count} words that appear most often in the list are:"
_FWE = ("Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words.")
_FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                 "What are the three most frequently appeared words in the above coded text?")
_FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER: the fraction of references found (case-insensitive) in the prediction."""
    found = prediction.lower()
    return sum(ref.lower() in found for ref in references) / len(references) if references else 0.0


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER (QA tasks): 1 if any reference is found (case-insensitive) in the prediction."""
    found = prediction.lower()
    return float(any(ref.lower() in found for ref in references))


@register
@dataclass
class Ruler(Task):
    """RULER's synthetic suite: needle variants (single, multi-key, multi-value, multi-query), variable
    tracking, common and frequent word extraction; score = string_match_all averaged over the suite."""

    name = "ruler"
    subtasks: list[str] = field(default_factory=lambda: list(SUBTASKS))
    haystack: Literal["text", "noise", "needle"] = "text"  # niah_*: prose, repeated sentences, or needles
    corpus: str = "embedded"  # the prose of `haystack: text`
    values: Literal["numbers", "uuids"] = "numbers"  # niah_* needle values
    needles: int = 4  # keys (multikey), values (multivalue) or queries (multiquery)
    vt_chains: int = 1
    vt_hops: int = 4
    cwe_words: int = 10
    fwe_alpha: float = 2.0
    max_new_tokens: int | None = None  # RULER's per subtask (niah 128, vt 30, cwe 120, fwe 50)

    def __post_init__(self) -> None:
        unknown = [s for s in self.subtasks if s not in SUBTASKS]
        if unknown or not self.subtasks:
            raise KvbenchError(f"task 'ruler': unknown subtask '{unknown[0] if unknown else ''}' "
                               f"(choose from {', '.join(SUBTASKS)})")
        if self.needles < 2 or self.vt_chains < 1 or self.vt_hops < 1 or self.cwe_words < 1 or self.fwe_alpha <= 1:
            raise KvbenchError("task 'ruler': needles >= 2, vt_chains >= 1, vt_hops >= 1, cwe_words >= 1 and "
                               "fwe_alpha > 1 are required")

    def sample_count(self, count: int) -> int:
        return count * len(self.subtasks)

    def samples(self, tokenizer, context_length: int, count: int, seed: int) -> list[Sample]:
        out = []
        for subtask in self.subtasks:
            build = getattr(self, f"_{subtask.split('_')[0]}")
            for index in range(count):
                def make(size: int, build=build, subtask=subtask, index=index) -> Sample:
                    # the same rng for every size, so the fitted sample is the one the seed names
                    rng = random.Random(f"{seed}:{subtask}:{index}")
                    return build(subtask, rng, tokenizer, size, context_length)
                sample = _fit(tokenizer, make, context_length, subtask)
                sample.id = f"ruler-{subtask}-{context_length}-s{index}"
                sample.max_new_tokens = self.max_new_tokens or sample.max_new_tokens
                sample.meta["subtask"] = subtask
                out.append(sample)
        return out

    def work(self, context_length: int, max_new_tokens: int | None) -> tuple[int, int]:
        limits = [_MAX_NEW_TOKENS[s.split("_")[0]] for s in self.subtasks]
        return context_length, max_new_tokens or self.max_new_tokens or round(sum(limits) / len(limits))

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        value = string_match_all(prediction, sample.answers)
        return {"score": value, sample.meta["subtask"]: value}

    # -- generators: each builds the sample for a context of `size` units (tokens or list entries) --

    def _niah(self, subtask: str, rng: random.Random, tokenizer, size: int, context_length: int) -> Sample:
        kind = "numbers" if self.values == "numbers" else "uuids"
        keys = _distinct(lambda: word_key(rng), self.needles if subtask in ("niah_multikey", "niah_multiquery") else 1)
        per_key = self.needles if subtask == "niah_multivalue" else 1
        values = {key: _distinct(lambda: self._value(rng), per_key) for key in keys}
        queried = keys if subtask == "niah_multiquery" else keys[:1]
        needles = [_NEEDLE.format(kind=kind, key=key, value=value) for key in keys for value in values[key]]
        rng.shuffle(needles)
        if self.haystack == "needle":  # distractor needles with other keys all the way through
            filler = " ".join(_NEEDLE.format(kind=kind, key=word_key(rng), value=self._value(rng))
                              for _ in range(context_length // 8 + 1))
        else:
            filler = NOISE if self.haystack == "noise" else load_corpus(self.corpus)
        text, ends = haystack_text(tokenizer, filler, size)
        depths = sorted(rng.random() for _ in needles)
        context = _insert(text, ends, needles, depths)
        query = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
        return Sample(
            id="", context=f"{_NIAH.format(kind=kind)}\n{context}",
            question=_NIAH_QUESTION.format(kind=kind, query=query), separator="\n",
            answers=[v for key in queried for v in values[key]], max_new_tokens=_MAX_NEW_TOKENS["niah"],
            answer_prefix=_NIAH_PREFIX.format(kind=kind, query=query), stop=(),
            meta={"depths": [round(d, 3) for d in depths]},
        )

    def _vt(self, subtask: str, rng: random.Random, tokenizer, size: int, context_length: int) -> Sample:
        variables = self.vt_chains * (self.vt_hops + 1)
        names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), variables)
        numbers = _distinct(lambda: str(rng.randint(10000, 99999)), self.vt_chains)
        chains = []
        for c, value in enumerate(numbers):
            chain = names[c * (self.vt_hops + 1) : (c + 1) * (self.vt_hops + 1)]
            hops = [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)]
            chains.append([f"VAR {chain[0]} = {value}.", *hops])
        statements = [s for hop in zip(*chains, strict=True) for s in hop]  # hop by hop across chains, in order
        text, ends = haystack_text(tokenizer, NOISE, size)
        depths = sorted(rng.random() for _ in statements)
        value, answers = numbers[0], names[: self.vt_hops + 1]
        return Sample(
            id="", context=f"{_VT}\n\n{_insert(text, ends, statements, depths)}",
            question=_VT_QUESTION.format(value=value), separator="\n", answers=answers,
            max_new_tokens=_MAX_NEW_TOKENS["vt"], answer_prefix=_VT_PREFIX.format(count=len(answers), value=value),
            stop=(), meta={"depths": [round(d, 3) for d in depths]},
        )

    def _cwe(self, subtask: str, rng: random.Random, tokenizer, size: int, context_length: int) -> Sample:
        """`size` entries of rare words (each 3 times, the last maybe less) plus the common words, 30 times
        each as in RULER from ~6k tokens on and fewer (at least 4) in shorter contexts."""
        vocabulary = english_words() + pseudo_words()
        # real words (~2k) while they suffice; made-up ones join only for contexts that need more (~6k+ tokens)
        pool = max(len(english_words()), self.cwe_words + context_length // 3)
        picks = rng.sample(range(pool), self.cwe_words + -(-size // 3))
        common = [vocabulary[i] for i in picks[: self.cwe_words]]
        rare = [vocabulary[i] for i in picks[self.cwe_words :]]
        common_freq = max(4, min(30, context_length // 200))
        words = common * common_freq + (rare * 3)[:size]
        # order by a key drawn per entry, so one more entry moves no other: length grows with size
        keys = [rng.random() for _ in words]
        words = [word for _, word in sorted(zip(keys, words, strict=True))]
        listing = " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
        return Sample(
            id="", context=f"{_CWE}\n{listing}", question=_CWE_QUESTION.format(count=self.cwe_words),
            separator="\n", answers=common, max_new_tokens=_MAX_NEW_TOKENS["cwe"],
            answer_prefix=_CWE_PREFIX.format(count=self.cwe_words), stop=(),
        )

    def _fwe(self, subtask: str, rng: random.Random, tokenizer, size: int, context_length: int) -> Sample:
        """`size` coded words whose counts follow Zipf's law (count of rank r ~ 1 / r^alpha); the most
        frequent "word" is the dots, so the answer is ranks 2-4. Counts are the law's, not draws from it,
        so the top three never tie."""
        vocabulary = rng.sample(pseudo_words(), 64)
        weights = [1 / rank**self.fwe_alpha for rank in range(1, len(vocabulary) + 1)]
        counts = [max(1, round(size * w / sum(weights))) for w in weights]
        coded = ["...."] + vocabulary[1:]
        words = [word for word, count in zip(coded, counts, strict=True) for _ in range(count)]
        rng.shuffle(words)
        return Sample(
            id="", context=f"{_FWE} {' '.join(words)}", question=_FWE_QUESTION, separator="\n",
            answers=coded[1:4], max_new_tokens=_MAX_NEW_TOKENS["fwe"], answer_prefix=_FWE_PREFIX, stop=(),
        )

    def _value(self, rng: random.Random) -> str:
        if self.values == "numbers":
            return str(rng.randint(1_000_000, 9_999_999))
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _fit(tokenizer, make: Callable[[int], Sample], context_length: int, subtask: str) -> Sample:
    """The sample of the largest size whose whole prompt fits `context_length` tokens. Prompt length grows
    about linearly with size: a secant guess, bisection around it, then a few sizes up (a shuffle can make
    one size longer than the next)."""
    def length(size: int) -> int:
        context_ids, question_ids = encode_prompt(tokenizer, make(size))
        return len(context_ids) + len(question_ids)

    base = length(1)
    if base > context_length:
        raise KvbenchError(f"task 'ruler' subtask '{subtask}': context length {context_length} is too short "
                           f"(the prompt alone takes {base} tokens)")
    probe = max(2, context_length // 4)
    rate = max(1e-3, (length(probe) - base) / (probe - 1))
    guess = max(1, 1 + int((context_length - base) / rate))
    guess = max(1, guess + int((context_length - length(guess)) / rate))
    window = max(4, guess // 100)
    low, high = max(1, guess - window), guess + window
    if length(low) > context_length:
        low = 1
    if length(high) <= context_length:
        high = 2 * context_length
    while low < high:
        middle = (low + high + 1) // 2
        if length(middle) <= context_length:
            low = middle
        else:
            high = middle - 1
    best = max((size for size in range(low, low + 4) if length(size) <= context_length), default=low)
    return make(best)


def _insert(text: str, ends: list[int], inserts: list[str], depths: list[float]) -> str:
    """`inserts` placed, in order, at the sentence boundaries nearest `depths` (fractions of the tokens)."""
    cuts = [sentence_boundary(text, ends, depth) for depth in depths]
    pieces, last = [], 0
    for cut, insert in zip(cuts, inserts, strict=True):
        pieces += [text[last:cut].strip(), insert]
        last = cut
    pieces.append(text[last:].strip())
    return re.sub(r" +", " ", " ".join(p for p in pieces if p))


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        value = draw()
        if value not in out:
            out.append(value)
    return out
