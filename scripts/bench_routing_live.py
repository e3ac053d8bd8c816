#!/usr/bin/env python
"""Routing on the live cluster (issue #4): least_loaded vs joint with one slowed prefill
worker, in alternating rounds, then the simulator replaying each joint run's trace,
calibrated from that run's trace.

    .venv/bin/python scripts/bench_routing_live.py --out-dir /tmp/epd_routing_live --rounds 3
    .venv/bin/python scripts/bench_routing_live.py --out-dir /tmp/epd_routing_live --analyze   # saved runs only

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

import argparse
import asyncio
import json
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load as bl  # noqa: E402  (scripts/bench_load.py: workload, SSE client, CpuWatch)

from cluster.config import builtin_model, load_config  # noqa: E402

FILLER = (
    "context note detail river mountain window garden music paper story light street morning winter colour market table simple quiet bright"
).split()
POLICIES = ("least_loaded", "joint")
MODELS = (
    "variable",
    "measured host",
    "deterministic",
)  # simulator calibrations compared (see calibrate)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "epd_routing_live"))
    p.add_argument(
        "--config",
        default=None,
        help="base config (default: local_cpu.yaml with the random-weight tiny-llava)",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=2,
        help="prefill workers; the last one is the slowed one",
    )
    p.add_argument(
        "--slowdown", type=float, default=4.0, help="the last prefill worker's slowdown factor S"
    )
    p.add_argument(
        "--stretch",
        type=float,
        default=1.0,
        help="every prefill worker's device time x this (sleep: emulates accelerators, whose work "
        "dominates the serving overhead and is not shared between workers)",
    )
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument(
        "--rate",
        type=float,
        default=7.0,
        help="req/s to offer; 0: --load x the first fleet's measured capacity",
    )
    p.add_argument(
        "--load",
        type=float,
        default=0.75,
        help="with --rate 0: fraction of the measured capacity to offer",
    )
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument(
        "--words",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(40, 550),
        help="filler words per prompt, MIN,MAX (~2.1 tokens each: prefill dominates the stage costs)",
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--concurrency", type=int, default=64, help="most requests in flight (bench_load's cap)"
    )
    p.add_argument("--probe-requests", type=int, default=60)
    p.add_argument("--probe-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of both policies, alternating which goes first",
    )
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=5,
        help="noise seeds per simulator replay (results averaged)",
    )
    p.add_argument(
        "--analyze",
        action="store_true",
        help="no live runs: redo the tables from the runs saved in --out-dir",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- live cluster


def make_requests(
    n: int, rate: float, image_fraction: float, seed: int, words: tuple[int, int]
) -> list[bl.Req]:
    """bench_load's Poisson workload, each prompt lengthened by a seeded number of filler words."""
    reqs, rng = bl.make_workload(n, rate, image_fraction, seed), random.Random(seed + 7)
    for r in reqs:
        r.prompt = (
            " ".join(rng.choice(FILLER) for _ in range(rng.randint(*words))) + ". " + r.prompt
        )
    return reqs


def slowdowns(args) -> list[float]:
    """Per prefill worker: every one stretched alike, and one deliberately slowed worker, the last."""
    return [args.stretch] * (args.prefill_workers - 1) + [args.stretch * args.slowdown]


def base_config(args):
    """--config, else the default config with tiny-llava, the model the recorded runs used."""
    return (
        load_config(args.config)
        if args.config
        else load_config().replace(model=builtin_model("tiny-llava"))
    )


def cluster_config(args, policy: str, trace: Path):
    return base_config(args).replace(
        encoder={"num_workers": 2},
        prefill={"num_workers": args.prefill_workers, "slowdown": slowdowns(args)},
        decode={"num_workers": 1},
        router={"policy": policy},
        server={"port": args.port, "trace_path": str(trace)},
    )


