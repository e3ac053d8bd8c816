"""cluster/arrival_gate.py: a generation request that arrives at a full admission gets its 429
from the HTTP server's gate, in OpenAI's shape with Retry-After, without reaching the app;
everything else reaches the app; requests let through count against the arrival bound until
the handler has them."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cluster import arrival_gate
from cluster.admit_lanes import AdmitLanes
from cluster.backpressure import Admission
from cluster.body_budget import MB, BodyBudget
from cluster.front_door import GATE_CALLBACK, FrontDoor, replica_runtime_env


class App:
    """The app behind the gate: it reaches the handler once `go` is set (at once by default)."""

    def __init__(self, reach: bool = True):
        self.calls, self.reach = 0, reach
        self.go = asyncio.Event()
        self.go.set()

    async def __call__(self, scope, receive, send):
        self.calls += 1
        await self.go.wait()
        if self.reach:
            arrival_gate.reached(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def scope(path="/v1/chat/completions", method="POST", headers=()):
    return {"type": "http", "method": method, "path": path, "headers": list(headers)}


async def call(gate, scope_) -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await gate(scope_, receive, send)
    return sent


@pytest.fixture
def view():
    lanes = AdmitLanes(max_text=2, max_media=1)
    v = arrival_gate.GateView(Admission(100, 4), lanes, None, 3, max_request_bytes=1 << 20)
    refused = v.refused = []
    v.on_refused = lambda request_id, x_request_id: refused.append((request_id, x_request_id))
    arrival_gate.register(v)
    yield v
    arrival_gate.register(None)
    lanes.close()


def fill_generating(view) -> None:
    for _ in range(view.admission.max_generating):
        view.admission.admit(10).first_token()


def test_a_request_at_a_full_budget_gets_an_openai_429_without_reaching_the_app(view):
    fill_generating(view)
    app = App()
    headers = [(b"x-request-id", b"abc-1")]
    sent = asyncio.run(call(arrival_gate.ArrivalGate(app), scope(headers=headers)))
    assert app.calls == 0
    start, body = sent
    assert start["status"] == 429
    head = dict(start["headers"])
    assert head[b"retry-after"] == b"3" and head[b"x-request-id"] == b"abc-1"
    error = json.loads(body["body"])["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded"
    assert "4 requests are generating" in error["message"]
    assert int(head[b"content-length"]) == len(body["body"])
    assert view.num_refused == 1 and view.refused[0][1] == "abc-1"
    assert view.refused[0][0].startswith("chatcmpl-")


def test_a_refusal_without_a_request_id_gets_a_new_one_as_serve_would_give(view):
    fill_generating(view)
    sent = asyncio.run(call(arrival_gate.ArrivalGate(App()), scope("/v1/completions")))
    given = dict(sent[0]["headers"])[b"x-request-id"].decode()
    assert len(given) == 36 and view.refused == [(view.refused[0][0], given)]
    assert view.refused[0][0].startswith("cmpl-")


@pytest.mark.parametrize(
    "path,method",
    [("/v1/models", "GET"), ("/health", "GET"), ("/tokenize", "POST"), ("/metrics", "GET")],
)
def test_other_routes_reach_the_app_even_when_full(view, path, method):
    fill_generating(view)
    app = App()
    sent = asyncio.run(call(arrival_gate.ArrivalGate(app), scope(path, method)))
    assert app.calls == 1 and sent[0]["status"] == 200 and view.num_refused == 0


def test_with_room_the_request_reaches_the_app_and_leaves_no_count(view):
    app = App()
    for path in arrival_gate.GENERATION_PATHS:
        sent = asyncio.run(call(arrival_gate.ArrivalGate(app), scope(path)))
        assert sent[0]["status"] == 200
    assert app.calls == 2 and arrival_gate._counts.unreached == 0


def test_without_the_api_key_a_request_reaches_the_app_for_its_401(view):
    fill_generating(view)
    view.api_key = "sesame"
    app = App()
    gate = arrival_gate.ArrivalGate(app)
    asyncio.run(call(gate, scope(headers=[(b"authorization", b"Bearer wrong")])))
    assert app.calls == 1
    sent = asyncio.run(call(gate, scope(headers=[(b"authorization", b"Bearer sesame")])))
    assert app.calls == 1 and sent[0]["status"] == 429


def test_requests_on_their_way_to_the_handler_count_against_the_arrival_bound(view):
    """The lanes' bound (2 + 1 here) counts requests the gate let through before the handler
    counts them itself: a burst faster than the handler is refused at the gate beyond it."""
    app = App()
    app.go.clear()  # the handler's thread is busy: nothing reaches it yet

    async def burst():
        gate = arrival_gate.ArrivalGate(app)
        held = [asyncio.create_task(call(gate, scope())) for _ in range(3)]
        await asyncio.sleep(0)
        assert arrival_gate._counts.unreached == 3
        refused = await call(gate, scope())
        app.go.set()
        return refused, await asyncio.gather(*held)

    refused, held = asyncio.run(burst())
    assert refused[0]["status"] == 429 and app.calls == 3
    assert "admitting 3 requests" in json.loads(refused[1]["body"])["error"]["message"]
    assert all(sent[0]["status"] == 200 for sent in held)
    assert arrival_gate._counts.unreached == 0


def test_requests_on_their_way_count_against_the_requests_budget(view):
    """With 3 of 4 requests in the cluster, one let through fills the budget before the
    handler has it: the next arrival is refused at the gate, not behind its admission."""
    for _ in range(3):
        view.admission.admit(10)
    app = App()
    app.go.clear()

    async def burst():
        gate = arrival_gate.ArrivalGate(app)
        held = asyncio.create_task(call(gate, scope()))
        await asyncio.sleep(0)
        refused = await call(gate, scope())
        app.go.set()
        return refused, await held

    refused, held = asyncio.run(burst())
    assert refused[0]["status"] == 429 and held[0]["status"] == 200 and app.calls == 1
    message = json.loads(refused[1]["body"])["error"]["message"]
    assert "0 generating, 3 waiting for their first token, 1 being admitted" in message


def test_the_handler_learns_when_the_http_server_had_the_request_and_handed_it_on(view):
    seen = []

    async def app(scope, receive, send):
        seen.append((time.perf_counter(), arrival_gate.reached(scope), arrival_gate.reached(scope)))

    before = time.perf_counter()
    asyncio.run(call(arrival_gate.ArrivalGate(app), scope()))
    ((now, arrival, again),) = seen
    assert before <= arrival.received_s <= arrival.handed_s <= now and again is arrival
    assert arrival_gate._counts.unreached == 0 and arrival_gate.reached({}) is None


def body_app(got: list):
    async def app(scope, receive, send):
        while True:
            message = await receive()
            got.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    return app


def run_with_messages(messages: list[dict], max_request_bytes: int = 1 << 20) -> list[dict]:
    """What the app behind the gate receives of a request whose body came as `messages`."""
    arrival_gate._view.max_request_bytes = max_request_bytes
    queue, got = list(messages), []

    async def receive():
        return queue.pop(0)

    async def send(message):
        pass

    asyncio.run(arrival_gate.ArrivalGate(body_app(got))(scope(), receive, send))
    return got


def piece(body: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_body_in_many_reads_reaches_the_app_as_one_message(view):
    """Serve relays each message to epd's thread on its own: one, not hundreds, per upload."""
    got = run_with_messages([piece(b"ab", True), piece(b"cd", True), piece(b"e", False)])
    assert got == [piece(b"abcde", False)]


