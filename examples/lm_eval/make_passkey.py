"""Writes passkey.jsonl: the local lm-eval tasks `passkey` (generate the key), `passkey_choice` (pick it among
four), `passkey_letter` (the same, by letter) and `passkey_digit` (its second digit among ten, one token each)
read it. Each doc hides a five-digit pass key at a depth of ~450 words of kvbench's embedded corpus.

    python examples/lm_eval/make_passkey.py
"""

import json
import random
from pathlib import Path

from kvbench.tasks.corpus import load_corpus

DOCS, WORDS = 8, 450

words = load_corpus("embedded").split()
rng = random.Random(0)
rows = []
for index in range(DOCS):
    start = rng.randrange(len(words) - WORDS)
    haystack, depth = words[start : start + WORDS], (index + 0.5) / DOCS
    key = rng.randrange(10_000, 100_000)
    at = round(depth * WORDS)
    text = " ".join(haystack[:at] + [f"The pass key is {key}. Remember it. {key} is the pass key."] + haystack[at:])
    choices = [str(key)] + [str(rng.randrange(10_000, 100_000)) for _ in range(3)]
    rng.shuffle(choices)
    rows.append({"context": text, "key": str(key), "depth": depth, "choices": choices,
                 "label": choices.index(str(key))})
path = Path(__file__).with_name("passkey.jsonl")
path.write_text("".join(json.dumps(row) + "\n" for row in rows))
print(f"{path}: {len(rows)} docs")
