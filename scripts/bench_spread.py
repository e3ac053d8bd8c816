"""Near-tie spreading in the simulator: joint with CalibrationConfig.spread_z = 0 (the argmin) and 1
(the default), and least_loaded, on the same noisy workload (30% lognormal service noise, 80% load).

    .venv/bin/python scripts/bench_spread.py --requests 30000 --seed 1
"""

from __future__ import annotations

import argparse

from router.calibration import CalibrationConfig
from router.sim.cluster_model import SimCluster, capacity_rps
from router.sim.loop import simulate
from router.sim.variability import Variability
from router.sim.workload import make_workload

RUNS = (
    ("joint z=0", "joint", 0.0),
    ("joint z=1", "joint", 1.0),
    ("least_loaded", "least_loaded", 1.0),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["16x16x16-hetero", "8x8x8"])
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument(
        "--sigma", type=float, default=0.3, help="lognormal sigma of every service time"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{'shape':<18}{'run':<14}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}")
    for shape in args.shapes:
        cluster = SimCluster.parse(shape).with_costs(
            variability=Variability(sigma=args.sigma, seed=args.seed)
        )
        wl = make_workload("poisson", args.requests, seed=args.seed)
        wl = wl.at_rate(args.load * capacity_rps(cluster, wl))
        for label, policy, z in RUNS:
            ttft = simulate(
                cluster,
                wl,
                policy,
                seed=args.seed,
                progress=True,
                router_kwargs={"calibration": CalibrationConfig(spread_z=z)},
            ).summary()["ttft_ms"]
            print(
                f"{shape:<18}{label:<14}{ttft['p50']:>9.1f}{ttft['p90']:>9.1f}{ttft['p99']:>9.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
