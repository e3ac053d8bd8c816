"""An autoscaled encoder pool on the real local cluster: a burst of images grows it from one
worker to two (the second placed and routed to while requests stream), the pool drains back
to one once the burst ends, and every answer across both changes equals `generate`.

The encoder is slowed (`slowdown`, a sleep per step: no host CPU) so that a handful of clients
keep one worker busy; the load the controller sees is the router's booked encode ms (or the
workers' measured device time, where more). tests/integration/test_ray_autoscaler.py does the
same with Ray's autoscaler launching the second worker's node."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.burst import MAX_TOKENS, SCALING, burst_until, messages
from tests.integration.conftest import cluster_config, deploy
from tests.integration.reference import reference_generate


@pytest.fixture(scope="module")
def app(ray_session):
    encoder = {"num_workers": 1, "autoscaling": SCALING, "slowdown": [10.0, 10.0]}
    return deploy(cluster_config(encoder=encoder))


def _encoders(app) -> tuple[dict, list[dict]]:
    body = httpx.get(f"{app.root}/health", params={"verbose": 1}, timeout=30).json()
    return body["fleet"]["pools"]["encoder"], body["workers"]["encoder"]


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

    answers = burst_until(app.root, app.config.model.served_name, grown, within_s=150)
    assert grown(), f"the pool did not grow: {_encoders(app)}"
    assert _pool_workers(app)["serving"] == 2

    # The burst is over: one worker fewer suffices for down_delay_s, then it drains and stops.
    assert _wait_for(lambda: _encoders(app)[0]["routed"] == 1, within_s=60), _encoders(app)
    assert _wait_for(lambda: _encoders(app)[1][1] == {"slot": "empty"}, within_s=30)
    assert _pool_workers(app) == {"serving": 1, "starting": 0, "draining": 0, "empty": 1}
    after = app.chat(messages(1), temperature=0, max_tokens=MAX_TOKENS)
    assert after.status_code == 200, after.text

    checkpoint = str(app.config.model.checkpoint_path)
    answers.append((1, after.json()["choices"][0]["message"]["content"]))
    for seed, answer in answers[:: max(1, len(answers) // 6)] + answers[-3:]:
        _, text, _ = reference_generate(checkpoint, messages(seed), MAX_TOKENS)
        assert answer == text, f"seed {seed}"
