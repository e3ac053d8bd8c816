"""The benchmarks' chat client: a streaming request body, one SSE request timed from its
scheduled arrival, and replays of a workload (open loop with a cap, or one at a time)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from benchkit.workload import Req


@dataclass
class Result:
    ttft_s: float
    tpot_s: float | None
    tokens: int
    first_s: float  # first and last token times, relative to the phase start
    done_s: float
    timings: dict | None = None


def chat_body(req: Req, model: str, max_tokens: int) -> bytes:
    """A greedy streaming chat request for `req`, its image (if any) before the prompt."""
    content = [{"type": "text", "text": req.prompt}]
    if req.png is not None:
        url = "data:image/png;base64," + base64.b64encode(req.png).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return streaming_chat_body(model, content, max_tokens)


def streaming_chat_body(model: str, content: list[dict], max_tokens: int) -> bytes:
    """A greedy streaming chat request of one user message, with usage in its last chunk."""
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def stream_one(client, url: str, body: bytes, arrival: float, t0: float) -> Result:
    """POST one streaming chat; TTFT counts from `t0 + arrival`, its scheduled send."""
    first = last = None
    usage, timings = {}, None
    async with client.stream(
        "POST", url, content=body, headers={"content-type": "application/json"}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event, now = json.loads(line[6:]), time.perf_counter()
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']}")
            choice = (event.get("choices") or [{}])[0]
            if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                first, last = first or now, now
            usage, timings = event.get("usage") or usage, event.get("timings") or timings
    n = usage.get("completion_tokens", 0)
    return Result(
        first - (t0 + arrival),
        (last - first) / (n - 1) if n > 1 else None,
        n,
        first - t0,
        last - t0,
        timings,
    )


async def replay_cluster(
    url: str, reqs: list[Req], model: str, max_tokens: int, concurrency: int
) -> tuple[list[Result], float]:
    """Every request sent at its arrival time, at most `concurrency` in flight; the results
    and the wall seconds until the last one finished."""
    bodies = [chat_body(r, model, max_tokens) for r in reqs]
    sem, bar = (
        asyncio.Semaphore(concurrency),
        tqdm(total=len(reqs), desc="cluster load", unit="req"),
    )
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: Req, body: bytes) -> Result:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            async with sem:  # a request the cap holds back counts that wait in its TTFT
                result = await stream_one(client, url, body, req.arrival_s, t0)
            bar.update()
            return result

        results = await asyncio.gather(*(one(r, b) for r, b in zip(reqs, bodies)))
    bar.close()
    return list(results), max(r.done_s for r in results)


async def sequential_cluster(
    url: str, reqs: list[Req], model: str, max_tokens: int, desc: str
) -> list[Result]:
    """One request at a time, nothing else in flight (warm-up and idle TTFT)."""
    async with httpx.AsyncClient(timeout=300) as client:
        return [
            await stream_one(client, url, chat_body(r, model, max_tokens), 0.0, time.perf_counter())
            for r in tqdm(reqs, desc=desc, unit="req")
        ]
