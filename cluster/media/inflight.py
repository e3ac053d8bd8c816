"""The ingress's budget for decoded media in flight: bytes of pixels and samples decoded (or being
decoded), from before they decode until the prefill worker has their embeddings.

Why: a 16 MP image is 48 MB of RGB, and bounding only threads let a burst of large images hold
gigabytes in the ingress, and then in the object store pages it wrote (which count in its RSS and
stay resident after the objects go). Each item is charged from its headers before it decodes (the
hook of cluster/media/budget.py's PixelBudget); what admission stored stays charged as
`StoredMedia` until the request's prefill ends, and anything else comes back when admission ends,
however it ends (`Ledger`). An item that does not fit waits in a
short first-come queue, bounded by count and by time, or is refused at once (MediaBusy: a 429);
one that could never fit is a MediaError naming the limit (a 400). Plain threads: admission
threads wait here, never the event loop.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cluster.media.errors import MediaError

if TYPE_CHECKING:
    from actors.types import PixelRef

MB = 2**20
POLL_S = 0.05  # how often a waiter looks whether its request is gone


class MediaBusy(Exception):
    """Decoded media in this ingress is at its budget and the queue for it is full (or was
    waited in too long): retry later (a 429 with Retry-After)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestGone(Exception):
    """The request went away (its client left) while it waited or between its items."""


