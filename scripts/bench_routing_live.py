#!/usr/bin/env python
"""Routing on the live cluster (issue #4): least_loaded vs joint with one slowed prefill
worker, then the simulator replaying the joint run's trace, calibrated from that run.

    .venv/bin/python scripts/bench_routing_live.py --out-dir /tmp/epd_routing_live

1. Per policy (least_loaded, then joint), a fresh fleet of the tiny default model: 2 encoders,
   2 prefill workers (slowdown [1, S]), 1 decode worker. Warm-up (3 sequential requests, then
   8 at once so both prefill workers run and the router calibrates both), a closed-loop
   capacity probe (reported; sets the rate with --rate 0), then the same seeded Poisson
   workload at --rate (default 7 req/s, fixed: the probe measured 8-20 req/s on this shared
   2-core host depending on other jobs, ~10 when busy; 7 is ~70% of that). Records client TTFT
   (scheduled send -> first SSE content chunk) and each response's server `timings`.
2. A SimCluster calibrated from the joint run only (`calibrate`): prefill = least-squares fit
   of prefill_ms (responses) on num_prompt_tokens (trace) for worker 0; worker 1's speed =
   sum of the fit's predictions / sum of its measured times (the slowdown is measured); encode
   and decode step = mean of the /metrics stage histograms over the load phase. Not in the
   simulator, so added as a fixed overhead per request class: admission (JSON, PNG decoding,
   tokenising), Ray calls and the embeddings hand-over = mean of server TTFT - encode (queue +
   compute) - prefill queue - prefill, plus the encoder batcher's max_wait_ms for images; the
   HTTP + Serve-proxy hop = mean of client - server TTFT. The trace is replayed with policy
   joint at its recorded pace; the load-phase requests are compared. A diagnostic replay then
   gives each request the prefill time it really took (queueing and routing still simulated).
3. Writes summary.json (and per-request records) to --out-dir and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load as bl  # noqa: E402  (scripts/bench_load.py: workload, SSE client, CpuWatch)
from cluster.config import load_config  # noqa: E402

FILLER = ("context note detail river mountain window garden music paper story light street "
          "morning winter colour market table simple quiet bright").split()
POLICIES = ("least_loaded", "joint")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "epd_routing_live"))
    p.add_argument("--slowdown", type=float, default=4.0, help="prefill worker 1's slowdown factor S")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=7.0, help="req/s to offer; 0: --load x the first fleet's measured capacity")
    p.add_argument("--load", type=float, default=0.75, help="with --rate 0: fraction of the measured capacity to offer")
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--words", type=lambda s: tuple(int(x) for x in s.split(",")), default=(40, 550),
                   help="filler words per prompt, MIN,MAX (~2.1 tokens each: prefill dominates the stage costs)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight (bench_load's cap)")
    p.add_argument("--probe-requests", type=int, default=60)
    p.add_argument("--probe-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- live cluster

def make_requests(n: int, rate: float, image_fraction: float, seed: int, words: tuple[int, int]) -> list[bl.Req]:
    """bench_load's Poisson workload, each prompt lengthened by a seeded number of filler words."""
    reqs, rng = bl.make_workload(n, rate, image_fraction, seed), random.Random(seed + 7)
    for r in reqs:
        r.prompt = " ".join(rng.choice(FILLER) for _ in range(rng.randint(*words))) + ". " + r.prompt
    return reqs


def cluster_config(args, policy: str, trace: Path):
    return load_config().replace(
        encoder={"num_workers": 2}, prefill={"num_workers": 2, "slowdown": [1.0, args.slowdown]},
        decode={"num_workers": 1}, router={"policy": policy}, server={"port": args.port, "trace_path": str(trace)})


def metrics_snapshot(root: str) -> dict[str, float]:
    text = httpx.get(f"{root}/metrics", timeout=30).text
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))}


def stage_mean_ms(before: dict, after: dict, stage: str) -> float | None:
    key = 'epd_stage_latency_seconds_{}{{stage="%s"}}' % stage
    n = after.get(key.format("count"), 0) - before.get(key.format("count"), 0)
    return (after[key.format("sum")] - before.get(key.format("sum"), 0)) / n * 1e3 if n else None


async def closed_loop(url: str, reqs: list[bl.Req], model: str, args) -> float:
    """Requests/s with --probe-concurrency clients each sending back to back."""
    queue, bar = list(reversed(reqs)), tqdm(total=len(reqs), desc="capacity probe", unit="req")
    async with httpx.AsyncClient(timeout=300) as client:
        async def worker():
            while queue:
                await bl.stream_one(client, url, bl.chat_body(queue.pop(), model, args.max_tokens), 0.0, time.perf_counter())
                bar.update()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.probe_concurrency)))
    bar.close()
    return len(reqs) / (time.perf_counter() - t0)


