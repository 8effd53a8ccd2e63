"""A deterministic corpus of realistic sentences, 8-40 words, for benchmarks and load tests."""

from __future__ import annotations

import random

_WORDS = (
    "the a service model request batch token latency network cluster replica encoder attention layer "
    "query key value vector embedding search document customer order payment invoice report weather "
    "city river mountain music film book garden coffee morning evening quickly slowly carefully often "
    "never always because although while after before during between among through across under over "
    "runs reads writes builds finds sends returns improves measures compares explains describes shows "
    "large small fast slow new old simple complex reliable secure modern useful important different "
    "people teams engineers users developers operators students doctors drivers artists scientists"
).split()


def sentences(n: int, min_words: int = 8, max_words: int = 40, seed: int = 0) -> list[str]:
    """n sentences of min..max words, the same for a given seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        out.append(" ".join(words).capitalize() + ".")
    return out
