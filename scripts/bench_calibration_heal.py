"""A rarely chosen slow worker under joint: how slow the router believes it is, with healing that
resumes from the estimate a probe confirms (CalibrationConfig.resume_after_heal, the default) and
without it (healing as plain forgetting), on the same workload.

8x8x8 simulated cluster, prefill worker 7 slowed 4x, 20% lognormal service noise, 60% load, half
text and half image requests. Per run: worker 7's relative time over the geometric mean of the
others' (median and p10 over the second half of the run, sampled at every prefill) and p99 TTFT.

    .venv/bin/python scripts/bench_calibration_heal.py --requests 30000 --seeds 0 1
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from router.calibration import CalibrationConfig
from router.sim.cluster_model import SimCluster, capacity_rps
from router.sim.loop import make_router
from router.sim.loop import run_router as run_engine
from router.sim.variability import Variability
from router.sim.workload import make_workload
from router.types import WorkerKind

SLOW = 7


def run(requests: int, seed: int, resume: bool) -> tuple[float, float, float]:
    cluster = SimCluster.build(
        8, 8, 8, prefill_speeds=[1.0] * SLOW + [0.25], name="8x8x8, prefill 7 slowed 4x"
    )
    workload = make_workload("poisson", requests, seed=seed, mix={"text": 0.5, "image": 0.5})
    workload = workload.at_rate(0.6 * capacity_rps(cluster, workload))
    cluster = cluster.with_costs(variability=Variability(sigma=0.2, seed=seed))
    router = make_router(
        cluster, "joint", seed=seed, calibration=CalibrationConfig(resume_after_heal=resume)
    )
    believed, report = [], router.prefill_done

    def prefill_done(decision, now_s, duration_ms=None, uncached_tokens=None):
        report(decision, now_s, duration_ms, uncached_tokens)
        times = router.cost.relative_times(WorkerKind.PREFILL)
        believed.append(times[SLOW] / math.exp(np.mean(np.log(times[:SLOW]))))

    router.prefill_done = prefill_done
    result = run_engine(
        cluster,
        workload,
        router,
        "joint",
        slo_ms=1500.0,
        progress=False,
        record_decisions=False,
        load=0.6,
    )
    late = np.array(believed[len(believed) // 2 :])
    return (
        float(np.median(late)),
        float(np.percentile(late, 10)),
        float(np.percentile(result.ttft_ms, 99)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    print(f"{'seed':<6}{'healing':<22}{'believed x (median)':>21}{'p10':>7}{'p99 TTFT ms':>13}")
    for seed in args.seeds:
        for resume, label in ((False, "forgets"), (True, "resumes (default)")):
            median, p10, p99 = run(args.requests, seed, resume)
            print(f"{seed:<6}{label:<22}{median:>21.2f}{p10:>7.2f}{p99:>13.0f}")


if __name__ == "__main__":
    main()
