#!/usr/bin/env python
"""How long a config change on a running epd takes, and what it does to streams in flight:
`cluster.cli.start` with a new config on a cluster already serving it, timed until every
answer of /health names the new config and a chat gets its answer. Three kinds of change,
each `--repeats` times (flipping between two values):

  key    a new API key (ingress settings only)
  live   a new decode slowdown (a worker setting that running workers take in place)
  fleet  another decode max_batch_size (the workers are rebuilt)

Each change is made while a long stream is under way: how many of its tokens came, and when
it ended, are recorded beside the change's times. Runs epd's
random-weight tiny-llava on a Ray of its own; run it against another checkout with
PYTHONPATH=<checkout>:scripts to compare.

    .venv/bin/python scripts/bench_redeploy.py [--repeats 3] [--out redeploy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx
import ray

from cluster.cli import start
from cluster.config import builtin_model, load_config
from cluster.prepare import ensure_model

CHANGES = {
    "key": lambda i: {"server": {"api_key": f"sk-bench-{i}"}},
    "live": lambda i: {"decode": {"slowdown": [1.0 + (i % 2)]}},
    "fleet": lambda i: {"decode": {"max_batch_size": 32 + 16 * (i % 2)}},
}


def base_config(port: int):
    config = load_config().replace(model=builtin_model("tiny-llava"), server={"port": port})
    return ensure_model(config)


def _headers(config) -> dict:
    key = config.server.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chat(http: httpx.Client, config, max_tokens: int, stream: bool = False) -> int:
    """Completion tokens of one greedy chat."""
    body = {
        "model": config.model.served_name,
        "messages": [{"role": "user", "content": "Count slowly"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    if not stream:
        r = http.post("/v1/chat/completions", json=body, headers=_headers(config))
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = 0
    with http.stream("POST", "/v1/chat/completions", json=body, headers=_headers(config)) as r:
        for line in r.iter_lines():
            if '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return usage


def _serving(http: httpx.Client, config) -> bool:
    """Whether 5 answers of /health in a row name `config`."""
    own = config.fingerprint()
    for _ in range(5):
        ingress = http.get("/health", params={"verbose": 1}).json().get("ingress", {})
        if ingress.get("config_sha1") != own:
            return False
    return True


STREAM_TOKENS = 800


class InFlight:
    """A long greedy stream under `config`, begun before a change."""

    def __init__(self, http: httpx.Client, config):
        self.tokens: int | None = None  # None: it failed
        self.ended = 0.0
        self._thread = threading.Thread(target=self._run, args=(http, config))
        self._thread.start()
        time.sleep(0.5)  # under way

    def _run(self, http: httpx.Client, config) -> None:
        try:
            self.tokens = _chat(http, config, STREAM_TOKENS, stream=True)
        except httpx.HTTPError:
            pass
        self.ended = time.perf_counter()

    def result(self, changed_at: float) -> tuple[int | None, float]:
        """Its tokens (None if it failed) and when it ended, in s after `changed_at`."""
        self._thread.join()
        return self.tokens, self.ended - changed_at


def change(http: httpx.Client, config) -> tuple[float, float]:
    """Seconds until the new config serves, and until it answered a chat."""
    started = time.perf_counter()
    start(config)
    while not _serving(http, config):
        time.sleep(0.1)
    serving_s = time.perf_counter() - started
    assert _chat(http, config, 4) == 4
    return serving_s, time.perf_counter() - started


def run(repeats: int, port: int, kinds: list[str]) -> dict:
    config = base_config(port)
    start(config)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    while not _serving(http, config):
        time.sleep(0.2)
    results: dict = {}
    for kind in kinds:
        sections, rows = CHANGES[kind], []
        for i in range(1, repeats + 1):
            stream = InFlight(http, config)
            config = base_config(port).replace(**sections(i))
            changed_at = time.perf_counter()
            serving_s, answered_s = change(http, config)
            tokens, ended_s = stream.result(changed_at)
            rows.append(
                {
                    "serving_s": serving_s,
                    "answered_s": answered_s,
                    "stream_tokens": tokens,
                    "stream_ended_s": ended_s,
                }
            )
            print(
                f"{kind} #{i}: serving {serving_s:.2f} s, answered {answered_s:.2f} s; the stream "
                f"begun before it: {tokens} of {STREAM_TOKENS} tokens, ended at {ended_s:.2f} s",
                flush=True,
            )
        results[kind] = {
            "rows": rows,
            "median_serving_s": statistics.median(r["serving_s"] for r in rows),
            "median_answered_s": statistics.median(r["answered_s"] for r in rows),
        }
        config = base_config(port).replace(**sections(repeats))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--kinds", nargs="+", choices=list(CHANGES), default=list(CHANGES))
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        results = run(args.repeats, args.port, args.kinds)
    finally:
        from cluster.cli import stop

        stop()
        ray.shutdown()
    for kind, r in results.items():
        print(
            f"{kind}: median {r['median_serving_s']:.2f} s to serve, "
            f"{r['median_answered_s']:.2f} s to answer"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