def metrics_snapshot(root: str) -> dict[str, float]:
    text = httpx.get(f"{root}/metrics", timeout=30).text
    samples = (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    return {
        re.sub(r'model_name="[^"]*",?', "", k): float(v) for k, v in samples
    }  # one model per app


def stage_mean_ms(before: dict, after: dict, stage: str) -> float | None:
    key = "epd:stage_latency_seconds_{}" + f'{{{{stage="{stage}"}}}}'
    n = after.get(key.format("count"), 0) - before.get(key.format("count"), 0)
    return (after[key.format("sum")] - before.get(key.format("sum"), 0)) / n * 1e3 if n else None


async def closed_loop(url: str, reqs: list[bl.Req], model: str, args) -> float:
    """Requests/s with --probe-concurrency clients each sending back to back."""
    queue, bar = list(reversed(reqs)), tqdm(total=len(reqs), desc="capacity probe", unit="req")
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker():
            while queue:
                await bl.stream_one(
                    client,
                    url,
                    bl.chat_body(queue.pop(), model, args.max_tokens),
                    0.0,
                    time.perf_counter(),
                )
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
        return out + list(
            await asyncio.gather(
                *(
                    bl.stream_one(client, url, bl.chat_body(r, model, args.max_tokens), 0.0, t0)
                    for r in reqs[3:]
                )
            )
        )


def run_policy(
    args, policy: str, tag: str, reqs: list[bl.Req], warm: list[bl.Req], probe: list[bl.Req]
) -> dict:
    """One phase: a fresh fleet for `policy`, warm-up, probe, load; saved as run_{tag}.json."""
    from ray import serve

    from cluster.cli import start
    from cluster.controller import retire

    out_dir, trace = Path(args.out_dir), Path(args.out_dir) / f"trace_{tag}.jsonl"
    trace.unlink(missing_ok=True)  # the writer appends
    config = cluster_config(args, policy, trace)
    base = start(config)
    url, root, model = (
        f"{base}/chat/completions",
        base.removesuffix("/v1"),
        config.model.served_name,
    )
    try:
        warm_res = asyncio.run(warm_up(url, warm, model, args))
        capacity = asyncio.run(
            closed_loop(url, probe, model, args)
        )  # every fleet gets it: the same history
        if not args.rate:  # the first fleet sets the rate all are offered
            args.rate = args.load * capacity
            print(
                f"measured capacity {capacity:.2f} req/s -> offering {args.rate:.2f} req/s",
                flush=True,
            )
        timed = [
            bl.Req(r.idx, r.arrival_s / args.rate, r.prompt, r.png) for r in reqs
        ]  # reqs are at rate 1
        before = metrics_snapshot(root)
        with bl.CpuWatch() as watch:
            results, wall = asyncio.run(bl.replay_cluster(url, timed, model, args))
        after = metrics_snapshot(root)
    finally:
        serve.delete("epd")
        retire("epd")  # its fleet controller and workers too: the next fleet starts on a quiet host
    records = [
        {"image": r.png is not None, "client_ttft_ms": res.ttft_s * 1e3, **res.timings}
        for r, res in zip(reqs, results)
    ]
    run = {
        "policy": policy,
        "tag": tag,
        "trace": str(trace),
        "slow_prefill": args.prefill_workers - 1,
        "records": records,
        "wall_s": wall,
        "capacity_rps": capacity,
        "other_cpu_s": watch.other_cpu_s,
        "warm_timings": [w.timings for w in warm_res[3:]],
        "stage_ms": {
            s: stage_mean_ms(before, after, s)
            for s in ("encode", "encode_queue", "prefill", "prefill_queue", "decode_step")
        },
    }
    (out_dir / f"run_{tag}.json").write_text(json.dumps(run))
    return run


def pcts(x) -> dict:
    x = np.asarray(x, dtype=float)
    return {f"p{q}": round(float(np.percentile(x, q)), 2) for q in (50, 90, 99)} | {
        "mean": round(float(x.mean()), 2)
    }


def read_trace(path: str) -> list[dict]:
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["arrival_s"])  # load_trace's order (stable sort)


def join(trace: list[dict], timings: list[dict]) -> list[tuple[dict, dict]]:
    """(trace record, response timings) pairs: both carry the same server TTFT (rounded to us)."""
    by_ttft = {r["ttft_ms"]: r for r in trace}
    return [
        (by_ttft[round(t["ttft_ms"], 3)], t) for t in timings if round(t["ttft_ms"], 3) in by_ttft
    ]


