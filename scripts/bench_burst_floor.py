#!/usr/bin/env python
"""How fast can anything on this host refuse a burst? The same raw-socket burst as
scripts/bench_burst.py against two servers that answer every request with a 429 at once:

- `python`: a bare asyncio protocol (no HTTP framework, no ASGI, no Serve), reading a request
  up to its body's end and writing a fixed 429: the least work a refusal in Python can be;
- `haproxy`: the HAProxy binary Serve ships, with one `http-request return status 429` rule:
  a refusal before any Python, as a front-door rule would give.

Issue #29 asks that every refused request of a 1,500-request burst have its 429 within 100 ms
of its last byte. What these floors reach on the same cores, with the same client, bounds what
epd's gate can: below the `python` floor no Python refusal can go. `--client c` (the default)
times each request from C (scripts/benchkit/burst_client.c); `--client python` with the
asyncio client of bench_burst.py, whose own loop delays the answers it times.

    .venv/bin/python scripts/bench_burst_floor.py [--burst 1500] [--rounds 2] [--only python]
        [--client c|python]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import c_burst
from benchkit.raw_burst import burst, report, request_bytes

BODY = b'{"error":{"message":"busy","type":"rate_limit_error","param":null,"code":429}}'
ANSWER = (
    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


class Refuser(asyncio.Protocol):
    """Reads one request (headers, then Content-Length bytes), answers 429, closes."""

    def connection_made(self, transport):
        self.transport, self.data = transport, b""

    def data_received(self, data: bytes) -> None:
        self.data += data
        head, sep, body = self.data.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next(
            (
                int(v)
                for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                if k.strip().lower() == b"content-length"
            ),
            0,
        )
        if len(body) >= length:
            self.transport.write(ANSWER)
            self.transport.close()


def serve_python(port: int) -> None:
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(
        loop.create_server(Refuser, "127.0.0.1", port, backlog=4096, reuse_address=True)
    )
    loop.run_until_complete(server.serve_forever())


def haproxy_config(port: int) -> str:
    body = BODY.decode().replace('"', '\\"')
    return f"""global
    maxconn 8192
    nbthread 2
defaults
    mode http
    timeout client 30s
    timeout connect 5s
    timeout server 30s
frontend refuse
    bind 127.0.0.1:{port}
    http-request return status 429 content-type application/json hdr Retry-After 1 string "{body}"
"""


def start(kind: str, port: int, workdir: Path) -> subprocess.Popen:
    if kind == "python":
        code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        code += f"import bench_burst_floor as b; b.serve_python({port})"
        return subprocess.Popen([sys.executable, "-c", code])
    from ray.serve._private.haproxy import get_haproxy_binary

    cfg = workdir / "refuse.cfg"
    cfg.write_text(haproxy_config(port))
    return subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(cfg)])


def wait_for(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_burst(client: str, port: int, n: int) -> list:
    if client == "c":
        return c_burst.burst(port, request_bytes("floor", 0), n)
    return asyncio.run(burst(port, "floor", n, 60.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burst", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=("python", "haproxy"), action="append")
    ap.add_argument(
        "--client",
        choices=("python", "c"),
        default="c",
        help="c: scripts/benchkit/burst_client.c (no client loop in the times); python: "
        "bench_burst.py's asyncio client",
    )
    ap.add_argument("--out", default="/tmp/bench_burst_floor.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for kind in args.only or ("python", "haproxy"):
            port = free_port()
            server = start(kind, port, Path(workdir))
            try:
                wait_for(port)
                results[kind] = []
                for _ in range(args.rounds):
                    outcomes = run_burst(args.client, port, args.burst)
                    results[kind].append(report(outcomes))
                    print(kind, json.dumps(results[kind][-1]), flush=True)
                    time.sleep(1.0)
            finally:
                os.kill(server.pid, signal.SIGTERM)
                server.wait(10)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
