"""An image burst for the autoscaling checks: a few clients send greedy image requests back to
back, each with a new image (no encoder cache hits), until a condition holds."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
from PIL import Image

MAX_TOKENS = 8
CLIENTS = 6
# An encoder pool of one worker that may grow to two, quick to react either way (the checks'
# encoders are slowed 10x, so these clients keep one worker busy).
SCALING = {
    "min_workers": 1,
    "max_workers": 2,
    "target_utilization": 0.3,
    "up_delay_s": 1.0,
    "down_delay_s": 3.0,
}


def messages(seed: int) -> list[dict]:
    """A one-image question; `seed` picks the image (48x48 noise)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    return [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]


def burst_until(root: str, model: str, done, within_s: float) -> list[tuple[int, str]]:
    """(seed, answer) of every request sent until `done()` (checked every 0.5 s in a thread)
    or `within_s`; every request must succeed."""
    return asyncio.run(_burst(root, model, done, time.monotonic() + within_s))


async def _burst(root: str, model: str, done, deadline_s: float) -> list[tuple[int, str]]:
    answers: list[tuple[int, str]] = []
    seeds, stop = iter(range(10_000, 100_000)), asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set() and time.monotonic() < deadline_s:
            seed = next(seeds)
            body = {"model": model, "messages": messages(seed), "max_tokens": MAX_TOKENS}
            response = await http.post("/v1/chat/completions", json={**body, "temperature": 0})
            assert response.status_code == 200, response.text
            answers.append((seed, response.json()["choices"][0]["message"]["content"]))

    async def watch() -> None:
        while time.monotonic() < deadline_s and not await asyncio.to_thread(done):
            await asyncio.sleep(0.5)
        stop.set()

    async with httpx.AsyncClient(base_url=root, timeout=120) as http:
        await asyncio.gather(watch(), *[client(http) for _ in range(CLIENTS)])
    return answers
