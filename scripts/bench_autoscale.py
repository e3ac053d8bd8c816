#!/usr/bin/env python
"""An image burst at a multiple of one encoder's capacity, served by a fixed encoder pool and
by an autoscaled one (min 1, max the fixed size): TTFT percentiles and encoder worker-seconds.

Each arm serves the tiny test model with its encoder slowed (`slowdown`: a sleep per step, so
the 2-core host is not what limits it) and one item per encoder batch, so one worker's capacity
is 1 / (its encode time). The capacity is measured at idle in the first arm; both arms get the
same seeded Poisson burst at `--factor` times it for `--burst-s`, then idle until the autoscaled
pool is back at its floor (each arm first serves a few idle requests, as a running service
has: the router's cost model is calibrated; an autoscaled pool that grew for them is let
shrink back first). Worker-seconds integrate the encoder workers holding resources
(routed, starting or draining), sampled from /health?verbose=1 every SAMPLE_S, over the same
window in both arms.

Usage: scripts/bench_autoscale.py [--factor 3] [--burst-s 40] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx

from benchkit.http_client import replay_cluster, sequential_cluster
from benchkit.live_server import served
from benchkit.stats import pcts
from benchkit.workload import make_workload
from cluster.config import builtin_model, load_config

SAMPLE_S = 0.5
MAX_TOKENS = 4


def arm_config(workers: int, autoscale: bool, slowdown: float, down_delay_s: float):
    scaling = {
        "min_workers": 1,
        "max_workers": workers,
        "target_utilization": 0.8,
        "up_delay_s": 1.0,
        "down_delay_s": down_delay_s,
    }
    encoder = {
        "num_workers": 1 if autoscale else workers,
        "max_batch_size": 1,
        "slowdown": [slowdown] * workers,
        "autoscaling": scaling if autoscale else None,
    }
    return load_config().replace(model=builtin_model("tiny-llava"), encoder=encoder)


class PoolSampler:
    """Encoder workers holding resources over time, from /health?verbose=1."""

    def __init__(self, root: str):
        self.root, self.samples, self._stop = root, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                body = http.get(f"{self.root}/health", params={"verbose": 1}).json()
                pool = body["fleet"]["pools"]["encoder"]
                held = pool["routed"] + pool["starting"] + pool["draining"]
                self.samples.append((time.monotonic(), held, pool["routed"]))
                self._stop.wait(SAMPLE_S)

    def __enter__(self) -> PoolSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def worker_seconds(self) -> float:
        pairs = zip(self.samples, self.samples[1:])
        return sum((b[0] - a[0]) * a[1] for a, b in pairs)

    def routed_at_least(self, n: int, since_s: float) -> float | None:
        """Seconds from `since_s` until `n` encoders were routed to (None: never)."""
        return next((t - since_s for t, _, routed in self.samples if routed >= n), None)


def encode_ms(base: str, model: str) -> float:
    """The median idle encode compute of a single-image request (the server's timings)."""
    reqs = make_workload(6, 0, 1.0, seed=99)
    results = asyncio.run(sequential_cluster(base + "/chat/completions", reqs, model, 1, "idle"))
    return statistics.median(r.timings["encode_compute_ms"] for r in results[1:])


def settle(root: str, workers: int, within_s: float = 300.0) -> None:
    """Wait until `workers` encoders are routed to and none starts or drains."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        pool = httpx.get(f"{root}/health", params={"verbose": 1}, timeout=30).json()
        pool = pool["fleet"]["pools"]["encoder"]
        if (pool["routed"], pool["starting"], pool["draining"]) == (workers, 0, 0):
            return
        time.sleep(SAMPLE_S)
    raise SystemExit(f"the encoder pool did not settle at {workers} workers: {pool}")


def run_arm(cfg, capacity_rps: float | None, args) -> dict:
    with served(cfg) as base:
        root, model = base.removesuffix("/v1"), cfg.model.served_name
        measured = 1e3 / encode_ms(base, model)  # also calibrates the router's encode cost
        capacity_rps = capacity_rps or measured
        settle(root, cfg.encoder.num_workers)  # the warm-up may have grown an autoscaled pool
        rate = args.factor * capacity_rps
        reqs = make_workload(int(rate * args.burst_s), rate, 1.0, seed=args.seed)
        with PoolSampler(root) as pool:
            start = time.monotonic()
            results, _ = asyncio.run(
                replay_cluster(base + "/chat/completions", reqs, model, MAX_TOKENS, 512)
            )
            time.sleep(max(0.0, start + args.window_s - time.monotonic()))
        ttft_ms = [r.ttft_s * 1e3 for r in results]
        return {
            "capacity_rps": capacity_rps,
            "rate_rps": rate,
            "requests": len(results),
            "ttft_ms": pcts(ttft_ms),
            "worker_seconds": pool.worker_seconds(),
            "window_s": args.window_s,
            "peak_workers": max(s[1] for s in pool.samples),
            "full_after_s": pool.routed_at_least(args.workers, start),
            "pool_over_time": [(round(t - start, 2), h) for t, h, _ in pool.samples],
        }


def recorded() -> dict:
    """Where and when: a result file carries its commit and date (the notebook plots one)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "by": " ".join(["scripts/bench_autoscale.py", *sys.argv[1:]]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3, help="the fixed pool; the autoscaled max")
    parser.add_argument("--factor", type=float, default=3.0, help="burst rate / one encoder's")
    parser.add_argument("--burst-s", type=float, default=40.0)
    parser.add_argument("--window-s", type=float, default=90.0, help="worker-seconds window")
    parser.add_argument("--slowdown", type=float, default=100.0)
    parser.add_argument("--down-delay-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    fixed = run_arm(arm_config(args.workers, False, args.slowdown, args.down_delay_s), None, args)
    auto_cfg = arm_config(args.workers, True, args.slowdown, args.down_delay_s)
    auto = run_arm(auto_cfg, fixed["capacity_rps"], args)
    result = {"recorded": recorded(), "args": vars(args), "fixed": fixed, "autoscaled": auto}
    for name, arm in (("fixed", fixed), ("autoscaled", auto)):
        t = arm["ttft_ms"]
        print(
            f"{name:>10}: TTFT p50 {t['p50']:.0f} ms, p90 {t['p90']:.0f}, p99 {t['p99']:.0f}; "
            f"{arm['worker_seconds']:.0f} encoder worker-s over {arm['window_s']:.0f} s; "
            f"all {args.workers} routed after {arm['full_after_s']} s"
        )
    print(f"burst: {fixed['rate_rps']:.1f} req/s ({args.factor}x {fixed['capacity_rps']:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
