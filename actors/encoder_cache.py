"""The encoder cache: embeddings by media identifier, so a repeated item skips the tower.

Plain Python over opaque values with a byte size each; least recently used entries are
evicted once the byte budget is exceeded. `check_integrity` states the invariants.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, identifier: str) -> Any | None:
        entry = self._entries.get(identifier)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(identifier)
        self.hits += 1
        return entry[0]

    def put(self, identifier: str, value: Any, num_bytes: int) -> None:
        if num_bytes > self.capacity_bytes:
            return  # would evict everything and still not fit
        if identifier in self._entries:
            self.used_bytes -= self._entries.pop(identifier)[1]
        self._entries[identifier] = (value, num_bytes)
        self.used_bytes += num_bytes
        while self.used_bytes > self.capacity_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.used_bytes -= evicted

    def identifiers(self) -> frozenset[str]:
        return frozenset(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(size for _, size in self._entries.values())
        assert 0 <= self.used_bytes <= self.capacity_bytes
