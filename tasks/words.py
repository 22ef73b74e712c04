"""Word lists the tasks draw keys and filler words from, generated here so no download is needed."""

from __future__ import annotations

import functools
import itertools
import random
import re

ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "calm", "clever", "crimson", "curious", "distant", "eager", "faint",
    "fierce", "gentle", "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "misty", "modest",
    "noble", "odd", "pale", "proud", "quiet", "rapid", "rustic", "silent", "silver", "sleepy", "solemn",
    "steady", "swift", "tender", "tidy", "urban", "velvet", "vivid", "wary", "wild", "windy", "wise", "young",
    "zesty",
)
NOUNS = (
    "anchor", "badger", "basket", "beacon", "canyon", "castle", "comet", "compass", "dragon", "falcon",
    "garden", "glacier", "harbor", "helmet", "island", "jigsaw", "kettle", "lantern", "meadow", "mirror",
    "monsoon", "nectar", "orchard", "otter", "parcel", "pepper", "pillow", "quarry", "rabbit", "river",
    "saddle", "shadow", "sparrow", "summit", "teapot", "thistle", "timber", "tunnel", "valley", "violin",
    "walrus", "willow", "window", "zephyr",
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def word_key(rng: random.Random) -> str:
    """An adjective-noun key like RULER's (`quiet-lantern`): 2,024 of them."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


@functools.lru_cache(maxsize=1)
def pseudo_words() -> tuple[str, ...]:
    """~350k pronounceable made-up words (`bakilo`, `tuvem`): more than any context needs, none of them
    likely to be one token or to carry meaning the model could guess from."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = ["".join(parts) for n in (2, 3) for parts in itertools.product(syllables, repeat=n)]
    random.Random(0).shuffle(words)
    return tuple(words)


@functools.lru_cache(maxsize=1)
def english_words() -> tuple[str, ...]:
    """The distinct lower-case words (4-10 letters) of the embedded corpus, in a fixed random order: real
    words, as RULER's word tasks use, most of them one or two tokens."""
    from kvbench.tasks.corpus import load_corpus

    words = sorted({w for w in re.findall(r"\b[a-z]{4,10}\b", load_corpus("embedded"))})
    random.Random(0).shuffle(words)
    return tuple(words)
