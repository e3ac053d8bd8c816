"""Qwen2.5-VL (images and video, 3-D rotary positions) and LLaVA-NeXT (anyres tiling, odd
aspect ratios) served over HTTP on a real local Ray cluster from checkpoints in the published
layout: greedy output equals the model's own `generate`, token for token, with requests of
different media in flight together (Qwen2.5-VL: batched in the encoders and in decode)."""

from __future__ import annotations

from tests.integration.conftest import deploy
from tests.integration.test_modalities import (
    app_config,
    check_token_exact,
    image,
    text,
    user,
    video,
)

QWEN_VL_REQUESTS = [
    user(image(21, 60, 90), text("What is this?")),  # one image
    user(
        text("Compare"), image(22, 37, 211), text("with"), image(23, 300, 40)
    ),  # several images, odd sizes
    user(text("Watch:"), video(4, 40, 56, 24)),  # one video
    user(
        image(25, 50, 50), text("then"), video(5, 56, 40, 26), text("and say.")
    ),  # image and video
    user(video(2, 30, 30, 27), text("versus"), video(6, 48, 32, 28)),  # two videos
    [{"role": "user", "content": "Just text, no media at all."}],
]
LLAVA_NEXT_REQUESTS = [
    user(image(31, 37, 211), text("What is it?")),
    user(text("Look:"), image(32, 300, 40)),
    user(image(33, 211, 37), image(34, 40, 300), text("Compare them.")),
    user(image(35, 5, 500), text("A sliver.")),
    [{"role": "user", "content": "Only words here."}],
]


def _batched_everywhere(app) -> None:
    workers = app.http.get("/health", params={"verbose": 1}).json()["workers"]
    assert max(w["max_batch"] for w in workers["encoder"]) > 1, workers
    assert max(w["max_batch"] for w in workers["decode"]) > 1, workers


def test_qwen2_5_vl_equals_generate_with_mixed_media_in_flight(ray_session):
    # A partial encoder batch waits longer than the config's 20 ms: on two busy cores the
    # requests' items can reach the encoders further apart than that (300 ms was too short
    # once in a loaded suite run), and none would batch.
    app = deploy(app_config("qwen2_5_vl", encoder={"max_wait_ms": 1000}))
    check_token_exact(app, QWEN_VL_REQUESTS, copies=2)
    _batched_everywhere(app)


def test_llava_next_equals_generate_for_odd_aspect_ratios(ray_session):
    check_token_exact(deploy(app_config("llava_next")), LLAVA_NEXT_REQUESTS, copies=1)


def test_vl_models_refuse_what_they_do_not_take(ray_session):
    app = deploy(app_config("llava_next"))
    response = app.chat(user(video(2, 20, 20, 1), text("hi")))
    assert response.status_code == 400
    assert "does not take video input" in response.json()["error"]["message"]