async def warm_up(url: str, reqs: list[bl.Req], model: str, args) -> list[bl.Result]:
    """3 sequential requests, then the rest at once (both prefill workers get some)."""
    out = await bl.sequential_cluster(url, reqs[:3], model, args, "warm-up")
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        return out + list(await asyncio.gather(*(bl.stream_one(client, url, bl.chat_body(r, model, args.max_tokens), 0.0, t0)
                                                 for r in reqs[3:])))


def run_policy(args, policy: str, reqs: list[bl.Req], warm: list[bl.Req], probe: list[bl.Req]) -> dict:
    from cluster.cli import start

    out_dir, trace = Path(args.out_dir), Path(args.out_dir) / f"trace_{policy}.jsonl"
    trace.unlink(missing_ok=True)  # the writer appends
    base = start(cluster_config(args, policy, trace))
    url, root, model = f"{base}/chat/completions", base.removesuffix("/v1"), "tiny-llava"
    warm_res = asyncio.run(warm_up(url, warm, model, args))
    capacity = asyncio.run(closed_loop(url, probe, model, args))  # both fleets get it: the same history
    if not args.rate:  # the first fleet (least_loaded) sets the rate both are offered
        args.rate = args.load * capacity
        print(f"measured capacity {capacity:.2f} req/s -> offering {args.rate:.2f} req/s", flush=True)
    timed = [bl.Req(r.idx, r.arrival_s / args.rate, r.prompt, r.png) for r in reqs]  # reqs are at rate 1
    before = metrics_snapshot(root)
    with bl.CpuWatch() as watch:
        results, wall = asyncio.run(bl.replay_cluster(url, timed, model, args))
    after = metrics_snapshot(root)
    records = [{"image": r.png is not None, "client_ttft_ms": res.ttft_s * 1e3, **res.timings} for r, res in zip(reqs, results)]
    (out_dir / f"requests_{policy}.json").write_text(json.dumps(records))
    return {"policy": policy, "trace": str(trace), "records": records, "wall_s": wall, "capacity_rps": capacity, "other_cpu_s": watch.other_cpu_s,
            "warm_timings": [w.timings for w in warm_res[3:]],
            "stage_ms": {s: stage_mean_ms(before, after, s) for s in ("encode", "encode_queue", "prefill", "prefill_queue", "decode_step")}}


def pcts(x) -> dict:
    x = np.asarray(x, dtype=float)
    return {f"p{q}": round(float(np.percentile(x, q)), 2) for q in (50, 90, 99)} | {"mean": round(float(x.mean()), 2)}


def read_trace(path: str) -> list[dict]:
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["arrival_s"])  # load_trace's order (stable sort)


def join(trace: list[dict], timings: list[dict]) -> list[tuple[dict, dict]]:
    """(trace record, response timings) pairs: both carry the same server TTFT (rounded to us)."""
    by_ttft = {r["ttft_ms"]: r for r in trace}
    return [(by_ttft[round(t["ttft_ms"], 3)], t) for t in timings if round(t["ttft_ms"], 3) in by_ttft]


def live_summary(run: dict) -> dict:
    recs = run["records"]
    pairs = join(read_trace(run["trace"]), recs)
    return {"client_ttft_ms": pcts([r["client_ttft_ms"] for r in recs]), "server_ttft_ms": pcts([r["ttft_ms"] for r in recs]),
            "estimate_abs_error_ms": round(float(np.mean([abs(r["estimated_ttft_ms"] - r["ttft_ms"]) for r in recs])), 2),
            "estimate_signed_error_ms": round(float(np.mean([r["estimated_ttft_ms"] - r["ttft_ms"] for r in recs])), 2),
            "share_on_slow_prefill": round(float(np.mean([t["route"][1] == 1 for t, _ in pairs])), 3),
            "wall_s": round(run["wall_s"], 1), "capacity_rps": round(run["capacity_rps"], 2), "other_cpu_s": round(run["other_cpu_s"], 1), "stage_ms": run["stage_ms"]}


# ----------------------------------------------------------------------------- simulator

def fit_prefill(pairs: list[tuple[dict, dict]], slowdown: float) -> tuple[float, float, float, dict]:
    """Worker 0: prefill_ms = a + b * tokens (least squares); worker 1: speed = fit / measured."""
    pts = {p: [(t["num_prompt_tokens"], m["prefill_ms"]) for t, m in pairs if t["route"][1] == p] for p in (0, 1)}
    x, y = np.array(pts[0], dtype=float).T
    b, a = np.polyfit(x, y, 1)
    if a < 0:  # a negative intercept: through the origin instead
        a, b = 0.0, float((x * y).sum() / (x * x).sum())
    x1, y1 = np.array(pts[1] or [(0, 0)], dtype=float).T  # under 3 samples: the configured factor
    speed1 = float((a + b * x1).sum() / y1.sum()) if len(pts[1]) >= 3 else 1.0 / slowdown
    return a, max(b, 1e-6), speed1, {"samples": {str(p): len(v) for p, v in pts.items()}}


