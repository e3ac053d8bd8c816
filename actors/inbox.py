"""Tensors that reached a worker ahead of the call that uses them, keyed by (request, slot).

Stages hand tensors over with a separate `receive` call, so the ingress can order the
transfers into each worker (concurrent gloo receives on one actor corrupt each other in
Ray 2.60) without holding up the work itself.

A request that ended early is `close`d: what it holds is freed at once, and whatever
still arrives for it afterwards (a transfer already on its way, a prefill that finishes
after the client left) is dropped on arrival instead of waiting for a claim that never
comes. Entries nobody claims still expire, as a last resort.

Request ids start with their ingress replica's owner tag: when a replica dies, the fleet
controller closes its whole tag here (`close_owner`), freeing what its requests held.
"""

from __future__ import annotations

import time
from typing import Any

INBOX_TTL_S = 120.0  # longer than any request may take; then its sender is gone


class TensorInbox:
    def __init__(self, ttl_s: float = INBOX_TTL_S):
        self.ttl_s = ttl_s
        self._items: dict[tuple[str, int], tuple[float, Any]] = {}
        self._closed: dict[str, float] = {}  # request id -> when it was closed
        self._closed_owners: dict[
            str, float
        ] = {}  # request-id prefix of a dead replica -> when closed

    def put(self, request_id: str, value: Any, slot: int = 0) -> bool:
        """Keep `value` until taken; False (and nothing kept) if the request was closed."""
        self.expire()
        if self.is_closed(request_id):
            return False
        self._items[(request_id, slot)] = (time.monotonic(), value)
        return True

    def is_closed(self, request_id: str) -> bool:
        """The request ended early (or its ingress replica died): refuse what comes for it."""
        return request_id in self._closed or any(
            request_id.startswith(owner) for owner in self._closed_owners
        )

    def take(self, request_id: str, slot: int = 0) -> Any:
        try:
            return self._items.pop((request_id, slot))[1]
        except KeyError:
            raise KeyError(f"no tensors arrived for request {request_id} slot {slot}") from None

    def take_all(self, request_id: str) -> dict[int, Any]:
        """Whatever arrived for the request so far, by slot (possibly nothing)."""
        return {
            slot: self._items.pop((rid, slot))[1]
            for rid, slot in [k for k in self._items if k[0] == request_id]
        }

    def close(self, request_id: str) -> int:
        """Free everything held for `request_id` and refuse what arrives later; returns how
        many entries were freed."""
        keys = [key for key in self._items if key[0] == request_id]
        for key in keys:
            del self._items[key]
        self._closed[request_id] = time.monotonic()
        return len(keys)

    def close_owner(self, prefix: str) -> int:
        """close() every request whose id starts with `prefix`, including those yet to come."""
        keys = [key for key in self._items if key[0].startswith(prefix)]
        for key in keys:
            del self._items[key]
        self._closed_owners[prefix] = time.monotonic()
        return len(keys)

    def expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, (t, _) in self._items.items() if t < cutoff]:
            del self._items[key]
        for closed in (self._closed, self._closed_owners):
            for request_id in [r for r, t in closed.items() if t < cutoff]:
                del closed[request_id]

    def __len__(self) -> int:
        return len(self._items)
