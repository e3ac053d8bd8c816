"""Refusal at arrival, on the HTTP server's own event loop: a generation request that finds
the replica's admission already full gets its 429 there, in OpenAI's shape with Retry-After,
before Serve builds its request and hands it to the thread that runs epd's code. A refusal
then costs the replica about a third of the CPU it did (docs/BENCHMARKS.md), and a burst's
refusals do not queue behind the admitted requests' work in that thread. Everything else
passes through, its response untouched; the handler's own checks stay the authority, and the
gate refuses only what they would refuse at arrival. A request it lets through gets its body
read here and handed on in one message, and the gate's times (receipt, hand-on) for the
handler's clock and `timings.handover_ms`; a streamed answer the handler marks for the relay
is written from here (cluster/stream_relay.py).

Serve's direct-ingress HTTP server takes the gate as its middleware (`RAY_SERVE_HTTP_PROXY_
CALLBACK_IMPORT_PATH`, set in the ingress replicas' runtime env only: cluster/front_door.py);
the replica's live serving registers its `GateView`. Plain asyncio, no Ray, no torch."""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid
from collections.abc import Callable

from starlette.middleware import Middleware

from cluster import stream_relay
from cluster.admit_lanes import AdmitLanes
from cluster.backpressure import Admission, Overloaded
from cluster.body_budget import BodyBudget, BodyCharge, content_length
from cluster.errors import error_response, overloaded
from cluster.request_log import bearer_ok

_PREFIXES = {"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-"}  # of the ids
GENERATION_PATHS = frozenset(_PREFIXES)
_ARRIVAL = "epd.arrival"  # the scope key of a request the gate let through
_IDS = random.Random()


class GateView:
    """What the gate reads of one serving's admission. It is read from the HTTP server's
    thread while the handler's thread changes it: a stale answer only lets a request through
    to the handler's own check."""

    def __init__(
        self,
        admission: Admission,
        lanes: AdmitLanes,
        api_key: str | None,
        retry_after_s: int,
        max_request_bytes: int,
        bodies: BodyBudget | None = None,
    ):
        self.admission, self.lanes = admission, lanes
        self.max_request_bytes = max_request_bytes
        # without a bodies' budget none applies
        self.bodies = bodies or BodyBudget(sys.maxsize, max_request_bytes)
        self.api_key, self.retry_after_s = api_key, retry_after_s
        self.on_refused: Callable[[str, str], None] = lambda request_id, x_request_id: None
        self.num_refused = 0

    def refusal(self, num_unreached: int, authorization: str | None) -> Overloaded | None:
        """Why a request arriving now would be refused at arrival, or None. A request without
        the API key passes, to get its 401 from the app."""
        if self.api_key and not bearer_ok(authorization, self.api_key):
            return None
        try:
            self.admission.check_room(self.lanes.num_arriving + num_unreached)
            self.lanes.check_arriving(num_unreached)
        except Overloaded as exc:
            return exc
        return None

    def charge(self, length: int | None) -> BodyCharge | Overloaded:
        """The body's charge to the bodies' budget, or why it does not fit."""
        try:
            return self.bodies.take(length)
        except Overloaded as exc:
            return exc


class _Arrival:
    """A request the gate let through: when the HTTP server had it, when the gate handed it
    on with its body, whether the handler has it yet, and its body's charge (the handler
    gives it back when admission ends)."""

    __slots__ = ("reached", "received_s", "handed_s", "body")

    def __init__(self, body: BodyCharge):
        self.reached = False
        self.received_s = self.handed_s = time.perf_counter()
        self.body = body


class _Counts:
    """Requests the gate let through that the handler has not reached yet: each count has one
    writer (the gate's loop, or the handler's thread), so no lock is needed."""

    def __init__(self):
        self.passed = self.reached = self.gone = 0

    @property
    def unreached(self) -> int:
        return self.passed - self.reached - self.gone


_view: GateView | None = None
_counts = _Counts()


def num_unreached() -> int:
    """Requests let through that the handler has not reached yet (read from its thread)."""
    return _counts.unreached


def register(view: GateView | None) -> None:
    """The serving the gate asks from now on (None: let everything through)."""
    global _view
    _view = view


