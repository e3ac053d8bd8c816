"""Tensors that reached a worker ahead of the call that uses them, keyed by request.

Stages hand tensors over with a separate `receive` call, so the ingress can order the
transfers into each worker (concurrent gloo receives on one actor corrupt each other in
Ray 2.60) without holding up the work itself. Entries nobody claims expire.
"""
from __future__ import annotations

import time
from typing import Any

INBOX_TTL_S = 120.0  # longer than any request may take; then its sender is gone


class TensorInbox:
    def __init__(self, ttl_s: float = INBOX_TTL_S):
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, Any]] = {}

    def put(self, key: str, value: Any) -> None:
        self.expire()
        self._items[key] = (time.monotonic(), value)

    def take(self, key: str) -> Any:
        try:
            return self._items.pop(key)[1]
        except KeyError:
            raise KeyError(f"no tensors arrived for request {key}") from None

    def discard(self, key: str) -> bool:
        return self._items.pop(key, None) is not None

    def discard_prefix(self, prefix: str) -> None:
        for key in [k for k in self._items if k.startswith(prefix)]:
            del self._items[key]

    def expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, (t, _) in self._items.items() if t < cutoff]:
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)
