"""The encoder cache: embeddings by media identifier, so a repeated item skips the tower.

Plain Python over opaque values with a byte size each. Every entry is in one state
(`EntryState`): ENCODING while the tower runs for it (a second request for the same item
waits on that run instead of starting another), REFERENCED while a request that asked for
it has not handed it to its prefill worker yet, CACHED once nobody needs it. Only CACHED
entries are evicted, least recently released first, and only lazily: when the bytes held
exceed the budget. Referenced bytes may exceed the budget on their own (they are in flight
and cannot be dropped); then nothing else is kept. An evicted entry is gone (the EVICTED
count says how many went). `check_integrity` states the invariants.

References are held per request id ("holder"). `release(holder)` drops all of a request's
references; a release that overtakes the request's lookups (the ingress gave up first) is
remembered for a while, so those lookups take no reference that nobody would release.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

RELEASED_TTL_S = 120.0  # longer than any request may take: its lookups have arrived by then


class EntryState(str, enum.Enum):
    ENCODING = "encoding"  # the tower runs for it; the value is what waiters await
    REFERENCED = "referenced"  # encoded, wanted by a request in flight: never evicted
    CACHED = "cached"  # nobody needs it now: kept for reuse, evictable


@dataclass
class _Entry:
    value: Any
    num_bytes: int = 0  # known once encoded
    holders: Counter[str] = field(default_factory=Counter)  # request id -> references
    encoding: bool = True

    @property
    def state(self) -> EntryState:
        if self.encoding:
            return EntryState.ENCODING
        return EntryState.REFERENCED if self.holders else EntryState.CACHED


@dataclass(frozen=True)
class CacheStats:
    """Counts and bytes per state, and lookups since start."""

    capacity_bytes: int
    entries: dict[EntryState, int]
    num_bytes: dict[EntryState, int]
    hits: int
    misses: int
    evictions: int

    def as_flat_dict(self, prefix: str = "cache_") -> dict[str, int]:
        """Flat keys for a worker's stats: cache_<state>_entries, cache_<state>_bytes, ..."""
        flat = {f"{prefix}capacity_bytes": self.capacity_bytes}
        for state in EntryState:
            flat[f"{prefix}{state.value}_entries"] = self.entries[state]
            flat[f"{prefix}{state.value}_bytes"] = self.num_bytes[state]
        return flat | {
            f"{prefix}hits": self.hits,
            f"{prefix}misses": self.misses,
            f"{prefix}evictions": self.evictions,
        }


