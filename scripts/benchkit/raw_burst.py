"""A burst of chat requests at once, each on its own raw socket (no client library between),
timed from the moment its bytes were written; and what it came to (scripts/bench_burst.py,
the probe's burst phase)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass

from tqdm import tqdm

from benchkit.probe_client import chat_body, is_openai_error
from benchkit.stats import pct


@dataclass
class RawOutcome:
    status: int = 0  # 0: no answer (connection reset or timed out)
    sent_s: float = 0.0  # the request's last byte written, from the burst's start
    first_byte_ms: float = 0.0  # from sent_s to the response's first byte
    retry_after: bool = False
    openai_error: bool = False


def request_bytes(model: str, seed: int) -> bytes:
    body = json.dumps(chat_body(model, max_tokens=16, seed=seed)).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: epd\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def one(
    port: int, payload: bytes, t0: float, timeout_s: float, host: str = "127.0.0.1"
) -> RawOutcome:
    out = RawOutcome()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return out
    try:
        writer.write(payload)
        await writer.drain()
        sent = time.perf_counter()
        out.sent_s = sent - t0
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        out.first_byte_ms = (time.perf_counter() - sent) * 1e3
        out.status = int(line.split()[1]) if line.startswith(b"HTTP/") else 0
        rest = await asyncio.wait_for(reader.read(), timeout_s)  # Connection: close
        head, _, body = rest.partition(b"\r\n\r\n")
        out.retry_after = b"\nretry-after:" in head.lower()
        out.openai_error = out.status >= 400 and is_openai_error(_unchunked(head, body))
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        pass
    finally:
        writer.close()
    return out


def _unchunked(head: bytes, body: bytes) -> str:
    if b"transfer-encoding: chunked" not in head.lower():
        return body.decode(errors="replace")
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out.decode(errors="replace")


async def burst(
    port: int, model: str, n: int, timeout_s: float, host: str = "127.0.0.1"
) -> list[RawOutcome]:
    payloads = [request_bytes(model, i) for i in range(n)]
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(port, p, t0, timeout_s, host)) for p in payloads]
    bar = tqdm(total=n, desc="burst", unit="req", leave=False)
    for task in tasks:
        task.add_done_callback(lambda _: bar.update())
    outcomes = await asyncio.gather(*tasks)
    bar.close()
    return outcomes


def report(outcomes: list[RawOutcome]) -> dict:
    statuses = Counter(o.status for o in outcomes)
    refused = [o for o in outcomes if o.status == 429]
    ms = [o.first_byte_ms for o in refused]
    return {
        "served": statuses.get(200, 0),
        "429": len(refused),
        "5xx": sum(c for s, c in statuses.items() if s >= 500),
        "no_answer": statuses.get(0, 0),
        "other": {s: c for s, c in statuses.items() if s not in (0, 200, 429) and s < 500},
        "429_with_retry_after": sum(o.retry_after for o in refused),
        "429_openai_shaped": sum(o.openai_error for o in refused),
        "429_ms_from_sent": {q: rounded(pct(ms, q)) for q in (50, 90, 99, 100)},
        "429_within_100ms": sum(m <= 100 for m in ms),
        "last_sent_s": rounded(max((o.sent_s for o in outcomes), default=0.0)),
    }


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 2)