def calibrate(run: dict, pairs: list[tuple[dict, dict]], args):
    from router.sim import EncodeCost, SimCluster, SimCosts

    cfg = cluster_config(args, "joint", Path(run["trace"]))
    cal_pairs = join(read_trace(run["trace"]), run["warm_timings"]) + pairs  # warm-up burst + load phase
    a, b, speed1, info = fit_prefill(cal_pairs, args.slowdown)
    encode_ms = run["stage_ms"]["encode"] or 0.0
    costs = SimCosts(encode={**SimCosts().encode, "image": EncodeCost(encode_ms, 0.0, 1.0)},
                     encode_max_batch=cfg.encoder.max_batch_size, prefill_fixed_ms=a, prefill_tokens_per_ms=1.0 / b,
                     decode_step_ms=run["stage_ms"]["decode_step"] or 1.0, decode_step_per_seq_ms=0.0,
                     decode_max_batch=cfg.decode.max_batch_size)
    cluster = SimCluster.build(2, 2, 1, prefill_speeds=[1.0, speed1], costs=costs, name="live-calibrated")
    resid = {k: [m["ttft_ms"] - m["encode_ms"] - m["prefill_queue_ms"] - m["prefill_ms"] for t, m in pairs
                 if bool(t["items"]) == (k == "image")] for k in ("text", "image")}
    overhead = {"text": float(np.mean(resid["text"])), "image": float(np.mean(resid["image"])) + cfg.encoder.max_wait_ms}
    http_ms = float(np.mean([m["client_ttft_ms"] - m["ttft_ms"] for _, m in pairs]))
    doc = {"prefill_fixed_ms": round(a, 3), "prefill_ms_per_token": round(b, 5), "prefill_speed_worker1": round(speed1, 3),
           "encode_ms_per_batch": round(encode_ms, 3), "decode_step_ms": round(costs.decode_step_ms, 3),
           "overhead_ms": {k: round(v, 2) for k, v in overhead.items()}, "http_hop_ms": round(http_ms, 2),
           "residual_ms": {k: pcts(v) for k, v in resid.items()}, **info}  # how far from "fixed" it is
    return cluster, overhead, http_ms, doc


def service_ratios(pairs, cluster) -> dict[int, float]:
    """Per load-phase trace record (by id): its measured prefill time / the calibrated model's.
    On a shared 2-core host these vary a lot (processor sharing with the other stages and
    other people's jobs); the diagnostic replay feeds them to the simulator."""
    a, tpm = cluster.costs.prefill_fixed_ms, cluster.costs.prefill_tokens_per_ms
    return {id(t): m["prefill_ms"] * cluster.prefill[t["route"][1]].speed / (a + t["num_prompt_tokens"] / tpm) for t, m in pairs}


def replay(cluster, trace: list[dict], path: Path, args) -> list[float]:
    """Simulated TTFT of each trace record (in arrival order), replayed at the recorded pace."""
    from router.sim import load_trace, simulate

    path.write_text("".join(json.dumps(rec) + "\n" for rec in trace))
    sim = simulate(cluster, load_trace(path), "joint", seed=args.seed)
    return sim.ttft_ms.tolist()


def compare(pairs, sim_of: dict, overhead: dict, http_ms: float) -> dict:
    raw = np.array([sim_of[id(t)] for t, _ in pairs])
    sim_server = raw + np.array([overhead["image" if t["items"] else "text"] for t, _ in pairs])
    out = {"sim_raw_ttft_ms": pcts(raw)}  # without the overheads
    for side, measured, simulated in (("server", [m["ttft_ms"] for _, m in pairs], sim_server),
                                      ("client", [m["client_ttft_ms"] for _, m in pairs], sim_server + http_ms)):
        meas, simd = pcts(measured), pcts(simulated)
        err = {k: round((simd[k] - meas[k]) / meas[k], 3) for k in ("mean", "p90")}
        out[side] = {"measured": meas, "simulated": simd, "rel_error": err, "within_20pct": all(abs(e) <= 0.2 for e in err.values())}
    return out