class EncoderCache:
    def __init__(self, capacity_bytes: int, released_ttl_s: float = RELEASED_TTL_S):
        self.capacity_bytes = capacity_bytes
        self.released_ttl_s = released_ttl_s
        self._entries: dict[str, _Entry] = {}
        self._evictable: OrderedDict[str, None] = (
            OrderedDict()
        )  # CACHED entries, least recently released first
        self._held_by: dict[str, Counter[str]] = {}  # holder -> identifiers it references
        self._released: dict[str, float] = {}  # holder -> when released (refuse its late lookups)
        self.used_bytes = 0
        self.hits = self.misses = self.evictions = 0

    # -- lookups ----------------------------------------------------------------------------
    def lookup(self, identifier: str, holder: str) -> tuple[EntryState, Any] | None:
        """The entry's state and value (ENCODING: what to await), with a reference taken for
        `holder`; None on a miss, after which the caller encodes and calls `start`."""
        entry = self._entries.get(identifier)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._ref(identifier, entry, holder)
        return entry.state, entry.value

    def start(self, identifier: str, holder: str, pending: Any) -> None:
        """A new ENCODING entry for a missed item; `pending` is what later lookups get to await."""
        assert identifier not in self._entries, f"{identifier[:12]} is cached already"
        entry = _Entry(pending)
        self._entries[identifier] = entry
        self._ref(identifier, entry, holder)

    def fill(self, identifier: str, value: Any, num_bytes: int) -> None:
        """The tower's output for an ENCODING entry; REFERENCED while a request wants it."""
        entry = self._entries[identifier]
        assert entry.encoding, f"{identifier[:12]} was filled twice"
        entry.value, entry.num_bytes, entry.encoding = value, num_bytes, False
        self.used_bytes += num_bytes
        if not entry.holders:  # every request gave up while it encoded
            self._evictable[identifier] = None
        self._evict_over_budget()

    def fail(self, identifier: str) -> None:
        """The tower failed for an ENCODING entry: forget it and its references."""
        entry = self._entries.pop(identifier)
        assert entry.encoding, f"{identifier[:12]} failed after it was encoded"
        for holder in entry.holders:
            self._unref_all(holder, identifier)

    # -- references -------------------------------------------------------------------------
    def release(self, holder: str) -> int:
        """Drop every reference `holder` has; lookups for it that arrive later take none.
        Returns how many references were dropped."""
        self._expire()
        self._released[holder] = time.monotonic()
        held = self._held_by.pop(holder, Counter())
        for identifier in held:
            entry = self._entries[identifier]
            del entry.holders[holder]
            if not entry.holders and not entry.encoding:
                self._evictable[identifier] = None  # most recently released: evicted last
        self._evict_over_budget()
        return sum(held.values())

    def release_owner(self, prefix: str) -> int:
        """release() every holder whose id starts with `prefix` (a dead ingress replica's)."""
        return sum(
            self.release(holder) for holder in [h for h in self._held_by if h.startswith(prefix)]
        )

    def _ref(self, identifier: str, entry: _Entry, holder: str) -> None:
        if holder in self._released:
            return  # the request is over already: its lookup is served, nothing is pinned
        entry.holders[holder] += 1
        self._held_by.setdefault(holder, Counter())[identifier] += 1
        self._evictable.pop(identifier, None)

    def _unref_all(self, holder: str, identifier: str) -> None:
        held = self._held_by[holder]
        del held[identifier]
        if not held:
            del self._held_by[holder]

    def _evict_over_budget(self) -> None:
        while self.used_bytes > self.capacity_bytes and self._evictable:
            identifier, _ = self._evictable.popitem(last=False)
            self.used_bytes -= self._entries.pop(identifier).num_bytes
            self.evictions += 1

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.released_ttl_s
        for holder in [h for h, t in self._released.items() if t < cutoff]:
            del self._released[holder]

    # -- views ------------------------------------------------------------------------------
    def identifiers(self) -> frozenset[str]:
        """Items a lookup would find encoded (ENCODING ones too: a lookup joins the run)."""
        return frozenset(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> CacheStats:
        entries, num_bytes = dict.fromkeys(EntryState, 0), dict.fromkeys(EntryState, 0)
        for entry in self._entries.values():
            entries[entry.state] += 1
            num_bytes[entry.state] += entry.num_bytes
        return CacheStats(
            self.capacity_bytes, entries, num_bytes, self.hits, self.misses, self.evictions
        )

    def check_integrity(self) -> None:
        """Sizes add up; references match both ways and are positive; exactly the CACHED
        entries are evictable; evictable bytes are kept only within the budget."""
        assert self.used_bytes == sum(e.num_bytes for e in self._entries.values()), (
            "byte count drifted"
        )
        for identifier, entry in self._entries.items():
            assert all(n > 0 for n in entry.holders.values()), "non-positive refcount"
            for holder, n in entry.holders.items():
                assert self._held_by[holder][identifier] == n, "holder index disagrees"
            assert (entry.state is EntryState.CACHED) == (identifier in self._evictable), (
                "evictable != CACHED"
            )
        for holder, held in self._held_by.items():
            assert held and all(
                self._entries[i].holders[holder] == n > 0 for i, n in held.items()
            ), "dangling reference"
        assert not self._evictable or self.used_bytes <= self.capacity_bytes, (
            "evictable entries kept over budget"
        )
