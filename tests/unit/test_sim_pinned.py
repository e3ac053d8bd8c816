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

from router.sim import SimCluster, Workload, capacity_rps, make_workload, simulate
from router.sim.variability import Variability
from router.types import MediaJob, RequestProfile


def _mixed_workload(n: int) -> Workload:
    """Image + audio requests (split on a -split cluster), single items, text, some repeats."""
    rng = np.random.default_rng(3)
    image = lambda i: MediaJob(i, "image", 0.113, 576, 576 * 8192)  # noqa: E731
    audio = lambda i: MediaJob(i, "audio", 30.0, 1500, 1500 * 8192)  # noqa: E731
    profiles = []
    for k in range(n):
        kind = k % 4
        items = {0: (image(f"i{k}"), audio(f"a{k}")), 1: (image(f"j{k}"),), 2: (audio(f"b{k}"),), 3: ()}[kind]
        if kind == 0 and k % 8 == 0:
            items = items + (image(f"i{k - 8}"),)
        profiles.append(RequestProfile(1000 + sum(it.num_embeddings for it in items), items, max_tokens=16))
    return Workload("mixed", profiles, np.cumsum(rng.exponential(0.02, n)))


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
        return SimCluster.parse("3x2x2-split"), _mixed_workload(1200), "joint"
    if name == "noisy-least_loaded":  # variability and ingress overhead on, bursty arrivals
        cluster = SimCluster.parse("3x3x2-hetero")
        cluster = cluster.with_costs(variability=Variability(contention=0.1, sigma=0.3, host_sigma=0.2, seed=2),
                                     ingress_ms=2.0, ingress_media_ms=1.0)
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
    return {"ttft_ms": s["ttft_ms"], "utilisation": s["utilisation"], "estimate_error_ms": s["estimate_error_ms"],
            "cache_hit_rate": s["encoder_cache_hit_rate"], "completed": r.completed, "sha256": digest.hexdigest()[:16]}


PINNED: dict[str, dict] = {'hetero-joint': {'ttft_ms': {'p50': 160.329, 'p90': 662.855, 'p99': 1220.444, 'mean': 257.548, 'max': 1949.99},
                  'utilisation': {'encoder': 0.0978, 'prefill': 0.6861, 'decode': 0.1501},
                  'estimate_error_ms': {'mean_abs': 23.513, 'mean_signed': 5.771},
                  'cache_hit_rate': 0.1236,
                  'completed': 3000,
                  'sha256': '4ad1476a96acee56'},
 'hetero-round_robin': {'ttft_ms': {'p50': 986.757,
                                    'p90': 20989.371,
                                    'p99': 29719.001,
                                    'mean': 7133.296,
                                    'max': 32242.553},
                        'utilisation': {'encoder': 0.125, 'prefill': 0.6972, 'decode': 0.1244},
                        'estimate_error_ms': {'mean_abs': 168.816, 'mean_signed': 12.486},
                        'cache_hit_rate': 0.0514,
                        'completed': 3000,
                        'sha256': '52947d59a76332dd'},
 'split-joint': {'ttft_ms': {'p50': 7905.26, 'p90': 19847.852, 'p99': 20872.463, 'mean': 9165.563, 'max': 21010.842},
                 'utilisation': {'encoder': 0.2733, 'prefill': 0.993, 'decode': 0.0414},
                 'estimate_error_ms': {'mean_abs': 3936.442, 'mean_signed': 3925.362},
                 'cache_hit_rate': 0.1104,
                 'completed': 1200,
                 'sha256': 'f576d888eb1f6204'},
 'noisy-least_loaded': {'ttft_ms': {'p50': 1235.067,
                                    'p90': 4907.727,
                                    'p99': 6417.626,
                                    'mean': 1902.082,
                                    'max': 7313.328},
                        'utilisation': {'encoder': 0.1774, 'prefill': 0.8185, 'decode': 0.2434},
                        'estimate_error_ms': {'mean_abs': 511.037, 'mean_signed': 260.705},
                        'cache_hit_rate': 0.0588,
                        'completed': 2000,
                        'sha256': '6d6d53f9a27fe1db'}}


@pytest.mark.parametrize("name", SCENARIOS)
def test_pinned_summary(name):
    assert fingerprint(name) == PINNED[name]


if __name__ == "__main__":
    import pprint

    pprint.pprint({name: fingerprint(name) for name in SCENARIOS}, width=140, sort_dicts=False)
