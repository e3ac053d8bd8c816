#!/usr/bin/env python
"""What the host itself allows: issue #29's two load tests against servers that do the least an
answer can be (scripts/benchkit/floor_servers.py), on the same cores, with the same clients. No
server on this host can do better than these floors, so they say whether a target is epd's to
meet here.

- burst: the raw burst of scripts/bench_burst.py (1,500 requests at once, each on its own
  socket), every one refused, by a bare asyncio protocol (`python`: the least a refusal in
  Python can be) and by HAProxy's own `http-request return` rule (`haproxy`: a refusal before any
  Python). `--client c` (default) times each request from C (scripts/benchkit/burst_client.c);
  `--client python` with bench_burst.py's asyncio client, whose own loop delays what it times.
  Target (#29): every 429 within 100 ms of the request's last byte.
- media: scripts/probe_server.py's media phase (40 uploads of four 16 MP JPEGs, 9.4 MB each,
  beside one-token text requests from a process of their own) against HAProxy in front of a
  bare server that reads every body whole and answers at once (429 for the uploads). Reported:
  the text latency that the uploads alone add at p99 (beside p99 minus idle p50). Target (#29):
  epd's text TTFT p99 beside them within 1.5x of its idle value.

    .venv/bin/python scripts/bench_floors.py [--only burst|media] [--rounds 2] [--burst 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchkit import c_burst
from benchkit.floor_servers import running
from benchkit.raw_burst import burst, report, request_bytes

SCRIPTS = Path(__file__).parent


def burst_floor(kind: str, args, workdir: Path) -> list[dict]:
    rows = []
    with running(kind, workdir) as port:
        for _ in range(args.rounds):
            if args.client == "c":
                outcomes = c_burst.burst(port, request_bytes("m", 0), args.burst)
            else:
                outcomes = asyncio.run(burst(port, "m", args.burst, 60.0))
            rows.append(report(outcomes))
            print(kind, json.dumps(rows[-1]), flush=True)
    return rows


def media_floor(args, workdir: Path) -> list[dict]:
    rows = []
    with running("haproxy_front", workdir) as port:
        for i in range(args.rounds):
            out = workdir / f"media-{i}.json"
            probe = [sys.executable, str(SCRIPTS / "probe_server.py"), "--url"]
            probe += [f"http://127.0.0.1:{port}", "--phases", "media", "--media-burst", "40"]
            subprocess.run([*probe, "--timeout", "300", "--json", str(out)], check=True)
            text = json.loads(out.read_text())[0]["rows"][0]
            text["added_p99_ms"] = text["beside_p99_ms"] - text["idle_p50_ms"]
            rows.append(text)
            print("media", json.dumps(text), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("burst", "media"), action="append")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--burst", type=int, default=1500)
    ap.add_argument("--client", choices=("c", "python"), default="c", help="burst: the client")
    ap.add_argument("--out", default="/tmp/bench_floors.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "burst" in (args.only or ("burst", "media")):
            results["burst_python"] = burst_floor("refuser", args, Path(tmp))
            results["burst_haproxy"] = burst_floor("haproxy_refuser", args, Path(tmp))
        if "media" in (args.only or ("burst", "media")):
            results["media"] = media_floor(args, Path(tmp))
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