def reached(scope: dict) -> _Arrival | None:
    """The handler has the request: it no longer counts as arriving. Its times at the gate,
    or None if the gate did not see it."""
    arrival = scope.get(_ARRIVAL)
    if arrival is not None and not arrival.reached:
        arrival.reached = True
        _counts.reached += 1
    return arrival


class ArrivalGate:
    """Pure ASGI middleware: a response streams through it untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        view = _view
        if (
            view is None
            or scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = content_length(scope["headers"])
        why = view.refusal(_counts.unreached, _text(headers.get(b"authorization")))
        charge = view.charge(length) if why is None else why
        if isinstance(charge, Overloaded):
            await _refuse(view, charge, scope, receive, send)
            return
        arrival = scope[_ARRIVAL] = _Arrival(charge)
        _counts.passed += 1
        try:
            receive, size = await _whole_body(receive, view.max_request_bytes)
            if length is None:  # chunked: its size is known only now
                charge = view.charge(size)
                if isinstance(charge, Overloaded):
                    await _refuse(view, charge, scope, receive, send)
                    return
                arrival.body = charge
            arrival.handed_s = time.perf_counter()
            await _with_relay(self.app, scope, receive, send)
        finally:
            arrival.body.release()  # a no-op if the handler gave it back
            if not arrival.reached:  # it never reached the handler (its client left first)
                arrival.reached = True
                _counts.gone += 1


async def _refuse(view: GateView, why: Overloaded, scope, receive, send) -> None:
    """The 429 of a request refused at arrival, counted and logged by the serving."""
    headers = dict(scope["headers"])
    # the client's x-request-id or a new one, as Serve's own middleware would give it
    x_request_id = _text(headers.get(b"x-request-id")) or str(
        uuid.UUID(int=_IDS.getrandbits(128), version=4)
    )
    view.num_refused += 1
    view.on_refused(f"{_PREFIXES[scope['path']]}{_IDS.getrandbits(128):032x}", x_request_id)
    refused = overloaded(why, view.retry_after_s)
    await error_response(refused, {"x-request-id": x_request_id})(scope, receive, send)


async def _with_relay(app, scope, receive, send) -> None:
    """Run the app; if its answer names a relay pipe, stream that pipe from this loop while
    the app waits for it to end (cluster/stream_relay.py)."""
    relayed: asyncio.Future | None = None
    outlet: stream_relay.Outlet | None = None

    async def unless_marked(message: dict) -> None:
        nonlocal relayed, outlet
        if relayed is None and message["type"] == "http.response.start":
            if (key := stream_relay.marked_key(message)) is not None:
                await send(stream_relay.unmarked(message))
                outlet = await stream_relay.opened(key, send)
                relayed = asyncio.ensure_future(stream_relay.follow(key, outlet, receive))
                return
        if relayed is None:
            await send(message)  # else the marker response's own empty body: the pipe's ends it

    async def unless_written() -> dict:
        # The server reports a disconnect once a response is complete; Serve, still waiting
        # for the marker response to end, took the relay's own last write for a client that
        # left and logged a served stream as 499. A client that left mid-stream still does.
        message = await receive()
        if message["type"] == "http.disconnect" and outlet is not None and outlet.written:
            await asyncio.Event().wait()  # until Serve, the app done, cancels its read
        return message

    try:
        await app(scope, unless_written, unless_marked)
    finally:
        if relayed is not None:
            await relayed


async def _whole_body(receive, limit: int):
    """The body read here, on the HTTP server's loop, and handed on as one message: Serve
    relays each message to epd's thread on its own, and a large upload's 64 kB reads were
    hundreds of hand-overs, which text requests beside it queued behind (docs/BENCHMARKS.md).
    Past `limit` bytes the rest streams on as it comes, for the handler to refuse. Returns
    the new `receive` and the bytes read."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: hand that on
            first = message
            break
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        more = message.get("more_body", False)
        if not more or size > limit:
            first = {"type": "http.request", "body": b"".join(parts), "more_body": more}
            break
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return replay, size


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def middlewares() -> list[Middleware]:
    """Serve's HTTP-server callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(ArrivalGate)]
