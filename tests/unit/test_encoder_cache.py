"""Encoder cache: LRU by identifier within a byte budget; invariants hold after every step."""

from __future__ import annotations

import random

from actors.encoder_cache import EncoderCache


def test_hit_miss_and_lru_eviction():
    cache = EncoderCache(capacity_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("c", "C", 40)  # evicts b, the least recently used
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert (cache.hits, cache.misses) == (3, 1)
    cache.check_integrity()


def test_oversized_value_is_not_cached_and_evicts_nothing():
    cache = EncoderCache(capacity_bytes=10)
    cache.put("a", "A", 5)
    cache.put("huge", "H", 11)
    assert cache.get("huge") is None and cache.get("a") == "A"


def test_reput_replaces_size():
    cache = EncoderCache(capacity_bytes=100)
    cache.put("a", "A", 60)
    cache.put("a", "A2", 10)
    assert cache.used_bytes == 10 and cache.get("a") == "A2"


def test_invariants_under_random_operations():
    rng = random.Random(0)
    cache = EncoderCache(capacity_bytes=500)
    for _ in range(2000):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.6:
            cache.put(key, key, rng.randrange(1, 120))
        else:
            value = cache.get(key)
            assert value in (None, key)
        cache.check_integrity()
    assert cache.identifiers() == frozenset(k for k in (f"k{i}" for i in range(40)) if cache.get(k) is not None)
