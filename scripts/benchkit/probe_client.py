"""One chat request as a client sees it, for the hardening probe (scripts/probe_server.py):
sent over httpx, streamed or not, and classified (ok, lost before its first token, broken
mid-stream, hung), so every phase counts failures the same way; and many at once, with a
progress bar."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from benchkit import probe_cases as pc

PROMPT_WORDS = "the quick brown fox jumps over a lazy dog near an old stone bridge".split()


@dataclass
class Outcome:
    """One chat request as the client saw it."""

    status: int | None = None
    ok: bool = False
    lost: bool = False  # failed before its first token
    broken: bool = False  # failed after tokens had streamed
    clean_error: bool = False  # the failure came as an OpenAI error (body or SSE event)
    hang: bool = False
    retry_after: bool = False
    tokens: int = 0  # content events seen on a stream
    latency_s: float = 0.0


@dataclass(frozen=True)
class TextTiming:
    """One text request beside others (the probe's media phase): the client's latency, the
    server's own span (`e2e_ms`, from epd's handler) and `handover_ms` (the HTTP server to that
    handler)."""

    latency_ms: float
    e2e_ms: float = 0.0
    handover_ms: float = 0.0

    @property
    def before_server_ms(self) -> float:
        """Client, HAProxy and the HTTP server before the arrival gate, and the way back."""
        return self.latency_ms - self.e2e_ms - self.handover_ms


def is_openai_error(text: str) -> bool:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()


def chat_body(
    model: str,
    words: int = 8,
    max_tokens: int = 16,
    stream: bool = False,
    image: bytes | None = None,
    seed: int = 0,
) -> dict:
    text = " ".join(PROMPT_WORDS[(seed + i) % len(PROMPT_WORDS)] for i in range(words))
    content = [pc.image_part(image), {"type": "text", "text": text}] if image else text
    return pc.chat(model, content, max_tokens=max_tokens, stream=stream)


async def run_chat(
    client: httpx.AsyncClient, url: str, body: dict, timeout: float, stop_after: int = 0
) -> Outcome:
    """Send one chat; `stop_after` > 0 closes a stream after that many content events."""
    out, t0 = Outcome(), time.perf_counter()
    try:
        # httpx's timeout is per read; this caps the whole request so a slow drip still ends.
        await asyncio.wait_for(_send(client, url, body, out, stop_after), timeout=timeout * 4)
    except (httpx.TimeoutException, asyncio.TimeoutError):
        out.hang = True
    except (httpx.HTTPError, ValueError):  # connection reset or closed mid-way, or a garbled event
        if not out.ok:
            out.lost, out.broken = out.tokens == 0, out.tokens > 0
    out.latency_s = time.perf_counter() - t0
    return out


async def _send(client, url, body, out: Outcome, stop_after: int) -> None:
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        out.status, out.retry_after = resp.status_code, "retry-after" in resp.headers
        if resp.status_code != 200:
            out.lost, out.clean_error = (
                True,
                is_openai_error((await resp.aread()).decode(errors="replace")),
            )
            return
        if not body.get("stream"):
            text = (await resp.aread()).decode(errors="replace")
            out.ok = '"choices"' in text
            out.lost = not out.ok
            return
        await _read_sse(resp, out, stop_after)


async def _read_sse(resp: httpx.Response, out: Outcome, stop_after: int) -> None:
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.ok = not (out.lost or out.broken)
            return
        event = json.loads(line[6:])
        if "error" in event:  # in-band error after the 200 headers
            out.clean_error = True
            out.lost, out.broken = out.tokens == 0, out.tokens > 0
            continue
        out.tokens += any(c.get("delta", {}).get("content") for c in event.get("choices", []))
        if stop_after and out.tokens >= stop_after:
            out.ok = True  # the client chose to leave; the server did nothing wrong
            return
    out.lost, out.broken = out.tokens == 0, out.tokens > 0  # stream ended without [DONE]


async def gather_bar(coros, desc: str) -> list:
    """asyncio.gather with a progress bar over the coroutines as they finish."""
    bar = tqdm(total=len(coros), desc=desc, unit="req")

    async def one(c):
        try:
            return await c
        finally:
            bar.update()

    try:
        return await asyncio.gather(*[one(c) for c in coros])
    finally:
        bar.close()
