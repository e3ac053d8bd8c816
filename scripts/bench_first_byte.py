#!/usr/bin/env python
"""What the HTTP path costs around the server's own TTFT: sequential one-token streaming chats
over a raw socket (no client library's overhead), the first response byte's time against the
`ttft_ms` the server reports for the same request; and the round trip of an empty Ray actor
call on the same cluster (every hop between the stages costs at least that).

Run it beside a server (`./scripts/serve`):
    .venv/bin/python scripts/bench_first_byte.py [--port 8000] [--requests 200]
`--port` may also name an ingress replica's own port (Serve's direct ingress, 30000 and up),
which leaves HAProxy out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time

from benchkit.http_client import streaming_chat_body


def request_bytes(model: str) -> bytes:
    body = streaming_chat_body(model, [{"type": "text", "text": "Hello there, what is this?"}], 1)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: epd\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def one(port: int, request: bytes) -> tuple[float, float]:
    """(ms to the first response byte, the server's ttft_ms) of one request."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        sock.sendall(request)
        data = sock.recv(65536)
        first_ms = (time.perf_counter() - started) * 1e3
        if not data.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the server answered {data[:200]!r}")
        while b"[DONE]" not in data and (more := sock.recv(65536)):
            data += more
    text = data.decode(errors="replace")
    at = text.index('"ttft_ms":') + len('"ttft_ms":')
    return first_ms, float(text[at : text.index(",", at)])


def model_name(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: epd\r\nConnection: close\r\n\r\n")
        data = b""
        while more := sock.recv(65536):
            data += more
    return json.loads(data.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]


def actor_rtt_ms(calls: int) -> float:
    import ray

    ray.init(address="auto", namespace="bench_first_byte", logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Echo:
        async def echo(self, x):
            return x

    echo = Echo.remote()
    ray.get(echo.echo.remote(None))

    async def timed() -> list[float]:
        out = []
        for _ in range(calls):
            started = time.perf_counter()
            await echo.echo.remote(b"x" * 100)
            out.append((time.perf_counter() - started) * 1e3)
        return out

    times = asyncio.run(timed())
    ray.kill(echo)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--no-ray", action="store_true", help="skip the actor round trip")
    args = parser.parse_args()
    request = request_bytes(model_name(args.port))
    for _ in range(10):  # warm-up
        one(args.port, request)
    pairs = [one(args.port, request) for _ in range(args.requests)]
    report = {
        "port": args.port,
        "requests": args.requests,
        "first_byte_ms_p50": round(statistics.median(f for f, _ in pairs), 2),
        "server_ttft_ms_p50": round(statistics.median(s for _, s in pairs), 2),
        "first_byte_minus_server_ms_p50": round(statistics.median(f - s for f, s in pairs), 2),
    }
    if not args.no_ray:
        report["ray_actor_call_rtt_ms_p50"] = round(actor_rtt_ms(300), 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
