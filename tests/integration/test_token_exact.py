"""Greedy output of the cluster equals the checkpoint's own `generate`, token for token,
through HTTP, with many requests in flight at once, for each transport."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from tests.integration.conftest import (
    cluster_config,
    deploy,
    deployed_now,
    png_data_url,
    random_image,
)
from tests.integration.reference import reference_generate

MAX_TOKENS = 20


def _img(seed: int, w: int, h: int, fmt: str = "PNG") -> dict:
    return {"type": "image_url", "image_url": {"url": png_data_url(random_image(seed, w, h), fmt)}}


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


LONG = " ".join(f"Sentence {i} talks about the colour of the sky and the sea." for i in range(40))


def varied_requests() -> list[list[dict]]:
    """One to three images at different positions, short and long prompts, several sizes."""
    return [
        [{"role": "user", "content": "Hello there, how are you?"}],
        [{"role": "user", "content": LONG}],
        [{"role": "user", "content": [_img(1, 32, 32), _text("What is this?")]}],
        [{"role": "user", "content": [_text("Look:"), _img(2, 64, 48)]}],
        [
            {
                "role": "user",
                "content": [
                    _text("Compare"),
                    _img(3, 20, 90),
                    _text("with"),
                    _img(4, 128, 128, "JPEG"),
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    _img(5, 40, 40),
                    _img(6, 33, 77, "WEBP"),
                    _img(7, 300, 200),
                    _text("Three pictures."),
                ],
            }
        ],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [_img(8, 50, 50), _text(LONG[:400])]},
        ],
        [
            {"role": "user", "content": [_img(9, 32, 32), _text("first")]},
            {"role": "assistant", "content": "a reply"},
            {"role": "user", "content": [_text("and this one"), _img(10, 64, 64)]},
        ],
        [{"role": "user", "content": [_text("Same prompt, other image."), _img(11, 32, 32)]}],
        [{"role": "user", "content": [_text("Same prompt, other image."), _img(12, 32, 32)]}],
        [{"role": "user", "content": "Tell me a story about a fox."}],
        [{"role": "user", "content": "Tell me a story about a cat."}],
    ]


async def _send_all(app, requests: list[list[dict]], copies: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=app.root, timeout=300) as client:
        body = lambda msgs: {
            "model": app.config.model.served_name,
            "messages": msgs,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        }
        calls = [client.post("/v1/chat/completions", json=body(m)) for m in requests * copies]
        responses = await asyncio.gather(*calls)
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


@pytest.fixture(scope="module")
def references(ray_session):
    checkpoint = str(cluster_config().model.checkpoint_path)
    return [reference_generate(checkpoint, m, MAX_TOKENS) for m in varied_requests()]


def test_greedy_outputs_depend_on_the_input(references):
    texts = [text for _, text, _ in references]
    assert len(set(texts)) >= len(texts) - 1, texts  # different images/prompts, different answers
    for ids, _, _ in references:
        assert len(set(ids)) > 3, ids  # not one token repeated


def _prefill_engine_aging(app) -> float:
    from cluster.cli import APP_NAME
    from cluster.controller import NAMESPACE, controller_name, running
    from router.types import WorkerKind

    name = controller_name(APP_NAME, app.config)
    assert running(APP_NAME) == [name]  # one fleet: a change of worker settings retired the old
    controller = ray.get_actor(name, namespace=NAMESPACE)
    worker = ray.get(controller.snapshot.remote()).pools[WorkerKind.PREFILL][0]
    return ray.get(worker.__ray_call__.remote(lambda self: self.engine.settings.aging_tokens_per_s))


# Images decoded 8 at a time (an ingress setting: same fleet) reach the encoders together, so
# their batches form; 2 at a time they trickle in and a batch of one is likely. The module's
# app has it from the start, so the first load test runs on it without a redeploy.
LIMITS = {"max_concurrent_decodes": 8}


@pytest.fixture(scope="module")
def app(ray_session):
    return deploy(cluster_config(limits=LIMITS))


def test_streaming_equals_whole_response(app, references):
    messages = varied_requests()[4]
    with app.http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": app.config.model.served_name,
            "messages": messages,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
    assert text == references[4][1]
    assert events[-1]["usage"]["completion_tokens"] == len(references[4][0])
    assert [c["choices"][0]["finish_reason"] for c in events if c["choices"]][-1] in (
        "stop",
        "length",
    )


def _long_stream(app) -> tuple[list[str], float]:
    """A long greedy stream's SSE data lines, and the monotonic time it ended. The app's decode
    steps are slowed 8x (a live setting, its fleet is about to go): far longer than a fleet
    change takes."""
    from cluster import controller

    fleet = ray.get_actor(controller.controller_name("epd", app.config), controller.NAMESPACE)
    ray.get(
        fleet.apply_live.remote(
            app.config.replace(decode={"slowdown": [8.0]}).model_dump(mode="json")
        )
    )
    body = {
        "model": app.config.model.served_name,
        "messages": [{"role": "user", "content": "Count slowly"}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with app.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return lines, time.monotonic()


def _ends_at_once_naming_the_redeploy(stream: tuple[list[str], float], deployed: float) -> None:
    """A stream on a fleet a redeploy retired ends with an error that says so, as the new
    config takes over, not at its deadline: retried, it runs on the new fleet."""
    lines, ended = stream
    assert ended < deployed + 5, (ended - deployed, lines[-2:])
    assert "a redeploy replaced the workers" in lines[-2], lines[-2:]


# Last: the tests above share the default app; overlap is the ingress's choice (same fleet),
# gloo with aging needs a fleet of its own.
@pytest.mark.parametrize(
    "transport,overlap,aging",
    [("object_store", True, 0.0), ("object_store", False, 0.0), ("gloo", True, 10_000.0)],
    ids=["object_store", "no_overlap", "gloo_aging"],
)
def test_cluster_equals_generate_under_load(ray_session, references, transport, overlap, aging):
    """`overlap`: prefill.overlap_encode (the prefill call before the embeddings) or the baseline
    path; `aging`: prefill.aging_tokens_per_s (10,000: the order is about arrival; the answers must
    not move)."""
    prefill = {"overlap_encode": overlap, "aging_tokens_per_s": aging}
    transports = {"embeddings": transport, "kv": transport}
    if not overlap:  # and pixels and embeddings through the object store, however small
        transports["inline_max_bytes"] = 0
    config = cluster_config(transport=transports, prefill=prefill, limits=LIMITS)
    with ThreadPoolExecutor(1) as pool:
        old = deployed_now()  # a new fleet config: a stream in flight on the old one must end
        fleet_change = old is not None and old.config.fleet_fingerprint() != (
            config.fleet_fingerprint()
        )
        in_flight = pool.submit(_long_stream, old) if fleet_change else None
        app = deploy(config)
        if in_flight is not None:
            _ends_at_once_naming_the_redeploy(in_flight.result(), time.monotonic())
    assert _prefill_engine_aging(app) == aging  # the setting reached the worker's scheduler
    copies = 3  # 36 requests in flight: encoder batches and decode batches form
    got = asyncio.run(_send_all(app, varied_requests(), copies))
    again = asyncio.run(
        _send_all(app, varied_requests(), 1)
    )  # the same prompts once more: the prefix cache is warm
    for i, response in enumerate(got + again):
        ids, text, finish = references[i % len(references)]
        assert response["choices"][0]["message"]["content"] == text, (
            f"request {i % len(references)}"
        )
        assert response["usage"]["completion_tokens"] == len(ids)
        assert response["choices"][0]["finish_reason"] == finish
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    assert sum(w["prefix_hit_blocks"] for w in workers["prefill"]) > 0, (
        workers
    )  # warm prefixes really were reused
    assert all(w["prefix_referenced_blocks"] == 0 for w in workers["prefill"]), (
        workers
    )  # idle: nothing pinned
    assert max(w["max_batch"] for w in workers["encoder"]) > 1, workers  # batching really happened
    assert max(w["max_batch"] for w in workers["decode"]) > 1, workers
    for kind in ("prefill", "decode"):  # the default config's direct links carried them
        assert sum(w["link_messages"] for w in workers[kind]) > 0, workers
    # small images and their embeddings rode inside link calls, where they may
    inlined = sum(w["link_messages"] for w in workers["encoder"])
    assert inlined > 0 if config.transport.inline_bytes else inlined == 0, workers
    # and the pixels (hundreds of kB an image) through the encode calls' shared-memory ring
    ringed = sum(w["link_ring_bytes"] for w in workers["encoder"])
    assert ringed > 0 if config.transport.inline_bytes else ringed == 0, workers
    assert all(w["cache_referenced_entries"] == 0 for w in workers["encoder"]), workers
    assert all(w["rows"] == 0 for w in workers["decode"]) and all(
        w["held_kv"] == 0 for w in workers["prefill"]
    ), workers
