"""Streamed answers written to the client by the HTTP server's own loop, one hop a step.

Serve hands each ASGI message of a streaming response from the thread that runs epd's code to
the HTTP server's loop on its own: a wake-up of that loop, Serve's queue and middleware, and
Starlette's, per token per request. At 32 streams that was most of the ingress's CPU a token
(docs/BENCHMARKS.md). Behind the arrival gate (cluster/arrival_gate.py) a streaming handler
instead answers with a marker response and pumps its SSE events into the relay (`pump`);
events from every request gather here, and one call hands them all to the HTTP server's loop,
where each request's `Outlet` writes them with the server's own `send`. The gate strips the
marker, keeps the request open until its pump ends, and cancels the pump if the client leaves.

Plain asyncio and threading, no Ray, no torch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger(__name__)
MARKER = b"x-epd-relay"  # response header naming the pipe of a relayed answer
_DROPPED = frozenset({MARKER, b"content-length"})
_END = None  # a pipe's last item

Send = Callable[[dict], Awaitable[None]]


class Outlet:
    """One relayed response on the HTTP server's loop: writes what its pipe sent, in order."""

    def __init__(self, send: Send):
        self.send = send
        self.queued: list[bytes | None] = []
        self.finished = asyncio.Event()
        self.broken = False  # a write failed: the client is gone
        self.written = False  # the whole answer went out
        self._writing = False  # one writer at a time keeps the order
        self._writer: asyncio.Task | None = None  # held: the loop keeps tasks only weakly

    def take(self, items: list[bytes | None]) -> None:
        self.queued.extend(items)
        if not self._writing:
            self._writing = True
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def write_now(self) -> None:
        """Write what is queued from the caller's own task (no loop turn before it goes)."""
        if self.queued and not self._writing:
            self._writing = True
            await self._write()

    async def _write(self) -> None:
        try:
            while self.queued:
                items, self.queued = self.queued, []
                last = items[-1] is _END
                body = b"".join(item for item in items if item is not _END)
                await self.send({"type": "http.response.body", "body": body, "more_body": not last})
                if last:
                    self.written = True
                    self.finished.set()
                    return
        except OSError:  # the client is gone
            self._break()
        except Exception:  # noqa: BLE001 - whatever it is, the pump must not run on for nobody
            log.exception("a relayed stream could not be written")
            self._break()
        finally:
            self._writing = False

    def _break(self) -> None:
        self.broken = True
        self.finished.set()


class Relay:
    """The replica's relay: pipes written on epd's thread, outlets on the HTTP server's loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[tuple[str, bytes | None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the HTTP server's
        self._outlets: dict[str, Outlet] = {}
        self._early: dict[str, list[bytes | None]] = {}  # written before the outlet opened
        self._pumps: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}
        self._live: set[str] = set()  # pumped and not closed yet: items of others are dropped
        self.num_pumped = 0

    # --- epd's thread
    def pump(self, key: str, events: AsyncIterator[bytes], on_end: Callable[[], None]):
        """Write `events` into pipe `key` from a task of the running loop; `on_end` runs when
        the pump ends, however it ends. Returns the body of the marker response: it ends with
        the pump, and closing it (the client left) cancels the pump. Serve counts the request
        as ongoing until then, as it would a stream of its own."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._pump(key, events, on_end))
        with self._lock:
            self._live.add(key)
            self._pumps[key] = (loop, task)
            self.num_pumped += 1
        return _until_done(task)

    async def _pump(self, key: str, events: AsyncIterator[bytes], on_end) -> None:
        try:
            async for event in events:
                self._put(key, event)
        finally:
            self._put(key, _END)
            with self._lock:
                self._pumps.pop(key, None)
            on_end()

    def _put(self, key: str, item: bytes | None) -> None:
        with self._lock:
            first = not self._pending
            self._pending.append((key, item))
            loop = self._loop
        if first and loop is not None and not loop.is_closed():  # else the next open drains
            loop.call_soon_threadsafe(self._drain)

    # --- the HTTP server's loop
    def open(self, key: str, send: Send) -> Outlet:
        """The outlet of pipe `key`, writing with `send` (the request's own)."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            kick = bool(self._pending)
        outlet = self._outlets[key] = Outlet(send)
        outlet.queued.extend(self._early.pop(key, ()))  # for the opener's write_now
        if kick:
            self._drain()
        return outlet

    def close(self, key: str, client_left: bool) -> None:
        """Forget outlet `key`; if its client left, cancel its pump."""
        self._outlets.pop(key, None)
        self._early.pop(key, None)
        with self._lock:
            self._live.discard(key)
            pump = self._pumps.get(key) if client_left else None
        if pump is not None:
            pump[0].call_soon_threadsafe(pump[1].cancel)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            live = set(self._live)
        batches: dict[str, list[bytes | None]] = {}
        for key, item in pending:
            batches.setdefault(key, []).append(item)
        for key, items in batches.items():
            outlet = self._outlets.get(key)
            if outlet is not None:
                outlet.take(items)
            elif key in live:
                self._early.setdefault(key, []).extend(items)

    def stats(self) -> dict[str, int]:
        """Streams relayed so far; pumps and outlets open (zero when idle, or one leaked)."""
        return {
            "relayed_streams": self.num_pumped,
            "relay_pumps": len(self._pumps),
            "relay_outlets": len(self._outlets),
        }


RELAY = Relay()


async def _until_done(task: asyncio.Task) -> AsyncIterator[bytes]:
    try:
        await asyncio.wait([task])  # its errors are the events' own to report (in-band)
    finally:
        task.cancel()  # a no-op once it is done
    return
    yield  # an async generator: the marker response's (empty) body


def marked_key(message: dict) -> str | None:
    """The pipe a response start names, or None for an ordinary response."""
    for name, value in message.get("headers", ()):
        if name == MARKER:
            return value.decode("latin-1")
    return None


def unmarked(message: dict) -> dict:
    """The response start as the client gets it: no marker, no length (it streams)."""
    headers = [(n, v) for n, v in message.get("headers", ()) if n.lower() not in _DROPPED]
    return {**message, "headers": headers}


async def opened(key: str, send: Send) -> Outlet:
    """Pipe `key`'s outlet, with what the pipe wrote before it opened (the first token,
    usually) written at once, right behind the start."""
    outlet = RELAY.open(key, send)
    await outlet.write_now()
    return outlet


async def follow(key: str, outlet: Outlet, receive) -> None:
    """Until the pipe closes or the client leaves; then the outlet is forgotten."""
    finished = asyncio.ensure_future(outlet.finished.wait())
    left = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((finished, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_left = outlet.broken or (left.done() and not finished.done())
        for waiter in (finished, left):
            waiter.cancel()
        RELAY.close(key, client_left)


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
