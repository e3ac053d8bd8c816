r"""Both policies in the simulator calibrated from each saved live round: is a live ratio the
policy or the noise?

A live round offers each policy its own arrivals on a host whose speed drifts, and the p99 of a
few hundred requests rests on three of them, so one round's joint / least_loaded ratio carries
much noise. This replays the joint phase's requests (arrivals, prompts, images) through the
simulator calibrated from that phase (bench_routing_live's models: "variable" by default), once
per policy and per noise seed, and prints the simulated ratios beside the live ones. Router
settings may be varied (--calibration key=value ...), so a change to the router can be tried
against the conditions of a recorded run before a live one.

    .venv/bin/python scripts/bench_routing_replay.py --out-dir /tmp/live_C \
        --config configs/bench_cpu.yaml --rate 0 --load 0.8
    .venv/bin/python scripts/bench_routing_replay.py --out-dir /tmp/live_C ... \
        --calibration max_busy=0.95

Arguments other than those below are bench_routing_live's (the ones its saved runs were made with).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchkit.routing import config as live_config
from benchkit.routing.config import POLICIES
from benchkit.routing.runs import join, live_summary, saved_rounds, timed_trace
from benchkit.routing.sim import MODELS, calibrate
from router.calibration import CalibrationConfig
from router.sim.loop import simulate
from router.sim.trace_file import load_trace


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="variable",
        choices=MODELS,
        help="the simulator's calibration (bench_routing_live)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=4,
        help="noise seeds per policy; the percentiles are their means",
    )
    p.add_argument(
        "--calibration",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="router CalibrationConfig settings",
    )
    ours, rest = p.parse_known_args(argv)
    return ours, live_config.parse_args(["--analyze", *rest])


def calibration(pairs: list[str]) -> CalibrationConfig:
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--calibration takes KEY=VALUE, got {pair!r}")
        settings[key] = json.loads(value)
    try:
        return CalibrationConfig.from_dict(settings)
    except ValueError as exc:
        raise SystemExit(f"--calibration: {exc}") from exc


def simulated_percentiles(
    cluster, path: Path, load_mask: np.ndarray, policy: str, seeds: int, seed: int, config
) -> np.ndarray:
    """Mean over noise seeds of the load phase's simulated TTFT p50, p90, p99."""
    workload, out = load_trace(path), []
    for s in range(seeds if cluster.costs.variability.enabled else 1):
        seeded = cluster.with_costs(variability=replace(cluster.costs.variability, seed=seed + s))
        ttft = simulate(
            seeded, workload, policy, seed=seed + s, router_kwargs={"calibration": config}
        ).ttft_ms
        out.append(np.percentile(ttft[load_mask], [50, 90, 99]))
    return np.mean(out, axis=0)


def replay_round(k: int, runs: dict[str, dict], ours, args, config) -> dict:
    run = runs["joint"]
    trace = timed_trace(run)
    pairs = join(trace, run["records"])
    cluster, _ = calibrate(run, trace, pairs, args, ours.model)
    path = Path(args.out_dir) / f"replay_trace_r{k}.jsonl"
    path.write_text("".join(json.dumps(rec) + "\n" for rec in trace))
    in_load = {id(t) for t, _ in pairs}
    mask = np.array([id(rec) in in_load for rec in trace])
    sim = {
        pol: simulated_percentiles(cluster, path, mask, pol, ours.seeds, args.seed, config)
        for pol in POLICIES
    }
    ratio = sim["joint"] / sim["least_loaded"]
    measured = {pol: live_summary(r)["client_ttft_ms"] for pol, r in runs.items()}
    live_ratio = [measured["joint"][q] / measured["least_loaded"][q] for q in ("p50", "p90", "p99")]
    return {
        "round": k,
        "simulated": ratio.round(3).tolist(),
        "live": np.round(live_ratio, 3).tolist(),
        "sim_p99_ms": {p: round(float(v[2]), 1) for p, v in sim.items()},
    }


def two_places(values: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


def main(argv=None) -> int:
    ours, args = parse_args(argv)
    config = calibration(ours.calibration)
    print(
        "joint / least_loaded, p50 p90 p99: live, and simulated "
        f"({ours.model} model, {ours.seeds} noise seeds)"
    )
    for k, runs in enumerate(saved_rounds(args)):
        r = replay_round(k, runs, ours, args, config)
        print(
            f"round {k}: live {two_places(r['live'])}   simulated {two_places(r['simulated'])}   "
            f"(simulated p99 ms: {r['sim_p99_ms']})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
