"""cluster/stream_relay.py behind cluster/arrival_gate.py: a streaming handler's events,
pumped on epd's thread, reach the client through the gate on the HTTP server's loop, in order,
under a start without the marker; a client that leaves cancels the pump; nothing stays held.
Two event loops on two threads stand for Serve's two, as in a replica."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest
from starlette.responses import StreamingResponse

from cluster import arrival_gate
from cluster.admit_lanes import AdmitLanes
from cluster.backpressure import Admission
from cluster.stream_relay import MARKER, RELAY, follow, marked_key, opened, unmarked


async def relayed(key: str, send, receive) -> None:
    """What the gate does for a marked answer: open the outlet, then follow it to the end."""
    await follow(key, await opened(key, send), receive)


def open_streams() -> tuple[int, int]:
    stats = RELAY.stats()
    return stats["relay_pumps"], stats["relay_outlets"]


class UserThread:
    """epd's thread: its own loop, as Serve runs user code."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def user():
    lanes = AdmitLanes(max_text=2, max_media=1)
    arrival_gate.register(
        arrival_gate.GateView(Admission(100, 4), lanes, None, 3, max_request_bytes=1 << 20)
    )
    thread = UserThread()
    yield thread
    thread.stop()
    arrival_gate.register(None)
    lanes.close()


class RelayedApp:
    """A handler that answers with a relayed stream of `events`, run on epd's thread as Serve
    runs it: its messages reach the gate's loop one by one."""

    def __init__(self, user: UserThread, events: list[bytes], pause_s: float = 0.0):
        self.user, self.events, self.pause_s = user, events, pause_s
        self.ended = threading.Event()
        self.cancelled = False

    async def _events(self):
        try:
            for event in self.events:
                await asyncio.sleep(self.pause_s)
                yield event
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def _handle(self, key: str, send_back):
        events = RELAY.pump(key, self._events(), self.ended.set)
        response = StreamingResponse(
            events, media_type="text/event-stream", headers={MARKER.decode(): key}
        )

        async def receive():
            await asyncio.Event().wait()  # Serve's own disconnect listening: never here

        await response({"type": "http"}, receive, send_back)

    async def __call__(self, scope, receive, send):
        loop = asyncio.get_running_loop()

        async def send_back(message):  # to the gate's loop, as Serve hands messages over
            asyncio.run_coroutine_threadsafe(send(message), loop).result()

        key = f"req-{id(self)}"
        await asyncio.wrap_future(self.user.run(self._handle(key, send_back)))


def request_scope():
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


async def through_gate(app, leave_after: int | None = None) -> list[dict]:
    """The client's view: every message the gate sent. `leave_after`: the client leaves once
    that many body messages came."""
    sent, left = [], asyncio.Event()

    async def receive():
        if not hasattr(receive, "given"):
            receive.given = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        if leave_after is not None and len(bodies) >= leave_after:
            left.set()

    await asyncio.wait_for(arrival_gate.ArrivalGate(app)(request_scope(), receive, send), 10)
    return sent


def test_a_relayed_stream_reaches_the_client_whole_in_order_under_a_plain_start(user):
    events = [f"data: {i}\n\n".encode() for i in range(40)]
    app = RelayedApp(user, events)
    sent = asyncio.run(through_gate(app))
    start, *bodies = sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    names = [name for name, _ in start["headers"]]
    assert MARKER not in names and b"content-length" not in names
    assert b"".join(m["body"] for m in bodies) == b"".join(events)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert app.ended.wait(2)
    assert open_streams() == (0, 0)


def test_events_written_before_the_gate_opens_the_outlet_are_kept():
    async def go():
        sent = []

        async def send(message):
            sent.append(message)

        async def events():
            yield b"a"
            yield b"b"

        done = asyncio.Event()
        body = RELAY.pump("early", events(), done.set)
        await done.wait()  # the whole pipe written: nothing is open to take it yet

        async def never():
            await asyncio.Event().wait()

        relay = asyncio.ensure_future(relayed("early", send, never))
        async for _ in body:
            pass
        await asyncio.wait_for(relay, 2)
        return sent

    sent = asyncio.run(go())
    assert b"".join(m["body"] for m in sent) == b"ab" and sent[-1]["more_body"] is False
    assert open_streams() == (0, 0)


def test_a_client_that_leaves_cancels_the_pump_and_nothing_stays_held(user):
    app = RelayedApp(user, [b"x"] * 1000, pause_s=0.005)
    sent = asyncio.run(through_gate(app, leave_after=3))
    assert app.ended.wait(2), "the pump ended, its on_end ran"
    assert app.cancelled, "the events were cancelled, not run to the end"
    assert len(sent) < 100
    assert open_streams() == (0, 0)


def test_a_write_that_fails_cancels_the_pump_though_no_disconnect_came():
    async def go():
        cancelled = []

        async def events():
            try:
                while True:
                    await asyncio.sleep(0.002)
                    yield b"x"
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        async def send(message):
            raise OSError("connection reset")

        async def never():
            await asyncio.Event().wait()

        done = asyncio.Event()
        body = RELAY.pump("broken", events(), done.set)
        relay = asyncio.ensure_future(relayed("broken", send, never))
        await asyncio.wait_for(relay, 2)
        await asyncio.wait_for(done.wait(), 2)  # the pump ended, not run on for nobody
        await body.aclose()
        return cancelled

    assert asyncio.run(go()) == [True]
    assert open_streams() == (0, 0)


def test_an_ordinary_response_passes_the_gate_untouched(user):
    async def plain(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"1")]})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = asyncio.run(through_gate(plain))
    assert sent == [
        {"type": "http.response.start", "status": 200, "headers": [(b"a", b"1")]},
        {"type": "http.response.body", "body": b"{}"},
    ]


def test_the_marker_is_read_and_stripped():
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(MARKER, b"k1"), (b"content-length", b"0"), (b"content-type", b"x")],
    }
    assert marked_key(start) == "k1" and marked_key({"headers": []}) is None
    assert unmarked(start)["headers"] == [(b"content-type", b"x")]