def live_summary(run: dict) -> dict:
    recs = run["records"]
    pairs, slow = join(read_trace(run["trace"]), recs), run.get("slow_prefill", 1)
    fast = [
        m["prefill_ms"] / t["num_prompt_tokens"] * 1e3 for t, m in pairs if t["route"][1] == 0
    ]  # how slow the host was
    return {
        "fast_prefill_ms_per_1k_tokens": round(float(np.median(fast)), 1) if fast else None,
        "client_ttft_ms": pcts([r["client_ttft_ms"] for r in recs]),
        "server_ttft_ms": pcts([r["ttft_ms"] for r in recs]),
        "estimate_abs_error_ms": round(
            float(np.mean([abs(r["estimated_ttft_ms"] - r["ttft_ms"]) for r in recs])), 2
        ),
        "estimate_signed_error_ms": round(
            float(np.mean([r["estimated_ttft_ms"] - r["ttft_ms"] for r in recs])), 2
        ),
        "share_on_slow_prefill": round(
            float(np.mean([t["route"][1] == slow for t, _ in pairs])), 3
        ),
        "wall_s": round(run["wall_s"], 1),
        "capacity_rps": round(run["capacity_rps"], 2),
        "other_cpu_s": round(run["other_cpu_s"], 1),
        "stage_ms": run["stage_ms"],
        "prefill_estimates": prefill_estimates(pairs),
    }


