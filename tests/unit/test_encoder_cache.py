"""Encoder cache: entries referenced by requests in flight are never evicted; the rest go
least recently released first under the byte budget; states, counts and invariants."""

from __future__ import annotations

import random

from actors.engine.encoder_cache import EncoderCache, EntryState


def _encoded(cache: EncoderCache, identifier: str, holder: str, num_bytes: int, value=None) -> None:
    """A miss for `holder`, then the tower's output."""
    assert cache.lookup(identifier, holder) is None
    cache.start(identifier, holder, pending=f"run-{identifier}")
    cache.fill(identifier, value if value is not None else identifier.upper(), num_bytes)


def _states(cache: EncoderCache) -> dict[EntryState, int]:
    return cache.stats().entries


def test_states_move_encoding_referenced_cached():
    cache = EncoderCache(capacity_bytes=100)
    assert cache.lookup("a", "r1") is None
    cache.start("a", "r1", pending="run-a")
    assert (
        _states(cache)[EntryState.ENCODING] == 1
        and cache.stats().num_bytes[EntryState.ENCODING] == 0
    )
    assert cache.lookup("a", "r2") == (
        EntryState.ENCODING,
        "run-a",
    )  # joins the run, no second tower pass
    cache.fill("a", "A", 40)
    stats = cache.stats()
    assert (
        stats.entries[EntryState.REFERENCED] == 1 and stats.num_bytes[EntryState.REFERENCED] == 40
    )
    assert (
        cache.release("r1") == 1 and _states(cache)[EntryState.REFERENCED] == 1
    )  # r2 still needs it
    assert cache.release("r2") == 1
    stats = cache.stats()
    assert stats.entries[EntryState.CACHED] == 1 and stats.num_bytes[EntryState.CACHED] == 40
    assert (stats.hits, stats.misses, stats.evictions) == (1, 1, 0)
    assert cache.lookup("a", "r3") == (EntryState.REFERENCED, "A")  # a hit rescues it
    cache.check_integrity()


def test_an_entry_in_use_survives_pressure_that_evicts_everything_else():
    cache = EncoderCache(capacity_bytes=100)
    _encoded(cache, "pinned", "live", 60)
    for i in range(5):  # each released at once: cached, evictable
        _encoded(cache, f"x{i}", f"done{i}", 30)
        cache.release(f"done{i}")
        cache.check_integrity()
    assert "pinned" in cache.identifiers() and cache.used_bytes <= 100
    _encoded(
        cache, "big", "other", 90
    )  # referenced bytes now exceed the budget: nothing else stays
    assert cache.identifiers() == {"pinned", "big"} and cache.used_bytes == 150
    cache.check_integrity()
    assert cache.lookup("pinned", "live") == (EntryState.REFERENCED, "PINNED")
    cache.release("live")
    cache.release("other")
    assert (
        cache.used_bytes <= 100 and "big" in cache.identifiers()
    )  # the most recently released stays
    assert cache.stats().evictions == 6
    cache.check_integrity()


def test_lazy_eviction_least_recently_released_first():
    cache = EncoderCache(capacity_bytes=100)
    for name in ("a", "b", "c"):
        _encoded(cache, name, f"r-{name}", 30)
    for name in ("b", "a", "c"):
        cache.release(f"r-{name}")
    assert len(cache) == 3  # under budget: nothing evicted yet
    _encoded(cache, "d", "r-d", 30)
    assert cache.identifiers() == {"a", "c", "d"}  # b was released first
    cache.check_integrity()


def test_refs_are_released_when_the_request_ends_early():
    cache = EncoderCache(capacity_bytes=100)
    _encoded(cache, "a", "req", 10)
    assert cache.lookup("b", "req") is None
    cache.start("b", "req", pending="run-b")
    assert cache.release("req") == 2  # dropped before its items reached prefill
    assert _states(cache)[EntryState.REFERENCED] == 0
    cache.fill("b", "B", 10)  # its encode finishes after the drop: cached, not pinned
    assert _states(cache) == {
        EntryState.ENCODING: 0,
        EntryState.REFERENCED: 0,
        EntryState.CACHED: 2,
    }
    cache.check_integrity()


def test_a_release_that_overtakes_the_lookup_pins_nothing():
    cache = EncoderCache(capacity_bytes=100)
    _encoded(cache, "a", "first", 10)
    cache.release("first")
    cache.release("late")  # the ingress gave up before its encode call arrived
    assert cache.lookup("a", "late") == (EntryState.CACHED, "A")
    assert cache.lookup("b", "late") is None
    cache.start("b", "late", pending="run-b")
    cache.fill("b", "B", 10)
    assert _states(cache)[EntryState.REFERENCED] == 0 and _states(cache)[EntryState.CACHED] == 2
    cache.check_integrity()


def test_a_failed_encode_forgets_the_entry_and_its_references():
    cache = EncoderCache(capacity_bytes=100)
    assert cache.lookup("a", "r1") is None
    cache.start("a", "r1", pending="run-a")
    cache.lookup("a", "r2")
    cache.fail("a")
    assert len(cache) == 0 and cache.release("r1") == 0 and cache.release("r2") == 0
    cache.check_integrity()


def test_release_owner_frees_a_dead_replicas_requests():
    cache = EncoderCache(capacity_bytes=100)
    _encoded(cache, "a", "replicaA:1/0", 10)
    _encoded(cache, "b", "replicaB:1/0", 10)
    assert cache.release_owner("replicaA:") == 1
    assert cache.stats().entries[EntryState.REFERENCED] == 1  # replica B's request still holds b
    cache.check_integrity()


def test_flat_stats_name_every_state():
    cache = EncoderCache(capacity_bytes=64)
    _encoded(cache, "a", "r", 8)
    flat = cache.stats().as_flat_dict()
    assert flat["cache_referenced_entries"] == 1 and flat["cache_referenced_bytes"] == 8
    assert flat["cache_cached_entries"] == 0 and flat["cache_encoding_entries"] == 0
    assert flat["cache_capacity_bytes"] == 64 and flat["cache_misses"] == 1


def test_invariants_under_random_operations():
    rng = random.Random(0)
    cache = EncoderCache(capacity_bytes=500)
    holders: dict[str, set[str]] = {}  # holder -> identifiers it looked up (model of the refs)
    encoding: set[str] = set()
    for step in range(3000):
        op = rng.random()
        key, holder = f"k{rng.randrange(40)}", f"h{rng.randrange(15)}"
        if op < 0.5:
            if cache.lookup(key, holder) is None:
                cache.start(key, holder, pending=None)
                encoding.add(key)
            holders.setdefault(holder, set()).add(key)
        elif op < 0.75 and encoding:
            done = rng.choice(sorted(encoding))
            encoding.discard(done)
            if rng.random() < 0.1:
                cache.fail(done)
                for held in holders.values():
                    held.discard(done)
            else:
                cache.fill(done, done, rng.randrange(1, 120))
        else:
            cache.release(holder)
            # holder ids are reused here; in the cluster each request's is new
            cache._released.clear()
            holders.pop(holder, None)
        cache.check_integrity()
        pinned = set().union(*holders.values()) if holders else set()
        assert pinned <= cache.identifiers(), f"step {step}: a referenced entry was evicted"
    assert cache.stats().evictions > 0  # the budget was under pressure, not just roomy
