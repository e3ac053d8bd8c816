"""The ingress's budget for large request bodies being read and admitted.

Why: every request past the gate had its whole body read, then parsed (its media payloads
copied out of it as text), before the decoded-media budget (cluster/media/inflight.py) could
refuse it. Forty uploads of four 16 MP JPEGs (9 MB bodies) held about 18 MB each in the
ingress at once, though the media budget could take five of them and queue sixteen; the
rest got their 429s after the upload and the parse. Now a body of at least
`COUNTED_MIN_BYTES` is charged from its Content-Length when it arrives, and one that does not
fit gets its 429 there, before it is read. The charge comes back when the request's
admission ends (its body is freed then; its media are decoded or refused). Smaller bodies,
every text prompt a model takes, are never charged: text never waits for this budget.
Plain Python, no Ray.
"""

from __future__ import annotations

import threading

from cluster.backpressure import Overloaded

MB = 2**20
COUNTED_MIN_BYTES = MB  # a body this large carries media (a 250k-token text prompt is 1 MB)


class BodyBudget:
    """At most `max_bytes` of counted bodies between arrival and the end of admission;
    thread-safe (charged on the HTTP server's loop, given back on the handler's)."""

    def __init__(self, max_bytes: int, max_request_bytes: int):
        self.max_bytes, self.max_request_bytes = max_bytes, max_request_bytes
        self.in_flight = 0  # bytes charged now (/health)
        self._lock = threading.Lock()

    def take(self, content_length: int | None) -> BodyCharge:
        """Charge a body of `content_length` bytes (None: unknown, nothing charged), or
        Overloaded if it does not fit. A body over max_request_bytes is charged only that
        much: its handler refuses it (413) after reading that far."""
        nbytes = min(content_length or 0, self.max_request_bytes)
        if nbytes < COUNTED_MIN_BYTES:
            return BodyCharge(self, 0)
        with self._lock:
            if self.in_flight + nbytes > self.max_bytes:
                raise Overloaded(
                    f"the ingress is reading and admitting {self.in_flight / MB:.1f} MB of "
                    f"request bodies; this one's {nbytes / MB:.1f} MB would pass "
                    f"limits.max_request_bodies_mb = {self.max_bytes / MB:g}; retry later"
                )
            self.in_flight += nbytes
        return BodyCharge(self, nbytes)


class BodyCharge:
    """One request's charge; `release` gives it back once, whoever calls it first."""

    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: BodyBudget, nbytes: int):
        self.budget, self.nbytes = budget, nbytes

    def release(self) -> None:
        with self.budget._lock:  # the gate's loop and the handler's thread may both call it
            self.budget.in_flight -= self.nbytes
            self.nbytes = 0


def content_length(headers) -> int | None:
    """The Content-Length of raw ASGI headers (a list of byte pairs) or a Starlette Headers;
    None when absent or not a number."""
    if isinstance(headers, list):
        value = next((v for k, v in headers if k.lower() == b"content-length"), None)
    else:
        value = headers.get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
