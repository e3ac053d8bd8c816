"""An autoscaled encoder pool on the real local cluster: a burst of images grows it from one
worker to two (the second placed and routed to while requests stream), the pool drains back
to one once the burst ends, and every answer across both changes equals `generate`.

The encoder is slowed (`slowdown`, a sleep per step: no host CPU) so that a handful of clients
keep one worker busy; the load the controller sees is the router's booked encode ms."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import cluster_config, deploy, png_data_url, random_image
from tests.integration.reference import reference_generate

MAX_TOKENS = 8
SCALING = {
    "min_workers": 1,
    "max_workers": 2,
    "target_utilization": 0.3,
    "up_delay_s": 1.0,
    "down_delay_s": 3.0,
}
CLIENTS = 6


def _messages(seed: int) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(seed, 48, 48))}}
    return [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]


@pytest.fixture(scope="module")
def app(ray_session):
    encoder = {"num_workers": 1, "autoscaling": SCALING, "slowdown": [10.0, 10.0]}
    return deploy(cluster_config(encoder=encoder))


def _encoders(app) -> tuple[dict, list[dict]]:
    body = httpx.get(f"{app.root}/health", params={"verbose": 1}, timeout=30).json()
    return body["fleet"]["pools"]["encoder"], body["workers"]["encoder"]


async def _burst_until(app, grown, deadline_s: float) -> list[tuple[int, dict]]:
    """CLIENTS streams of requests, each with a new image (no cache hits), until `grown()`."""
    answers: list[tuple[int, dict]] = []
    seeds = iter(range(10_000, 20_000))
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set() and time.monotonic() < deadline_s:
            seed = next(seeds)
            body = {"model": app.config.model.served_name, "messages": _messages(seed)}
            response = await http.post(
                "/v1/chat/completions", json={**body, "temperature": 0, "max_tokens": MAX_TOKENS}
            )
            assert response.status_code == 200, response.text
            answers.append((seed, response.json()))

    async def watch() -> None:
        while time.monotonic() < deadline_s and not await asyncio.to_thread(grown):
            await asyncio.sleep(0.5)
        stop.set()

    async with httpx.AsyncClient(base_url=app.root, timeout=120) as http:
        await asyncio.gather(watch(), *[client(http) for _ in range(CLIENTS)])
    return answers


def _pool_workers(app) -> dict[str, float]:
    """The encoder slots by state, as /metrics reports them."""
    text = httpx.get(f"{app.root}/metrics", timeout=30).text
    return {
        sample.labels["state"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "epd:pool_workers"
        for sample in family.samples
        if sample.labels["kind"] == "encoder"
    }


def _wait_for(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.5)
    return False


def test_an_image_burst_grows_the_encoder_pool_and_it_drains_back(app):
    pool, workers = _encoders(app)
    assert pool == {"slots": 2, "routed": 1, "starting": 0, "draining": 0}
    assert workers[1] == {"slot": "empty"}

    def grown() -> bool:  # two routed and the new one has encoded part of the burst
        pool, workers = _encoders(app)
        return pool["routed"] == 2 and workers[1].get("num_batches", 0) > 0

    answers = _burst_until(app, grown, time.monotonic() + 150)
    answers = asyncio.run(answers)
    assert grown(), f"the pool did not grow: {_encoders(app)}"
    assert _pool_workers(app)["serving"] == 2

    # The burst is over: one worker fewer suffices for down_delay_s, then it drains and stops.
    assert _wait_for(lambda: _encoders(app)[0]["routed"] == 1, within_s=60), _encoders(app)
    assert _wait_for(lambda: _encoders(app)[1][1] == {"slot": "empty"}, within_s=30)
    assert _pool_workers(app) == {"serving": 1, "starting": 0, "draining": 0, "empty": 1}
    after = app.chat(_messages(1), temperature=0, max_tokens=MAX_TOKENS)
    assert after.status_code == 200, after.text

    checkpoint = str(app.config.model.checkpoint_path)
    sample = answers[:: max(1, len(answers) // 6)] + answers[-2:] + [(1, after.json())]
    for seed, answer in sample:
        _, text, _ = reference_generate(checkpoint, _messages(seed), MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == text, f"seed {seed}"
