"""The ingress's admission work (parse, validate, decode media, plan the prompt) in two
lanes with threads and bounds of their own: a text-only request never waits for a thread
that media decoding holds, and a lane that is full refuses at arrival (429, in
microseconds) instead of growing a queue whose refusals would come as late as answers.
A short text body that arrives alone is admitted on the event loop itself: its work (about a
millisecond) is less than the two thread hops a lane costs (0.1-2 ms each on a loaded host,
longer while the loop streams tokens and holds the GIL). One that turns out not to be brief once
parsed (a grammar to compile, media whose type names were escaped) is handed on to its lane
half done (`Deferred`).
A thread cannot be stopped, so a request that goes away (its client left) sets an event the
admission work can read (`request_ended`) to stop waiting early. Plain asyncio and threads,
no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cluster.backpressure import Overloaded

# A body holding any of these is routed to the media lane. A cheap scan of the raw bytes: one
# that escapes its type names only lands in the text lane, where it is admitted all the same.
MEDIA_PART_TYPES = (b'"image_url"', b'"input_audio"', b'"audio_url"', b'"video_url"')
TEXT_THREADS = 4  # parsing and tokenizing text takes milliseconds
MEDIA_THREADS = 32  # most wait for a decode slot (limits.max_concurrent_decodes)
INLINE_TEXT_BYTES = 16 * 1024  # a text body up to this is admitted on the loop (bounded work)

T = TypeVar("T")
_ended: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "admit_ended", default=None
)
_on_loop: contextvars.ContextVar[bool] = contextvars.ContextVar("admit_on_loop", default=False)


def request_ended() -> threading.Event | None:
    """In a lane's thread: set once the request it admits has gone (None outside a lane)."""
    return _ended.get()


def admitting_on_loop() -> bool:
    """Whether this admission runs on the event loop: it must not block, and raises Deferred
    for work that might."""
    return _on_loop.get()


class Deferred(Exception):
    """Admission work on the loop that is not brief after all: `resume()` finishes it in the
    lane, from where it stopped (nothing done twice)."""

    def __init__(self, resume: Callable[[], object]):
        super().__init__("deferred to an admission lane")
        self.resume = resume


class Lane(str, enum.Enum):
    TEXT = "text"
    MEDIA = "media"


def lane_of(body) -> Lane:
    """`body`: bytes, or anything `in` looks into as bytes (request_body.HeldBody)."""
    return Lane.MEDIA if any(marker in body for marker in MEDIA_PART_TYPES) else Lane.TEXT


class AdmitLanes:
    def __init__(self, max_text: int, max_media: int, num_unreached: Callable[[], int] = int):
        """`num_unreached`: requests let through at the HTTP server that this loop has not
        reached yet (cluster/arrival_gate.py), the rest of a burst; `int` gives 0: no gate."""
        self.num_unreached = num_unreached
        self.limits = {Lane.TEXT: max_text, Lane.MEDIA: max_media}
        self.pending = {Lane.TEXT: 0, Lane.MEDIA: 0}
        self.num_arriving = 0  # requests between arrival and admission, lanes not yet known
        self._pools = {
            Lane.TEXT: ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="admit-text"),
            Lane.MEDIA: ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="admit-media"),
        }

    @property
    def busy(self) -> bool:
        """Whether a request is being read or admitted."""
        return self.num_arriving > 0 or any(self.pending.values())

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False)

    @contextlib.contextmanager
    def arriving(self):
        """Hold a place while a request's body is read and admitted; Overloaded at once when
        both lanes' worth of requests are already in: a burst is refused before its bodies
        are pulled through the proxy (which takes seconds under load)."""
        self.check_arriving()
        self.num_arriving += 1
        try:
            yield
        finally:
            self.num_arriving -= 1

    def check_arriving(self, num_unreached: int = 0) -> None:
        """Overloaded if both lanes' worth of requests are in, counting `num_unreached` more
        that arrived (let through at the HTTP server's gate) and are on their way here."""
        limit = sum(self.limits.values())
        if (num := self.num_arriving + num_unreached) >= limit:
            raise Overloaded(
                f"the ingress is admitting {num} requests (the limit is "
                f"limits.max_admitting_text + limits.max_admitting_media = {limit}); retry later"
            )

    def _inline(self, lane: Lane, body) -> bool:
        """A short text body that arrived alone: a burst's admissions go to the lane, where
        they overlap the loop's hand-overs (a burst's first tokens came 8-20% later inline).
        Media stay on their lane: a small image decoded on the loop gained nothing, idle or
        beside decode (docs/BENCHMARKS.md, 2026-12-03)."""
        alone = self.num_arriving + self.num_unreached() <= 1
        return lane is Lane.TEXT and len(body) <= INLINE_TEXT_BYTES and alone

    async def run(self, body, admit: Callable[..., T], *args) -> T:
        """`admit(body, *args)` on the body's lane (a short text body that came alone on the
        loop itself, unless it defers); Overloaded at once if that lane is full."""
        lane = lane_of(body)
        if self.pending[lane] >= self.limits[lane]:
            raise Overloaded(
                f"the ingress is admitting {self.pending[lane]} {lane.value} requests (the limit "
                f"is limits.max_admitting_{lane.value} = {self.limits[lane]}); retry later"
            )
        ended, context = threading.Event(), contextvars.copy_context()
        context.run(_ended.set, ended)
        work = functools.partial(admit, body, *args)
        if self._inline(lane, body):
            try:
                return context.run(_on_loop_run, work)
            except Deferred as deferred:
                work = deferred.resume
        self.pending[lane] += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pools[lane], context.run, work)
        except asyncio.CancelledError:
            ended.set()  # the thread goes on: what it waits for, it may stop waiting for
            raise
        finally:
            self.pending[lane] -= 1


def _on_loop_run(work: Callable[[], T]) -> T:
    """`work()` marked as on the loop (in a context of its own, copied for its lane)."""
    token = _on_loop.set(True)
    try:
        return work()
    finally:
        _on_loop.reset(token)
