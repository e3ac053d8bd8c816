#!/usr/bin/env python
"""A burst of N chat requests at once, each on its own raw socket (no client library between),
timed from the moment its bytes were written: how long a refused request waits for its 429
after it arrived (issue #29: within 100 ms), how many were served, and that no answer is a 5xx.

Run it beside a server (`./scripts/serve`):
    .venv/bin/python scripts/bench_burst.py [--port 8000] [--burst 1500] [--rounds 1]
A Python client on the server's own cores cannot issue 1,500 requests in 100 ms, so the time
that counts is from each request's last byte sent, not from the burst's start (also printed).
Its own event loop still delays the answers it times by 100-250 ms at the end of such a burst
(scripts/bench_floors.py); `--client c` sends and times them from C instead
(scripts/benchkit/burst_client.c: every request the same body). `--alternate-cap` turns
HAProxy's own refusal (cluster/haproxy_cap.py) off in odd rounds and on in even ones, live in
the same server: the replicas' gate alone is the baseline.

`--held N`: what one refusal costs the ingress replica. One stream holds the only generating
slot of a server started with `--set limits.max_generating_per_decode_worker=1`, and N
requests, `--concurrency` at a time, are all refused; the replica's CPU time over N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import psutil

from benchkit import c_burst
from benchkit.raw_burst import RawOutcome, burst, one, report, request_bytes, rounded
from benchkit.rss import ingress_pid
from benchkit.stats import pct
from cluster import haproxy_cap


async def held(port: int, model: str, n: int, concurrency: int, pid: int) -> dict:
    proc = psutil.Process(pid)
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hold the slot"}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: epd\r\nConnection: close\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    assert (await reader.readline()).split()[1] == b"200", "the holding stream was not admitted"
    slots, payloads = asyncio.Semaphore(concurrency), [request_bytes(model, i) for i in range(n)]

    async def refused(payload: bytes) -> RawOutcome:
        async with slots:
            return await one(port, payload, 0.0, 60.0)

    cpu_s = sum(proc.cpu_times()[:2])
    outcomes = await asyncio.gather(*(refused(p) for p in payloads))
    cpu_s = sum(proc.cpu_times()[:2]) - cpu_s
    writer.close()
    ms = [o.first_byte_ms for o in outcomes if o.status == 429]
    return {
        "429": len(ms),
        "others": len(outcomes) - len(ms),
        "replica_cpu_ms_per_refusal": round(cpu_s * 1e3 / n, 3),
        "429_ms_from_sent": {q: rounded(pct(ms, q)) for q in (50, 99)},
    }


def model_name(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--burst", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per read")
    ap.add_argument("--pause", type=float, default=5.0, help="seconds between rounds")
    ap.add_argument("--held", type=int, default=0, help="refusals at a held budget (see above)")
    ap.add_argument("--concurrency", type=int, default=32, help="--held: requests at a time")
    ap.add_argument("--client", choices=("python", "c"), default="python", help="the burst's")
    ap.add_argument(
        "--alternate-cap",
        action="store_true",
        help="HAProxy's cap (cluster/haproxy_cap.py) off in odd rounds, on in even ones: the "
        "replicas' gate alone as the baseline, in the same server",
    )
    args = ap.parse_args()
    model = model_name(args.port)
    budget = haproxy_cap.published(args.port).get("requests", 0)
    if args.alternate_cap and not budget:
        raise SystemExit(f"no HAProxy cap published for port {args.port}: nothing to alternate")
    try:
        for i in range(args.rounds):
            if i:
                time.sleep(args.pause)
            if args.alternate_cap:
                capped = i % 2 == 1
                answers = haproxy_cap.set_live(args.port, requests=budget if capped else 0)
                if not answers or any(answer.strip() for answer in answers):
                    raise SystemExit(f"HAProxy did not take the cap's change: {answers}")
                print(f"round {i + 1}: HAProxy cap {'on' if capped else 'off'}", flush=True)
            run_round(args, model)
    finally:
        if args.alternate_cap:
            haproxy_cap.set_live(args.port, requests=budget)


def run_round(args, model: str) -> None:
    if args.held:
        pid = ingress_pid(f"http://127.0.0.1:{args.port}")
        print(json.dumps(asyncio.run(held(args.port, model, args.held, args.concurrency, pid))))
    elif args.client == "c":
        outcomes = c_burst.burst(args.port, request_bytes(model, 0), args.burst)
        print(json.dumps(report(outcomes)))
    else:
        outcomes = asyncio.run(burst(args.port, model, args.burst, args.timeout))
        print(json.dumps(report(outcomes)))


if __name__ == "__main__":
    main()