def test_a_body_past_the_limit_streams_on_for_the_handler_to_refuse(view):
    got = run_with_messages([piece(b"abc", True), piece(b"def", True), piece(b"g", False)], 2)
    assert got == [piece(b"abc", True), piece(b"def", True), piece(b"g", False)]


def test_a_client_that_leaves_mid_upload_is_handed_on_as_gone(view):
    got = run_with_messages([piece(b"abc", True), {"type": "http.disconnect"}])
    assert got == [{"type": "http.disconnect"}]


def test_a_request_that_never_reaches_the_handler_stops_counting(view):
    app = App(reach=False)  # e.g. its client left while Serve still held it
    asyncio.run(call(arrival_gate.ArrivalGate(app), scope()))
    assert app.calls == 1 and arrival_gate._counts.unreached == 0


def test_nothing_registered_lets_everything_through():
    app = App()
    sent = asyncio.run(call(arrival_gate.ArrivalGate(app), scope()))
    assert app.calls == 1 and sent[0]["status"] == 200


def test_only_replicas_that_serve_http_themselves_get_the_gate():
    env = replica_runtime_env(FrontDoor.HAPROXY)["env_vars"]
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == GATE_CALLBACK
    module, name = GATE_CALLBACK.split(":")
    assert module == arrival_gate.__name__ and name == arrival_gate.middlewares.__name__
    assert (
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
        not in (replica_runtime_env(FrontDoor.SERVE_PROXY)["env_vars"])
    )


