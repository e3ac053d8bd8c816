"""Nothing is lost and nothing leaks when requests end early or workers die: a stop on the
first token, a client that leaves mid-stream, and a worker of each kind killed with
requests in flight (they resume on healthy workers and answer as if nothing happened)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import png_data_url, random_image

HELD = {
    "prefill": ("held_kv", "held_embeddings", "queued", "running"),
    "decode": ("rows", "held_kv", "running", "queued", "open_streams"),
    "encoder": ("queued", "running", "cache_encoding_entries", "cache_referenced_entries"),
}


def _messages(seed: int, text: str = "Describe") -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(seed, 40, 40))}}
    return [{"role": "user", "content": [{"type": "text", "text": text}, image]}]


def held(app) -> dict[str, int]:
    """Everything any worker still holds for requests (zero when idle)."""
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    return {
        f"{kind}.{field}": sum(w.get(field, 0) for w in workers[kind])
        for kind, fields in HELD.items()
        for field in fields
    }


def wait_until_idle(app, within_s: float) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    while True:
        now = held(app)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def _ingress(app) -> dict:
    return app.http.get("/health", params={"verbose": 1}).json()["ingress"]


def _open_streams(app, within_s: float) -> tuple[int, int]:
    """The ingress's relayed streams still open (cluster/stream_relay.py): pumps, outlets."""
    deadline = time.monotonic() + within_s
    while True:
        ingress = _ingress(app)
        now = ingress["relay_pumps"], ingress["relay_outlets"]
        if now == (0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _requests_total(app) -> dict[str, float]:
    families = text_string_to_metric_families(app.http.get("/metrics").text)
    return {
        s.labels["status"]: s.value
        for f in families
        for s in f.samples
        if s.name == "epd:requests_total"
    }


def test_stop_on_the_first_token_frees_the_kv_at_once(app):
    greedy = app.chat(_messages(301), temperature=0, max_tokens=8).json()["choices"][0]["message"][
        "content"
    ]
    for i in range(3):
        r = app.chat(_messages(301), temperature=0, max_tokens=8, stop=[greedy[:1]]).json()
        assert (
            r["choices"][0]["message"]["content"] == ""
            and r["choices"][0]["finish_reason"] == "stop"
        )
    assert not any(wait_until_idle(app, within_s=3).values()), held(
        app
    )  # not after the inbox's 120 s expiry


def test_clients_that_leave_mid_stream_leave_nothing_behind(app):
    async def leave_after_first_chunk(client: httpx.AsyncClient, seed: int):
        body = {
            "model": app.config.model.served_name,
            "messages": _messages(seed, "long " * 300),
            "temperature": 0,
            # long enough that no stream can end, whole in HAProxy's and the sockets' buffers,
            # before its client's leaving reaches the replica
            "max_tokens": 512,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    return  # closes the connection with the request mid-stream

    async def storm():
        async with httpx.AsyncClient(base_url=app.root, timeout=60) as client:
            await asyncio.gather(*[leave_after_first_chunk(client, 400 + i) for i in range(12)])

    before, relayed_before = _requests_total(app), _ingress(app)["relayed_streams"]
    asyncio.run(storm())
    assert not any(wait_until_idle(app, within_s=10).values()), held(app)
    assert _open_streams(app, within_s=3) == (0, 0), "the replica let go of every stream"
    assert _ingress(app)["relayed_streams"] == relayed_before + 12, "HAProxy: the gate relays"
    after = _requests_total(app)
    aborted, ok = (after.get(s, 0) - before.get(s, 0) for s in ("aborted", "ok"))
    # Every outcome is counted. On a loaded host a stream may end before its client's leaving is
    # noticed: then it is ok.
    assert aborted + ok == 12 and aborted >= 1, (aborted, ok)


async def _ask(client: httpx.AsyncClient, model: str, seed: int, stream: bool) -> tuple[int, str]:
    body = {
        "model": model,
        "messages": _messages(seed),
        "temperature": 0,
        "max_tokens": 24,
        "stream": stream,
    }
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        return r.status_code, r.json()["choices"][0]["message"][
            "content"
        ] if r.status_code == 200 else r.text
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return 500, event["error"]["message"]
                text += "".join(c["delta"].get("content") or "" for c in event["choices"])
    return r.status_code, text


def _pid(app, kind: str) -> int:
    return app.http.get("/health", params={"verbose": 1}).json()["workers"][kind][0]["pid"]


def _wait_replaced(app, kind: str, dead_pid: int, within_s: float = 90) -> None:
    """/health tells the death at once (it polls the workers) and is ok again once a new
    worker has taken the dead one's place."""
    deadline = time.monotonic() + within_s
    while True:
        body = app.http.get("/health", params={"verbose": 1}).json()
        if body["status"] == "ok" and body["workers"][kind][0].get("pid") not in (None, dead_pid):
            return
        assert time.monotonic() < deadline, f"the {kind} worker was not replaced: {body}"
        time.sleep(0.5)


@pytest.mark.parametrize("kind", ["decode", "prefill", "encoder"])
def test_a_worker_killed_under_load_loses_no_request(app, kind):
    """Half the requests stream; whether a request had sent tokens or not, it finishes with
    exactly the answer it gives undisturbed."""
    first_seed = {"decode": 700, "prefill": 720, "encoder": 740}[
        kind
    ]  # new images: the encoders must work
    model, seeds = app.config.model.served_name, range(first_seed, first_seed + 10)
    pid = _pid(app, kind)

    async def under_fire():
        async with httpx.AsyncClient(base_url=app.root, timeout=120) as client:
            asks = [asyncio.create_task(_ask(client, model, s, stream=s % 2 == 0)) for s in seeds]
            await asyncio.sleep(0.4)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*asks)

    results = asyncio.run(under_fire())
    assert [status for status, _ in results] == [200] * len(results), results
    _wait_replaced(app, kind, pid)
    expected = [
        app.chat(_messages(s), temperature=0, max_tokens=24).json()["choices"][0]["message"][
            "content"
        ]
        for s in seeds
    ]
    assert [text for _, text in results] == expected
    assert not any(wait_until_idle(app, within_s=5).values()), held(app)


def test_an_abort_that_overtakes_its_submit_leaves_nothing(app):
    """An async actor may run calls out of order: when the ingress aborts a request whose
    submit call (carrying the KV) has not started yet, submit must not hold that KV."""
    import ray
    import torch

    from actors.types import DecodeRequest, SamplingParams
    from cluster.cli import APP_NAME
    from cluster.controller import NAMESPACE, controller_name
    from router.types import WorkerKind

    controller = ray.get_actor(controller_name(APP_NAME, app.config), namespace=NAMESPACE)
    decoder = ray.get(controller.snapshot.remote()).pools[WorkerKind.DECODE][0]
    ray.get(decoder.abort.remote("overtaken:chatcmpl-1/0"))
    request = DecodeRequest("overtaken:chatcmpl-1/0", 8, 1, SamplingParams(max_tokens=8))
    queued = ray.get(decoder.submit.remote(request, torch.zeros(1), "overtaken:"))
    assert queued is False and not any(held(app).values()), held(app)