class InFlightBudget:
    """At most `max_bytes` charged at once, process-wide; thread-safe."""

    def __init__(self, max_bytes: int, max_waiting: int, max_wait_s: float) -> None:
        self.max_bytes, self.max_waiting, self.max_wait_s = max_bytes, max_waiting, max_wait_s
        self.in_flight = 0  # bytes charged now (read by the metrics gauge and /health)
        self._queue: deque[object] = deque()  # waiters' turns, first come first served
        self._cond = threading.Condition()

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def take(
        self,
        nbytes: int,
        *,
        holding: bool = False,
        ended: threading.Event | None = None,
    ) -> None:
        """Charge `nbytes`: at once if they fit and nobody waits before us; else wait for our
        turn when the queue has room. A caller `holding` charges already waits
        only at the head of an empty queue: two holders waiting for each other's room would
        wait out their time, and one alone waits only for requests past admission, which give
        theirs back at their prefill. MediaBusy when refused or after `max_wait_s`;
        RequestGone as soon as `ended` is set while waiting."""
        with self._cond:
            if not self._queue and self._fits(nbytes):
                self.in_flight += nbytes
                return
            if len(self._queue) >= self.max_waiting or (holding and self._queue):
                raise MediaBusy(self._full())
            turn = object()
            self._queue.append(turn)
            try:
                self._wait_turn(turn, nbytes, ended)
            finally:
                self._queue.remove(turn)
                self._cond.notify_all()  # the next in line may fit now
            self.in_flight += nbytes

    def give(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            if nbytes > self.in_flight:
                raise RuntimeError(f"giving back {nbytes} bytes; only {self.in_flight} are held")
            self.in_flight -= nbytes
            self._cond.notify_all()

    def _fits(self, nbytes: int) -> bool:
        return self.in_flight + nbytes <= self.max_bytes

    def _wait_turn(self, turn: object, nbytes: int, ended: threading.Event | None) -> None:
        deadline_s = time.monotonic() + self.max_wait_s
        while not (self._queue[0] is turn and self._fits(nbytes)):
            if ended is not None and ended.is_set():
                raise RequestGone("the request ended while it waited for room to decode media")
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                raise MediaBusy(
                    f"no room to decode this request's media within {self.max_wait_s:g} s "
                    f"(limits.decoded_media_wait_s): {self._describe()}; retry later"
                )
            self._cond.wait(min(left_s, POLL_S))  # polled: `ended` is set without a notify

    def _full(self) -> str:
        return (
            f"{self._describe()}, and {len(self._queue)} of at most {self.max_waiting} "
            "wait for room (limits.max_waiting_for_decoded_media); retry later"
        )

    def _describe(self) -> str:
        return (
            f"the ingress holds {self.in_flight / MB:.1f} MB of decoded media "
            f"(limits.max_decoded_media_mb = {self.max_bytes / MB:g})"
        )


class Ledger:
    """What one request holds of an InFlightBudget. Its `hold` is a PixelBudget's hook; `close`
    (or the end of its with block, whatever ended it) gives everything back."""

    def __init__(self, budget: InFlightBudget, ended: threading.Event | None = None) -> None:
        self.budget, self.ended, self.held = budget, ended, 0
        self.reserved = 0  # of `held`: reserved for items not yet decoded (reserve)

    def reserve(self, nbytes: int, param: str) -> None:
        """Charge what the request's still images declare, before any decodes: a request that
        cannot have it all waits or is refused before it decodes anything. Images draw on it
        (hold); what they leave comes back when the request keeps its media."""
        self.hold(nbytes, param, "this request's media")
        self.reserved += nbytes

    def hold(self, nbytes: int, param: str, noun: str) -> None:
        """Charge one item's decoded bytes, before it decodes."""
        self.check()
        drawn = min(nbytes, self.reserved) if noun == "image" else 0  # what `reserve` covers
        self.reserved -= drawn
        if not (nbytes := nbytes - drawn):
            return
        total = self.held + nbytes
        if total > self.budget.max_bytes:
            others = f" (with the request's other media, {total / MB:.1f} MB)" if self.held else ""
            raise MediaError(
                f"{noun} decodes to {nbytes / MB:.1f} MB{others}, over this server's limit of "
                f"{self.budget.max_bytes / MB:g} MB of decoded media held at once "
                "(limits.max_decoded_media_mb)",
                param,
            )
        # A request that holds some waits only first in line (InFlightBudget.take): else
        # requests that each held some could wait on each other until they all timed out, and
        # refusing it at once would throw away the items it already decoded.
        self.budget.take(nbytes, holding=self.held > 0, ended=self.ended)
        self.held = total

    def release_to(self, mark: int) -> None:
        """Give back what was charged since `held` was `mark` (those items left the ingress)."""
        self.budget.give(self.held - mark)
        self.held = mark
        self.reserved = min(self.reserved, mark)

    def keep(self, refs: list[PixelRef], shares: Iterable[int]) -> StoredMedia:
        """What is charged now, handed over to a StoredMedia holding `refs`: this ledger's
        close no longer gives it back."""
        unused, self.reserved = self.reserved, 0  # declared, never decoded: not kept
        self.release_to(self.held - unused)
        nbytes, self.held = self.held, 0
        return StoredMedia(self.budget, nbytes, refs, shares)

    def check(self) -> None:
        if self.ended is not None and self.ended.is_set():
            raise RequestGone("the request ended during admission")

    def close(self) -> None:
        self.release_to(0)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StoredMedia:
    """An admitted request's media in the object store, charged to the budget until the prefill
    worker has the embeddings: so the budget bounds the store's pages too, not only decoding.
    Each of the request's `shares` (its choices) releases once; the last gives the bytes back and
    drops the references, so the store frees the pixels. A request dropped before it released
    (it never ran) gives them back when it is garbage-collected."""

    def __init__(
        self, budget: InFlightBudget, nbytes: int, refs: list[PixelRef], shares: Iterable[int]
    ) -> None:
        self._refs, self._shares = refs, set(shares)
        self._give_back = weakref.finalize(self, budget.give, nbytes)

    @property
    def released(self) -> bool:
        return not self._give_back.alive

    def release(self, share: int) -> None:
        """Share `share` is done with the pixels (again: nothing happens)."""
        self._shares.discard(share)
        if not self._shares and self._give_back.alive:
            for ref in self._refs:
                ref.drop()
            self._give_back()
