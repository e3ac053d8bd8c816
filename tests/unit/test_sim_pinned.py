"""Pinned simulator results: small runs whose summaries must not move unless the simulated
cluster or the router's decisions change on purpose. A refactor of the engine must keep them
exactly (same seed, same numbers); a change of the cost model or a policy re-pins them in the
same commit, saying why.

Regenerate: `PYTHONPATH=. python tests/unit/test_sim_pinned.py` prints the current fingerprints.
"""

from __future__ import annotations

import numpy as np
import pytest

from router.sim.cluster_model import PREFILL_FIFO, SimCluster, capacity_rps
from router.sim.loop import simulate
from router.sim.variability import Variability
from router.sim.workload import make_workload
from tests.unit.conftest import mixed_workload


def _synthetic(shape: str, n: int, load: float, seed: int, **kw):
    cluster = SimCluster.parse(shape)
    wl = make_workload("poisson", n, seed=seed, **kw)
    return cluster, wl.at_rate(load * capacity_rps(cluster, wl))


def _scenario(name: str):
    if name == "hetero-joint":
        cluster, wl = _synthetic("4x4x4-hetero", 3000, 0.8, 3, prefix_share=0.5)
        return cluster, wl, "joint"
    if (
        name == "hetero-joint-fifo"
    ):  # prefill queues in arrival order: the pins from before shortest-first
        cluster, wl = _synthetic("4x4x4-hetero", 3000, 0.8, 3, prefix_share=0.5)
        return cluster.with_costs(prefill_order=PREFILL_FIFO), wl, "joint"
    if name == "hetero-round_robin":
        cluster, wl = _synthetic("4x4x4-hetero", 3000, 0.8, 3, prefix_share=0.5)
        return cluster, wl, "round_robin"
    if name == "split-joint":
        return SimCluster.parse("3x2x2-split"), mixed_workload(1200), "joint"
    if name == "noisy-least_loaded":  # variability and ingress overhead on, bursty arrivals
        cluster = SimCluster.parse("3x3x2-hetero")
        cluster = cluster.with_costs(
            variability=Variability(contention=0.1, sigma=0.3, host_sigma=0.2, seed=2),
            ingress_ms=2.0,
            ingress_media_ms=1.0,
        )
        wl = make_workload("bursty", 2000, seed=5)
        return cluster, wl.at_rate(0.7 * capacity_rps(cluster, wl)), "least_loaded"
    raise KeyError(name)


SCENARIOS = (
    "hetero-joint",
    "hetero-joint-fifo",
    "hetero-round_robin",
    "split-joint",
    "noisy-least_loaded",
)


# Every request's figures, each under a weight of its own: a request that moves by more than a
# few microseconds moves its sum past the tolerance, while glibc's exp and log, whose last bit
# differs between CPUs (FMA or not: the noisy scenario's lognormal draws moved by up to 2e-8 ms),
# stay far inside it. A hash of the raw bits pinned one CPU's libm.
WEIGHTED_ABS_MS = 1e-3


def _weighted_ms(arrays) -> list[float]:
    weights = np.random.default_rng(0).uniform(0.5, 1.0, len(arrays[0]))
    return [round(float(weights @ np.asarray(a, dtype=np.float64)), 4) for a in arrays]


def fingerprint(name: str) -> dict:
    cluster, wl, policy = _scenario(name)
    r = simulate(cluster, wl, policy, seed=3, slo_ms=1500.0)
    s = r.summary()
    return {
        "ttft_ms": s["ttft_ms"],
        "utilisation": s["utilisation"],
        "estimate_error_ms": s["estimate_error_ms"],
        "cache_hit_rate": s["encoder_cache_hit_rate"],
        "completed": r.completed,
        "weighted_ms": _weighted_ms((r.ttft_ms, r.estimate_ms, r.service_ms)),
    }


PINNED: dict[str, dict] = {
    "hetero-joint": {
        "ttft_ms": {
            "p50": 142.779,
            "p90": 652.11,
            "p99": 1295.133,
            "mean": 237.073,
            "max": 2754.599,
        },
        "utilisation": {"encoder": 0.0956, "prefill": 0.6849, "decode": 0.1501},
        "estimate_error_ms": {"mean_abs": 55.145, "mean_signed": 26.889},
        "cache_hit_rate": 0.1176,
        "completed": 3000,
        "weighted_ms": [536104.2377, 596021.0774, 354567.6022],
    },
    "hetero-joint-fifo": {
        "ttft_ms": {
            "p50": 156.958,
            "p90": 662.855,
            "p99": 1207.563,
            "mean": 254.865,
            "max": 1949.99,
        },
        "utilisation": {"encoder": 0.0955, "prefill": 0.6847, "decode": 0.15},
        "estimate_error_ms": {"mean_abs": 21.376, "mean_signed": 8.073},
        "cache_hit_rate": 0.119,
        "completed": 3000,
        "weighted_ms": [575843.4775, 593628.4754, 354603.1686],
    },
    "hetero-round_robin": {
        "ttft_ms": {
            "p50": 267.397,
            "p90": 1431.237,
            "p99": 38199.978,
            "mean": 1743.343,
            "max": 49579.976,
        },
        "utilisation": {"encoder": 0.1258, "prefill": 0.7021, "decode": 0.1254},
        "estimate_error_ms": {"mean_abs": 6544.493, "mean_signed": 5411.221},
        "cache_hit_rate": 0.0514,
        "completed": 3000,
        "weighted_ms": [3911078.083, 15887668.7076, 448290.3645],
    },
    "split-joint": {
        "ttft_ms": {
            "p50": 276.696,
            "p90": 23817.145,
            "p99": 33591.16,
            "mean": 6968.932,
            "max": 36027.933,
        },
        "utilisation": {"encoder": 0.2734, "prefill": 0.9934, "decode": 0.0415},
        "estimate_error_ms": {"mean_abs": 10299.464, "mean_signed": 6100.447},
        "cache_hit_rate": 0.1104,
        "completed": 1200,
        "weighted_ms": [6336372.187, 11810539.4764, 471879.625],
    },
    "noisy-least_loaded": {
        "ttft_ms": {
            "p50": 334.372,
            "p90": 2357.512,
            "p99": 8755.212,
            "mean": 937.154,
            "max": 12410.339,
        },
        "utilisation": {"encoder": 0.167, "prefill": 0.8273, "decode": 0.2498},
        "estimate_error_ms": {"mean_abs": 1497.8, "mean_signed": 1008.719},
        "cache_hit_rate": 0.0629,
        "completed": 2000,
        "weighted_ms": [1394049.3188, 2892319.0282, 296167.7349],
    },
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_pinned_summary(name):
    got, pinned = fingerprint(name), dict(PINNED[name])
    assert got.pop("weighted_ms") == pytest.approx(pinned.pop("weighted_ms"), abs=WEIGHTED_ABS_MS)
    assert got == pinned


if __name__ == "__main__":
    import pprint

    pprint.pprint({name: fingerprint(name) for name in SCENARIOS}, width=140, sort_dicts=False)
