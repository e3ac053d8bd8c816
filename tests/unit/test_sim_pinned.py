"""Pinned simulator results: small runs whose summaries must not move unless the simulated
cluster or the router's decisions change on purpose. A refactor of the engine must keep them
exactly (same seed, same numbers); a change of the cost model or a policy re-pins them in the
same commit, saying why.

Regenerate: `PYTHONPATH=. python tests/unit/test_sim_pinned.py` prints the current fingerprints.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from router.sim import SimCluster, capacity_rps, make_workload, simulate
from router.sim.variability import Variability
from tests.unit.conftest import mixed_workload


def _synthetic(shape: str, n: int, load: float, seed: int, **kw):
    cluster = SimCluster.parse(shape)
    wl = make_workload("poisson", n, seed=seed, **kw)
    return cluster, wl.at_rate(load * capacity_rps(cluster, wl))


def _scenario(name: str):
    if name == "hetero-joint":
        cluster, wl = _synthetic("4x4x4-hetero", 3000, 0.8, 3, prefix_share=0.5)
        return cluster, wl, "joint"
    if name == "hetero-round_robin":
        cluster, wl = _synthetic("4x4x4-hetero", 3000, 0.8, 3, prefix_share=0.5)
        return cluster, wl, "round_robin"
    if name == "split-joint":
        return SimCluster.parse("3x2x2-split"), mixed_workload(1200), "joint"
    if name == "noisy-least_loaded":  # variability and ingress overhead on, bursty arrivals
        cluster = SimCluster.parse("3x3x2-hetero")
        cluster = cluster.with_costs(variability=Variability(contention=0.1, sigma=0.3, host_sigma=0.2, seed=2), ingress_ms=2.0, ingress_media_ms=1.0)
        wl = make_workload("bursty", 2000, seed=5)
        return cluster, wl.at_rate(0.7 * capacity_rps(cluster, wl)), "least_loaded"
    raise KeyError(name)


SCENARIOS = ("hetero-joint", "hetero-round_robin", "split-joint", "noisy-least_loaded")


def fingerprint(name: str) -> dict:
    cluster, wl, policy = _scenario(name)
    r = simulate(cluster, wl, policy, seed=3, slo_ms=1500.0)
    s = r.summary()
    digest = hashlib.sha256()
    for array in (r.ttft_ms, r.estimate_ms, r.service_ms):
        digest.update(np.ascontiguousarray(array, dtype=np.float64).tobytes())
    return {
        "ttft_ms": s["ttft_ms"],
        "utilisation": s["utilisation"],
        "estimate_error_ms": s["estimate_error_ms"],
        "cache_hit_rate": s["encoder_cache_hit_rate"],
        "completed": r.completed,
        "sha256": digest.hexdigest()[:16],
    }


PINNED: dict[str, dict] = {
    "hetero-joint": {
        "ttft_ms": {"p50": 156.958, "p90": 662.855, "p99": 1207.563, "mean": 254.865, "max": 1949.99},
        "utilisation": {"encoder": 0.0955, "prefill": 0.6847, "decode": 0.15},
        "estimate_error_ms": {"mean_abs": 21.376, "mean_signed": 8.073},
        "cache_hit_rate": 0.119,
        "completed": 3000,
        "sha256": "5bed990a945b0dac",
    },
    "hetero-round_robin": {
        "ttft_ms": {"p50": 986.757, "p90": 20989.371, "p99": 29719.001, "mean": 7133.296, "max": 32242.553},
        "utilisation": {"encoder": 0.125, "prefill": 0.6972, "decode": 0.1244},
        "estimate_error_ms": {"mean_abs": 145.217, "mean_signed": 125.378},
        "cache_hit_rate": 0.0514,
        "completed": 3000,
        "sha256": "a49eb12f5f5b2817",
    },
    "split-joint": {
        "ttft_ms": {"p50": 7905.26, "p90": 19847.852, "p99": 20872.463, "mean": 9165.563, "max": 21010.842},
        "utilisation": {"encoder": 0.2733, "prefill": 0.993, "decode": 0.0414},
        "estimate_error_ms": {"mean_abs": 3935.547, "mean_signed": 3924.459},
        "cache_hit_rate": 0.1104,
        "completed": 1200,
        "sha256": "0648b7114ef00b6b",
    },
    "noisy-least_loaded": {
        "ttft_ms": {"p50": 1400.968, "p90": 4961.727, "p99": 6418.2, "mean": 2059.974, "max": 7654.12},
        "utilisation": {"encoder": 0.1664, "prefill": 0.8288, "decode": 0.2438},
        "estimate_error_ms": {"mean_abs": 394.704, "mean_signed": 9.964},
        "cache_hit_rate": 0.0606,
        "completed": 2000,
        "sha256": "08407aeabe1530f9",
    },
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_pinned_summary(name):
    assert fingerprint(name) == PINNED[name]


if __name__ == "__main__":
    import pprint

    pprint.pprint({name: fingerprint(name) for name in SCENARIOS}, width=140, sort_dicts=False)
