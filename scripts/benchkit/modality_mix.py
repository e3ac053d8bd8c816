"""The mixed-modality benchmark's requests: a streaming body per kind of request (text, one
image, four images, a video clip, audio), Poisson arrivals of a list of kinds, and their
replay with TTFT per kind."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import numpy as np
from tqdm import tqdm

from benchkit.http_client import stream_one, streaming_chat_body
from benchkit.media import audio_part, image_part, video_part


def request_body(kind: str, rng: np.random.Generator, model: str, max_tokens: int) -> bytes:
    media = {
        "text": [],
        "image": [image_part(rng)],
        "images4": [image_part(rng) for _ in range(4)],
        "video": [video_part(rng)],
        "audio": [audio_part(rng)],
    }[kind]
    content = media + [
        {"type": "text", "text": f"Describe what you see and hear, case {rng.integers(1e6)}."}
    ]
    return streaming_chat_body(model, content, max_tokens)


def workload(
    kinds: list[str], rate_rps: float, seed: int, model: str, max_tokens: int
) -> list[tuple[str, float, bytes]]:
    """(kind, arrival_s, body) with Poisson arrivals at `rate_rps`."""
    rnd, rng, t, out = random.Random(seed), np.random.default_rng(seed), 0.0, []
    for kind in kinds:
        out.append((kind, t, request_body(kind, rng, model, max_tokens)))
        t += rnd.expovariate(rate_rps)
    return out


async def replay(
    url: str,
    reqs: list[tuple[str, float, bytes]],
    desc: str,
    timings_out: dict[str, list[dict]] | None = None,
) -> dict[str, list[float]]:
    """TTFT in ms per request kind; with `timings_out`, each request's server `timings` too,
    in the same order as its TTFT."""
    bar = tqdm(total=len(reqs), desc=desc, unit="req")
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()

        async def one(kind: str, arrival: float, body: bytes):
            await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
            result = await stream_one(client, url, body, arrival, t0)
            bar.update()
            return kind, result.ttft_s * 1e3, result.timings

        done = await asyncio.gather(*(one(*r) for r in reqs))
    bar.close()
    out: dict[str, list[float]] = {}
    for kind, ttft, timings in done:
        out.setdefault(kind, []).append(ttft)
        if timings_out is not None:
            timings_out.setdefault(kind, []).append(timings or {})
    return out