def prefill_estimates(pairs) -> dict | None:
    """Estimated vs measured prefill queue and prefill ms (means), over all load-phase requests and
    over the slowest 5% by client TTFT: is the tail a queue the router did not see coming?"""
    pairs = sorted(
        [(t, m) for t, m in pairs if "estimate_ms" in t], key=lambda p: p[1]["client_ttft_ms"]
    )
    if not pairs:
        return None  # a trace written before the estimate's parts were recorded

    def means(sel):
        return {
            f"{k}_{side}": round(
                float(np.mean([t["estimate_ms"][k] if side == "est" else t[k] for t, _ in sel])), 1
            )
            for k in ("prefill_queue_ms", "prefill_ms")
            for side in ("est", "measured")
        }

    return {"all": means(pairs), "slowest_5pct": means(pairs[-max(1, len(pairs) // 20) :])}


# ----------------------------------------------------------------------------- simulator


def timed_trace(run: dict) -> list[dict]:
    """The run's trace, every record with its measured stage times (a trace written before the
    cluster recorded them gets them from the responses its TTFTs join) and its decode_ms."""
    from router.sim.trace_file import MEASURED_STAGES

    trace = read_trace(run["trace"])
    for t, m in join(trace, run["records"] + run["warm_timings"]):
        for key in MEASURED_STAGES:
            if key in m:  # runs saved before prefill_compute_ms was recorded lack it
                t.setdefault(key, m[key])
        if (
            "e2e_ms" in m
        ):  # first token to last: decoding shares the host too (router/sim/variability.py)
            t["decode_ms"] = max(m["e2e_ms"] - m["ttft_ms"], 0.0)
    if known := [t["decode_ms"] for t in trace if "decode_ms" in t]:
        for t in trace:  # the capacity probe's requests (not saved): the typical decode
            t.setdefault("decode_ms", float(np.median(known)))
    return trace


def calibrate(run: dict, trace: list[dict], pairs: list[tuple[dict, dict]], args, model: str):
    """The joint run's fleet as a SimCluster. model "variable": fit_trace's contention, host
    slowness (random), noise and ingress overhead; "measured host": the same with the host's
    slowness as measured over the run; "deterministic": the last report's model (no contention,
    no noise, the mean overhead). Returns the cluster and what was fitted."""
    from router.sim.cluster_model import EncodeCost, SimCluster, SimCosts
    from router.sim.variability import Variability, fit_trace

    cfg = cluster_config(args, "joint", Path(run["trace"]))
    fit = fit_trace(trace, grid=None if model != "deterministic" else np.array([0.0]))
    pf, ingress, crowd = model_parts(
        fit, model, trace, [t["arrival_s"] for t, _ in pairs if t["items"]]
    )
    encode_ms = (
        run["stage_ms"]["encode"] or 0.0
    ) / crowd  # the load phase's mean, less the slowdown its batches met
    # relative to the fit's reference worker; one with under 3 requests in the trace: as configured
    ref, factors = fit.reference, slowdowns(args)
    speeds = [
        1.0 if i == ref else fit.speeds.get(i, factors[ref] / f) for i, f in enumerate(factors)
    ]
    costs = SimCosts(
        encode={**SimCosts().encode, "image": EncodeCost(encode_ms, 0.0, 1.0)},
        encode_max_batch=cfg.encoder.max_batch_size,
        prefill_fixed_ms=pf.fixed_ms,
        prefill_tokens_per_ms=1.0 / max(pf.per_unit_ms, 1e-6),
        prefill_chunk_tokens=cfg.prefill.max_chunk_tokens,  # the engine's chunks: shortest remaining first between them
        prefill_aging_tokens_per_s=cfg.prefill.aging_tokens_per_s,
        decode_step_ms=run["stage_ms"]["decode_step"] or 1.0,
        decode_step_per_seq_ms=0.0,
        decode_max_batch=cfg.decode.max_batch_size,
        ingress_ms=ingress[0],
        ingress_media_ms=ingress[1] + cfg.encoder.max_wait_ms,  # the batcher's wait: not simulated
        variability=Variability()
        if model == "deterministic"
        else fit.variability(args.seed, model == "measured host"),
    )
    cluster = SimCluster.build(
        2, len(speeds), 1, prefill_speeds=speeds, costs=costs, name="live-calibrated"
    )
    v = costs.variability
    doc = {
        "prefill_fixed_ms": round(pf.fixed_ms, 3),
        "prefill_ms_per_token": round(pf.per_unit_ms, 5),
        "prefill_speeds": [round(x, 3) for x in speeds],
        "reference_worker": ref,
        "prefill_chunk_tokens": costs.prefill_chunk_tokens,
        "prefill_aging_tokens_per_s": costs.prefill_aging_tokens_per_s,
        "contention_per_request": round(v.contention, 3),
        "max_others": fit.max_others,
        "service_sigma": round(v.sigma, 3),
        "host_sigma": round(v.host_sigma, 3),
        "host_tau_s": round(v.host_tau_s, 3),
        "ingress_ms": round(ingress[0], 2),
        "ingress_media_ms": round(costs.ingress_media_ms, 2),
        "ingress_sigma": round(v.ingress_sigma, 3),
        "encode_ms_per_batch": round(encode_ms, 3),
        "decode_step_ms": round(costs.decode_step_ms, 3),
        "fitted_requests": pf.samples,
    }
    return cluster, doc


def model_parts(fit, model: str, trace: list[dict], image_arrivals: list[float]):
    """The prefill fit, the ingress (text ms, media ms, sigma) and the mean slowdown image requests met
    at arrival (to take out of the measured encode time) of one model."""
    from router.sim.variability import busy, interpolate

    col = {
        k: np.array([t[k] for t in trace])
        for k in ("arrival_s", "ttft_ms", "prefill_ms", "prefill_queue_ms")
    }
    decode_ms = np.array([t["decode_ms"] for t in trace]) if fit.count_decoding else None
    at = np.array(image_arrivals)
    others = (
        np.minimum(busy(*col.values(), at, decode_ms) - 1, fit.max_others)
        if len(at)
        else np.zeros(0)
    )
    if model == "measured host":
        m = fit.measured
        knots = [t for t, _ in m.profile], [x for _, x in m.profile]
        host = np.exp([interpolate(*knots, t) for t in at])
        return (
            m.prefill,
            (m.ingress_ms, m.ingress_media_ms, m.ingress_sigma),
            float(np.mean((1 + m.prefill.contention * others) * host)) if len(at) else 1.0,
        )
    crowd = float(np.mean(1 + fit.prefill.contention * others)) if len(at) else 1.0
    return fit.prefill, (fit.ingress_ms, fit.ingress_media_ms, fit.ingress_sigma), crowd


def replay(cluster, trace: list[dict], path: Path, args, seeds: int) -> list[dict[int, float]]:
    """Per noise seed: simulated TTFT per trace record (by id), replayed at the recorded pace."""
    from router.sim.loop import simulate
    from router.sim.trace_file import load_trace

    path.write_text("".join(json.dumps(rec) + "\n" for rec in trace))
    workload, out = load_trace(path), []
    for seed in range(seeds if cluster.costs.variability.enabled else 1):
        seeded = cluster.with_costs(
            variability=replace(cluster.costs.variability, seed=args.seed + seed)
        )
        out.append(
            dict(
                zip(
                    map(id, trace),
                    simulate(seeded, workload, "joint", seed=args.seed).ttft_ms.tolist(),
                )
            )
        )
    return out


def compare(pairs, sims: list[dict[int, float]], http_ms: float) -> dict:
    """Measured vs simulated load-phase TTFT, server and client side; over several noise seeds
    the simulated mean and p90 are the seeds' averages (their p90 errors' range is given too)."""
    out = {}
    for side, measured, hop in (
        ("server", [m["ttft_ms"] for _, m in pairs], 0.0),
        ("client", [m["client_ttft_ms"] for _, m in pairs], http_ms),
    ):
        meas = pcts(measured)
        per_seed = [pcts([sim[id(t)] + hop for t, _ in pairs]) for sim in sims]
        simd = {k: round(float(np.mean([s[k] for s in per_seed])), 2) for k in meas}
        err = {k: round((simd[k] - meas[k]) / meas[k], 3) for k in ("mean", "p90")}
        p90s = [(s["p90"] - meas["p90"]) / meas["p90"] for s in per_seed]
        out[side] = {
            "measured": meas,
            "simulated": simd,
            "rel_error": err,
            "p90_error_range": [round(min(p90s), 3), round(max(p90s), 3)],
            "within_20pct": all(abs(e) <= 0.2 for e in err.values()),
        }
    return out


def service_ratios(pairs, cluster) -> dict[int, float]:
    """Per load-phase trace record (by id): its measured prefill service (own device time) / the calibrated model's."""
    a, tpm = cluster.costs.prefill_fixed_ms, cluster.costs.prefill_tokens_per_ms
    return {
        id(t): (m.get("prefill_compute_ms") or m["prefill_ms"])
        * cluster.prefill[t["route"][1]].speed
        / (a + t["num_prompt_tokens"] / tpm)
        for t, m in pairs
    }


def validate_sim(run: dict, args) -> dict:
    trace = timed_trace(run)
    pairs = sorted(join(trace, run["records"]), key=lambda p: p[0]["arrival_s"])
    out_dir, tag = Path(args.out_dir), run["tag"]
    http_ms = float(np.mean([m["client_ttft_ms"] - m["ttft_ms"] for _, m in pairs]))
    out = {"requests_compared": len(pairs), "http_hop_ms": round(http_ms, 2)}
    for name in MODELS:
        cluster, doc = calibrate(run, trace, pairs, args, name)
        sims = replay(cluster, trace, out_dir / f"sim_trace_{tag}.jsonl", args, args.sim_seeds)
        out[name] = {"calibration": doc, **compare(pairs, sims, http_ms)}
    # Diagnostic, not a prediction: the deterministic model with each load-phase request's prompt scaled
    # so that its simulated prefill takes what the live one measured
    ratio = service_ratios(pairs, cluster)
    varied = [
        rec
        | {"num_prompt_tokens": max(1, round(rec["num_prompt_tokens"] * ratio.get(id(rec), 1.0)))}
        for rec in trace
    ]
    sims = [
        {id(rec): v for rec, v in zip(trace, sim.values())}
        for sim in replay(
            cluster, varied, out_dir / f"sim_trace_{tag}_measured_service.jsonl", args, 1
        )
    ]
    r = np.array(list(ratio.values()))
    return out | {
        "measured_service_variant": {
            "service_ratio": pcts(r) | {"cv": round(float(r.std() / r.mean()), 3)},
            **compare(pairs, sims, http_ms),
        }
    }


# ----------------------------------------------------------------------------- report


def round_summary(runs: dict[str, dict], args) -> dict:
    live = {pol: live_summary(run) for pol, run in runs.items()}
    ll, jt = live["least_loaded"]["client_ttft_ms"], live["joint"]["client_ttft_ms"]
    ratios = {k: round(jt[k] / ll[k], 3) for k in ("p50", "p90", "p99")}
    return {
        "order": list(runs),
        "live": live,
        "ratios": ratios | {"target_met": ratios["p99"] <= 0.70},
        "simulator": validate_sim(runs["joint"], args),
    }


def print_round(k: int, s: dict) -> None:
    print(f"\n== round {k} ({' then '.join(s['order'])})")
    print(
        f"{'TTFT ms (client)':<22}{'p50':>8}{'p90':>8}{'p99':>8}{'mean':>8}   server p99  |est-meas|  on slow  other CPU-s  fast ms/1k tok"
    )
    for pol in POLICIES:
        c, l = s["live"][pol]["client_ttft_ms"], s["live"][pol]
        print(
            f"{pol:<22}{c['p50']:>8.1f}{c['p90']:>8.1f}{c['p99']:>8.1f}{c['mean']:>8.1f}   {l['server_ttft_ms']['p99']:>10.1f}"
            f"{l['estimate_abs_error_ms']:>11.1f}{l['share_on_slow_prefill']:>9.0%}{l['other_cpu_s']:>11.1f}"
            f"{l['fast_prefill_ms_per_1k_tokens'] or float('nan'):>15.1f}"
        )
    r = s["ratios"]
    print(
        f"joint / least_loaded: p50 {r['p50']:.2f}  p90 {r['p90']:.2f}  p99 {r['p99']:.2f}   "
        f"(target p99 <= 0.70: {'met' if r['target_met'] else 'NOT met'})"
    )
    v = s["simulator"]
    print(
        f"{'simulator vs measured':<22}{'mean':>8}{'p90':>8}   rel. error mean / p90   ({v['requests_compared']} requests)"
    )
    for side in ("server", "client"):
        m = v["variable"][side]["measured"]
        print(f"{'measured ' + side:<22}{m['mean']:>8.1f}{m['p90']:>8.1f}")
        for name, x in (
            ("  variable model", v["variable"][side]),
            ("  + measured host", v["measured host"][side]),
            ("  deterministic", v["deterministic"][side]),
            ("  measured service", v["measured_service_variant"][side]),
        ):
            sim, e = x["simulated"], x["rel_error"]
            print(
                f"{name:<22}{sim['mean']:>8.1f}{sim['p90']:>8.1f}   {e['mean']:+.1%} / {e['p90']:+.1%}"
                f"   ({'within' if x['within_20pct'] else 'NOT within'} 20%)"
            )
    print("variable model calibration:", json.dumps(v["variable"]["calibration"]))


def print_overall(rounds: list[dict]) -> None:
    p99 = [r["ratios"]["p99"] for r in rounds]
    print(
        f"\njoint / least_loaded client p99 per round: {', '.join(f'{x:.2f}' for x in p99)}; "
        f"median {statistics.median(p99):.2f} (target <= 0.70: met in {sum(x <= 0.70 for x in p99)} of {len(p99)})"
    )
    for model in MODELS[:2]:
        for side in ("server", "client"):
            errs = [r["simulator"][model][side]["rel_error"] for r in rounds]
            print(
                f"simulator ({side}, {model}) mean / p90 error per round: "
                + ", ".join(f"{e['mean']:+.0%} / {e['p90']:+.0%}" for e in errs)
            )


def live_rounds(args) -> list[dict[str, dict]]:
    import ray
    from ray import serve

    from cluster.prepare import ensure_model

    with socket.socket() as sock:
        port_taken = sock.connect_ex(("127.0.0.1", args.port)) == 0
    if port_taken:
        sys.exit(f"port {args.port} is in use (another engineer's Serve?); pass --port")
    ensure_model(base_config(args))
    reqs = make_requests(args.num_requests, 1.0, args.image_fraction, args.seed, args.words)
    warm = make_requests(11, 1.0, args.image_fraction, args.seed + 1, args.words)
    probe = make_requests(args.probe_requests, 1.0, args.image_fraction, args.seed + 2, args.words)
    num_cpus = max(
        8, 4 + args.prefill_workers
    )  # logical: one per actor (2 encoders, decode, ingress) and spare
    ray.init(
        address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False
    )  # our own Ray, never a shared one
    rounds = []
    try:
        for k in range(
            args.rounds
        ):  # alternate which policy goes first: background drift hits both alike
            order = POLICIES if k % 2 == 0 else POLICIES[::-1]
            rounds.append(
                {pol: run_policy(args, pol, f"{pol}_r{k}", reqs, warm, probe) for pol in order}
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    return rounds


def saved_rounds(args) -> list[dict[str, dict]]:
    out_dir, rounds = Path(args.out_dir), []
    while all((out_dir / f"run_{pol}_r{len(rounds)}.json").exists() for pol in POLICIES):
        k = len(rounds)
        runs = {pol: json.loads((out_dir / f"run_{pol}_r{k}.json").read_text()) for pol in POLICIES}
        rounds.append(
            dict(
                sorted(
                    runs.items(),
                    key=lambda kv: POLICIES.index(kv[0]) if k % 2 == 0 else -POLICIES.index(kv[0]),
                )
            )
        )
    if not rounds:
        sys.exit(f"no saved runs (run_<policy>_r0.json) in {out_dir}")
    return rounds


def main(argv=None) -> int:
    args = parse_args(argv)
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