def test_a_large_body_past_the_bodies_budget_is_refused_before_it_is_read(view):
    """A body that carries media is charged from its Content-Length as it arrives: with the
    budget held by one still being admitted, the next gets its 429 at once, its body unread;
    a small (text) one beside them is not refused; the handler finds the charge on its
    arrival, and it comes back when the request ends at the latest."""
    view.bodies = BodyBudget(3 * MB, 2 * MB)
    big = [(b"content-length", str(2 * MB).encode())]
    app, handed = App(), []
    app.go.clear()  # the first is still being admitted

    async def handler(scope_, receive, send):
        handed.append(arrival_gate.reached(scope_).body.nbytes)
        await app(scope_, receive, send)

    async def reads(scope_, gate) -> tuple[list[dict], int]:
        num_reads = 0

        async def receive():
            nonlocal num_reads
            num_reads += 1
            return {"type": "http.request", "body": b"", "more_body": False}

        sent = []
        await gate(scope_, receive, lambda m: _append(sent, m))
        return sent, num_reads

    async def run():
        gate = arrival_gate.ArrivalGate(handler)
        first = asyncio.create_task(reads(scope(headers=big), gate))
        await asyncio.sleep(0)
        refused = await reads(scope(headers=big), gate)
        text = asyncio.create_task(reads(scope(headers=[(b"content-length", b"900")]), gate))
        await asyncio.sleep(0)
        app.go.set()
        return refused, await first, await text

    (refused, num_reads), (served, _), (text, _) = asyncio.run(run())
    assert refused[0]["status"] == 429 and num_reads == 0
    assert dict(refused[0]["headers"])[b"retry-after"] == b"3"
    assert "limits.max_request_bodies_mb = 3" in json.loads(refused[1]["body"])["error"]["message"]
    assert served[0]["status"] == 200 and text[0]["status"] == 200 and handed == [2 * MB, 0]
    assert view.bodies.in_flight == 0 and view.num_refused == 1


def test_a_chunked_body_past_the_bodies_budget_is_refused_once_read(view):
    view.bodies = BodyBudget(2 * MB, 2 * MB)
    held = view.bodies.take(2 * MB)
    got = []
    app = body_app(got)
    messages = [piece(b"x" * MB, True), piece(b"x" * MB, False)]

    async def receive():
        return messages.pop(0)

    sent = []
    asyncio.run(arrival_gate.ArrivalGate(app)(scope(), receive, lambda m: _append(sent, m)))
    assert got == [] and sent[0]["status"] == 429
    held.release()
    assert view.bodies.in_flight == 0


async def _append(sent: list, message: dict) -> None:
    sent.append(message)
