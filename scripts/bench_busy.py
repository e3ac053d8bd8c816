"""A prefill wait that grows with utilisation (router/busy.py), in the deterministic simulator:
joint with max_busy 0 (booked work only, the default) and 0.95, against least_loaded, per load
and seed.

Default shape: shape C, two prefill workers of speeds 1 and 0.25, text prompts of 120-1343
tokens (bench_routing_live's range) at 0.65 ms a token, prefill in 512-token chunks, shortest
remaining first. Prints joint / least_loaded p99 (and p50) per seed; `--shape 16x16x16-hetero`
runs the seed mix.

    .venv/bin/python scripts/bench_busy.py --loads 0.3 0.5 0.7 0.8 0.9 --seeds 1 2 3
"""

from __future__ import annotations

import argparse

import numpy as np

from benchkit.sim_shapes import two_workers
from router.calibration import CalibrationConfig
from router.sim.cluster_model import SimCluster, capacity_rps
from router.sim.loop import simulate
from router.sim.workload import Workload, make_workload

RUNS = (
    ("joint, booked wait", "joint", 0.0),
    ("joint, grown wait", "joint", 0.95),
    ("least_loaded", "least_loaded", 0.0),
)


def percentiles(
    cluster: SimCluster, wl: Workload, policy: str, max_busy: float, seed: int
) -> np.ndarray:
    r = simulate(
        cluster,
        wl,
        policy,
        seed=seed,
        router_kwargs={"calibration": CalibrationConfig(max_busy=max_busy)},
    )
    return np.percentile(r.ttft_ms, [50, 99])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        default="two-workers",
        help="two-workers (shape C), or a simulator shape such as 16x16x16-hetero",
    )
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.8, 0.9])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    print(f"{'load':<6}{'run':<20}{'p99 / least_loaded, per seed':<32}{'p50 / least_loaded'}")
    for load in args.loads:
        ratios: dict[str, list[np.ndarray]] = {label: [] for label, _, _ in RUNS}
        for seed in args.seeds:
            if args.shape == "two-workers":
                cluster, wl = two_workers(args.requests, seed)
            else:
                cluster, wl = (
                    SimCluster.parse(args.shape),
                    make_workload("poisson", args.requests, seed=seed),
                )
            wl = wl.at_rate(load * capacity_rps(cluster, wl))
            got = {
                label: percentiles(cluster, wl, policy, max_busy, seed)
                for label, policy, max_busy in RUNS
            }
            for label in ratios:
                ratios[label].append(got[label] / got["least_loaded"])
        for label, _, _ in RUNS[:2]:
            p99 = " ".join(f"{r[1]:.2f}" for r in ratios[label])
            p50 = " ".join(f"{r[0]:.2f}" for r in ratios[label])
            print(f"{load:<6}{label:<20}{p99:<32}{p50}", flush=True)


if __name__ == "__main__":
    main()
