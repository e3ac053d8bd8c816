#!/usr/bin/env python
"""Routing on the live cluster: least_loaded vs joint with one slowed prefill worker, in
alternating rounds, then the simulator replaying each joint run's trace, calibrated from
that run's trace.

    .venv/bin/python scripts/bench_routing_live.py --out-dir /tmp/epd_routing_live --rounds 3
    # saved runs only:
    .venv/bin/python scripts/bench_routing_live.py --out-dir /tmp/epd_routing_live --analyze

1. Per round, both policies (round 0: least_loaded then joint, round 1: joint then
   least_loaded, ...), each on a fresh fleet (--config; default the tiny model): 2 encoders,
   --prefill-workers prefill workers (default 2; the last one slowed --slowdown times, and all
   of them stretched --stretch times to emulate accelerators), 1 decode worker. Warm-up (3
   sequential requests, then 8 at once so the prefill workers run and the router calibrates
   them), a closed-loop capacity probe
   (reported; sets the rate with --rate 0), then the same seeded Poisson workload at --rate
   (default 7 req/s). Records client TTFT (scheduled send -> first SSE content chunk), each
   response's server `timings`, and the fleet's trace (which carries the measured stage times).
   Background load on this shared host changes between phases, so each round's joint /
   least_loaded ratio is reported, and their median: alternating the order cancels drift.
2. Per joint run, a SimCluster calibrated from its trace (router.sim.variability.fit_trace:
   prefill cost free of host contention, the slowed worker's measured speed, contention per
   request in flight, lognormal service noise, ingress overhead; encode and decode step from
   the /metrics histograms). The trace is replayed with policy joint at its recorded pace
   (--sim-seeds noise seeds, averaged) and its load-phase requests compared with what was
   measured. For reference, the deterministic simulator of the last report (no variability,
   the mean overhead added) and a diagnostic replay with each request's measured prefill time.
3. Writes summary.json (and per-run records) to --out-dir and prints tables.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from benchkit.cpu import CpuWatch
from benchkit.http_client import Result, chat_body, replay_cluster, sequential_cluster, stream_one
from benchkit.live_server import fleet, own_ray, require_free_port
from benchkit.routing.config import POLICIES, base_config, cluster_config, parse_args
from benchkit.routing.report import print_overall, print_round, round_summary
from benchkit.routing.runs import saved_rounds
from benchkit.server_metrics import metrics_snapshot, stage_mean_ms
from benchkit.workload import Req, make_workload

FILLER = (
    "context note detail river mountain window garden music paper story light street morning"
    " winter colour market table simple quiet bright"
).split()
STAGES = ("encode", "encode_queue", "prefill", "prefill_queue", "decode_step")
WARM_SEQUENTIAL = 3  # warm-up requests sent one at a time before the rest at once


def make_requests(
    n: int, rate: float, image_fraction: float, seed: int, words: tuple[int, int]
) -> list[Req]:
    """bench_load's Poisson workload, each prompt lengthened by a seeded number of filler
    words."""
    reqs, rng = make_workload(n, rate, image_fraction, seed), random.Random(seed + 7)
    for r in reqs:
        r.prompt = (
            " ".join(rng.choice(FILLER) for _ in range(rng.randint(*words))) + ". " + r.prompt
        )
    return reqs


async def closed_loop(url: str, reqs: list[Req], model: str, args) -> float:
    """Requests/s with --probe-concurrency clients each sending back to back."""
    queue, bar = list(reversed(reqs)), tqdm(total=len(reqs), desc="capacity probe", unit="req")
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker():
            while queue:
                body = chat_body(queue.pop(), model, args.max_tokens)
                await stream_one(client, url, body, 0.0, time.perf_counter())
                bar.update()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.probe_concurrency)))
    bar.close()
    return len(reqs) / (time.perf_counter() - t0)


async def warm_up(url: str, reqs: list[Req], model: str, args) -> list[Result]:
    """A few sequential requests, then the rest at once (both prefill workers get some)."""
    first, rest = reqs[:WARM_SEQUENTIAL], reqs[WARM_SEQUENTIAL:]
    out = await sequential_cluster(url, first, model, args.max_tokens, "warm-up")
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        bodies = [chat_body(r, model, args.max_tokens) for r in rest]
        return out + list(
            await asyncio.gather(*(stream_one(client, url, b, 0.0, t0) for b in bodies))
        )


def offer_rate(args, capacity_rps: float) -> None:
    """With --rate 0 the first fleet sets the rate all are offered: --load x its capacity."""
    if not args.rate:
        args.rate = args.load * capacity_rps
        print(
            f"measured capacity {capacity_rps:.2f} req/s -> offering {args.rate:.2f} req/s",
            flush=True,
        )


def run_phases(args, base: str, model: str, reqs, warm, probe) -> dict:
    """Warm-up, capacity probe and load on the fleet at `base` (its /v1 URL)."""
    url, root = f"{base}/chat/completions", base.removesuffix("/v1")
    warm_res = asyncio.run(warm_up(url, warm, model, args))
    # every fleet gets the probe: the same history before the load
    capacity = asyncio.run(closed_loop(url, probe, model, args))
    offer_rate(args, capacity)
    timed = [Req(r.idx, r.arrival_s / args.rate, r.prompt, r.png) for r in reqs]  # were at 1/s
    before = metrics_snapshot(root)
    with CpuWatch() as watch:
        results, wall = asyncio.run(
            replay_cluster(url, timed, model, args.max_tokens, args.concurrency)
        )
    after = metrics_snapshot(root)
    return {
        "records": [
            {"image": r.png is not None, "client_ttft_ms": res.ttft_s * 1e3, **res.timings}
            for r, res in zip(reqs, results)
        ],
        "wall_s": wall,
        "capacity_rps": capacity,
        "other_cpu_s": watch.other_cpu_s,
        "warm_timings": [w.timings for w in warm_res[WARM_SEQUENTIAL:]],
        "stage_ms": {s: stage_mean_ms(before, after, s) for s in STAGES},
    }


def run_policy(
    args, policy: str, tag: str, reqs: list[Req], warm: list[Req], probe: list[Req]
) -> dict:
    """One phase: a fresh fleet for `policy`, warm-up, probe, load; saved as run_{tag}.json."""
    out_dir, trace = Path(args.out_dir), Path(args.out_dir) / f"trace_{tag}.jsonl"
    trace.unlink(missing_ok=True)  # the writer appends
    config = cluster_config(args, policy, trace)
    with fleet(config) as base:
        measured = run_phases(args, base, config.model.served_name, reqs, warm, probe)
    run = {
        "policy": policy,
        "tag": tag,
        "trace": str(trace),
        "slow_prefill": args.prefill_workers - 1,
        **measured,
    }
    (out_dir / f"run_{tag}.json").write_text(json.dumps(run))
    return run


def live_rounds(args) -> list[dict[str, dict]]:
    from cluster.prepare import ensure_model

    require_free_port(args.port)
    ensure_model(base_config(args))
    reqs = make_requests(args.num_requests, 1.0, args.image_fraction, args.seed, args.words)
    warm = make_requests(11, 1.0, args.image_fraction, args.seed + 1, args.words)
    probe = make_requests(args.probe_requests, 1.0, args.image_fraction, args.seed + 2, args.words)
    rounds = []
    # logical CPUs: one per actor (2 encoders, decode, ingress, the prefill workers) and spare
    with own_ray(num_cpus=max(8, 4 + args.prefill_workers)):
        for k in range(args.rounds):
            # alternate which policy goes first: background drift hits both alike
            order = POLICIES if k % 2 == 0 else POLICIES[::-1]
            rounds.append(
                {pol: run_policy(args, pol, f"{pol}_r{k}", reqs, warm, probe) for pol in order}
            )
    return rounds


def main(argv=None) -> int:
    args = parse_args(argv, " ".join(__doc__.split("\n\n")[0].split()))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    rounds = saved_rounds(args) if args.analyze else live_rounds(args)
    summaries = [round_summary(runs, args) for runs in rounds]
    p99 = [r["ratios"]["p99"] for r in summaries]
    summary = {
        "args": vars(args),
        "offered_rps": round(args.rate, 3),
        "rounds": summaries,
        "p99_ratio_median": round(statistics.median(p99), 3),
    }
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    for k, s in enumerate(summaries):
        print_round(k, s)
    print_overall(summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
