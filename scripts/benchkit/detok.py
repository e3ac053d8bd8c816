"""What the ingress's detokenization (cluster/detokenize.py) costs per token: random but
decodable token ids streamed through IncrementalText one at a time, as a decode stream
arrives, at a short and a long output length. Since issue #24 a push decodes a small window,
so the two should be about equal; re-decoding all ids made the long one grow with length.

    detok_table(tokenizer)  # {10: us per token, 1000: us per token}
"""

from __future__ import annotations

import random
import statistics
import time

from cluster.detokenize import IncrementalText

LENGTHS = (10, 1000)


def decodable_ids(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """`num_tokens` ids a model could emit: random ordinary ids, decoded and encoded again,
    so that characters split across ids (byte-level, byte-fallback) come out whole."""
    rnd = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    ids: list[int] = []
    while len(ids) < num_tokens:
        text = tokenizer.decode([rnd.choice(pool) for _ in range(num_tokens)])
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:num_tokens]


def cost_per_token_us(
    tokenizer,
    num_tokens: int,
    repeats: int = 3,
    *,
    stop: tuple[str, ...] = (),
    detok_cls=IncrementalText,
) -> float:
    """Median over `repeats` streams of the microseconds per token to push `num_tokens` ids
    one at a time (and a final push). `detok_cls`: another implementation, to compare."""
    ids = decodable_ids(tokenizer, num_tokens)
    detok_cls(tokenizer, stop).push(ids[:1])  # warm-up
    per_token = []
    for _ in range(repeats):
        detok = detok_cls(tokenizer, stop)
        started = time.perf_counter()
        for i in ids:
            detok.push((i,))
        detok.push((), final=True)
        per_token.append((time.perf_counter() - started) / num_tokens * 1e6)
    return statistics.median(per_token)


def detok_table(tokenizer, **kwargs) -> dict[int, float]:
    """{output length: microseconds per token} at 10 and 1,000 tokens; short streams repeat
    more often, for a steadier median. `kwargs`: cost_per_token_us's stop and detok_cls."""
    return {n: cost_per_token_us(tokenizer, n, max(3, 3000 // n), **kwargs) for n in LENGTHS}
