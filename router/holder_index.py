"""Which workers hold which keys (encoder cache items by identifier, prefix blocks by hash):
a bitmask of worker indices per key, so "which encoders hold this image" or "how far does each
prefill worker match this prompt" costs a few dict lookups."""

from __future__ import annotations

import math
from collections.abc import Iterator


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class HolderIndex:
    """key -> bitmask of the workers holding it: published sets (trusted while fresh) plus the
    router's own recent dispatches (kept ttl/2..ttl in two generations: O(1) per key, no per-key
    expiry)."""

    def __init__(self, num_workers: int, ttl_s: float):
        self.ttl_s = ttl_s
        self._published: list[frozenset[str]] = [frozenset()] * num_workers
        self._published_at: list[float | None] = [None] * num_workers
        self._mask: dict[str, int] = {}
        self._fresh = 0  # workers whose published set is not older than ttl_s
        self._fresh_until = math.inf
        self._recent: dict[str, int] = {}  # the optimistic part, newer generation
        self._older: dict[str, int] = {}
        self._rotate_at = -math.inf
        self.due = (
            -math.inf
        )  # refresh() has nothing to do before this time (min of the two deadlines)
        self.version = 0  # bumped on every change, so callers may memoise lookups

    def publish(self, worker: int, keys: frozenset[str], now_s: float) -> None:
        bit, old = 1 << worker, self._published[worker]
        if keys is not old:  # workers often re-send the very same snapshot
            self._replace(bit, old, keys)
        self._published[worker], self._published_at[worker] = keys, now_s
        self.version += 1
        self._fresh |= bit
        self._fresh_until = min(self._fresh_until, now_s + self.ttl_s)
        self.due = min(self._rotate_at, self._fresh_until)

    def _replace(self, bit: int, old: frozenset[str], keys: frozenset[str]) -> None:
        for key in old - keys:
            left = self._mask[key] & ~bit
            if left:
                self._mask[key] = left
            else:
                del self._mask[key]
        for key in keys - old:
            self._mask[key] = self._mask.get(key, 0) | bit

    def add(self, worker: int, keys: tuple[str, ...]) -> None:
        """The router just sent these keys to `worker`: assume it holds them for a while."""
        if not keys:
            return
        bit, recent = 1 << worker, self._recent
        self.version += 1
        if len(keys) == 1:  # the usual case for media (one item), without the sets below
            key = keys[0]
            recent[key] = recent.get(key, 0) | bit
            return
        held = {
            key: recent[key] | bit for key in recent.keys() & keys
        }  # usually none: found at C speed
        recent.update(dict.fromkeys(keys, bit))
        recent.update(held)

    def refresh(self, now_s: float) -> None:
        if now_s < self.due:
            return
        if now_s >= self._rotate_at:  # age the optimistic entries by one generation
            long_gap = now_s >= self._rotate_at + self.ttl_s / 2
            self._older, self._recent = ({} if long_gap else self._recent), {}
            self._rotate_at = now_s + self.ttl_s / 2
            self.version += 1
        if now_s > self._fresh_until:  # a published set went stale
            limit, self._fresh, self._fresh_until = now_s - self.ttl_s, 0, math.inf
            self.version += 1
            for i, at in enumerate(self._published_at):
                if at is not None and at >= limit:
                    self._fresh |= 1 << i
                    self._fresh_until = min(self._fresh_until, at + self.ttl_s)
        self.due = min(self._rotate_at, self._fresh_until)

    def holders(self, key: str) -> int:
        return (
            (self._mask.get(key, 0) & self._fresh)
            | self._recent.get(key, 0)
            | self._older.get(key, 0)
        )

    def longest_runs(self, keys: tuple[str, ...], among: int) -> dict[int, int]:
        """For each worker in `among` holding keys[0]: how many leading keys it holds."""
        out: dict[int, int] = {}
        alive, pub, fresh, recent, older = among, self._mask, self._fresh, self._recent, self._older
        for k, key in enumerate(keys):
            held = (
                alive & pub.get(key, 0) & fresh
            )  # the small published index first: usually enough
            if held != alive:
                held |= alive & (recent.get(key, 0) | older.get(key, 0))
                if held != alive:
                    if k:
                        for i in bits(alive ^ held):
                            out[i] = k
                    alive = held
                    if not alive:
                        return out
        for i in bits(alive):
            out[i] = len(keys)
        return out

    def check_integrity(self) -> None:
        """The mask index is exactly the union of the published sets; freshness is what it says."""
        rebuilt: dict[str, int] = {}
        for worker, keys in enumerate(self._published):
            for key in keys:
                rebuilt[key] = rebuilt.get(key, 0) | 1 << worker
        assert rebuilt == self._mask, "the mask index differs from the published sets"
        assert all(self._published_at[w] is not None for w in bits(self._fresh)), (
            "a worker that never published is fresh"
        )