def validate_sim(run: dict, args) -> dict:
    trace = read_trace(run["trace"])
    pairs = sorted(join(trace, run["records"]), key=lambda p: p[0]["arrival_s"])
    cluster, overhead, http_ms, doc = calibrate(run, pairs, args)
    out_dir = Path(args.out_dir)
    out = {"calibration": doc, "requests_compared": len(pairs),
           "measured_modelled_part_ms": pcts([m["encode_ms"] + m["prefill_queue_ms"] + m["prefill_ms"] for _, m in pairs])}
    ids = [id(rec) for rec in trace]
    out |= compare(pairs, dict(zip(ids, replay(cluster, trace, out_dir / "sim_trace_joint.jsonl", args))), overhead, http_ms)
    # Diagnostic, not a prediction: each load-phase request's prompt scaled so that its simulated
    # prefill takes what the live one measured (queueing and routing are still the simulator's)
    ratio = service_ratios(pairs, cluster)
    varied = [rec | {"num_prompt_tokens": max(1, round(rec["num_prompt_tokens"] * ratio.get(id(rec), 1.0)))} for rec in trace]
    sim_of = dict(zip(ids, replay(cluster, varied, out_dir / "sim_trace_joint_measured_service.jsonl", args)))
    r = np.array(list(ratio.values()))
    return out | {"measured_service_variant": {"service_ratio": pcts(r) | {"cv": round(float(r.std() / r.mean()), 3)},
                                               **compare(pairs, sim_of, overhead, http_ms)}}


# ----------------------------------------------------------------------------- report

def print_table(s: dict) -> None:
    print(f"\n{'TTFT ms (client)':<22}{'p50':>8}{'p90':>8}{'p99':>8}{'mean':>8}   server p99  |est-meas|  on slow  other CPU-s  capacity")
    for pol in POLICIES:
        c, l = s["live"][pol]["client_ttft_ms"], s["live"][pol]
        print(f"{pol:<22}{c['p50']:>8.1f}{c['p90']:>8.1f}{c['p99']:>8.1f}{c['mean']:>8.1f}   {l['server_ttft_ms']['p99']:>10.1f}"
              f"{l['estimate_abs_error_ms']:>11.1f}{l['share_on_slow_prefill']:>9.0%}{l['other_cpu_s']:>11.1f}{l['capacity_rps']:>8.1f}/s")
    r = s["ratios"]
    print(f"joint / least_loaded: p50 {r['p50']:.2f}  p90 {r['p90']:.2f}  p99 {r['p99']:.2f}   "
          f"(target p99 <= 0.70: {'met' if r['target_met'] else 'NOT met'})")
    v = s["simulator"]
    print(f"\n{'simulator vs measured':<22}{'mean':>8}{'p90':>8}   rel. error mean / p90   ({v['requests_compared']} requests)")
    h = v["measured_service_variant"]
    for side in ("server", "client"):
        m = v[side]["measured"]
        print(f"{'measured ' + side:<22}{m['mean']:>8.1f}{m['p90']:>8.1f}")
        for name, x in ((f"simulated {side}", v[side]), ("  (measured service)", h[side])):
            sim, e = x["simulated"], x["rel_error"]
            print(f"{name:<22}{sim['mean']:>8.1f}{sim['p90']:>8.1f}   {e['mean']:+.1%} / {e['p90']:+.1%}"
                  f"   ({'within' if x['within_20pct'] else 'NOT within'} 20%)")
    print("measured / calibrated prefill time per request:", json.dumps(h["service_ratio"]))
    print("calibration:", json.dumps(v["calibration"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray
    from ray import serve

    from cluster.cli import ensure_model

    with socket.socket() as sock:
        port_taken = sock.connect_ex(("127.0.0.1", args.port)) == 0
    if port_taken:
        sys.exit(f"port {args.port} is in use (another engineer's Serve?); pass --port")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    ensure_model(load_config())
    reqs = make_requests(args.num_requests, 1.0, args.image_fraction, args.seed, args.words)
    warm = make_requests(11, 1.0, args.image_fraction, args.seed + 1, args.words)
    probe = make_requests(args.probe_requests, 1.0, args.image_fraction, args.seed + 2, args.words)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)  # our own Ray, never a shared one
    try:
        runs = {pol: run_policy(args, pol, reqs, warm, probe) for pol in POLICIES}
    finally:
        serve.shutdown()
        ray.shutdown()
    live = {pol: live_summary(run) for pol, run in runs.items()}
    ll, jt = live["least_loaded"]["client_ttft_ms"], live["joint"]["client_ttft_ms"]
    ratios = {k: round(jt[k] / ll[k], 3) for k in ("p50", "p90", "p99")}
    summary = {"args": vars(args), "offered_rps": round(args.rate, 3), "live": live,
               "ratios": ratios | {"target_met": ratios["p99"] <= 0.70}, "simulator": validate_sim(runs["joint"], args)}
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
