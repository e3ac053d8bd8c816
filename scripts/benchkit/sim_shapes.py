"""Simulated clusters and workloads the simulator benchmarks share."""

from __future__ import annotations

import numpy as np

from router.sim.cluster_model import SimCluster, SimCosts
from router.sim.workload import Workload
from router.types import RequestProfile
from router.worker_settings import PrefillSettings


def two_workers(requests: int, seed: int) -> tuple[SimCluster, Workload]:
    """Shape C: two prefill workers of speeds 1 and 0.25, text prompts of 120-1343 tokens at
    0.65 ms a token, prefill in 512-token chunks; arrivals at 1 req/s (scale with at_rate)."""
    costs = SimCosts(
        prefill_fixed_ms=0.0,
        prefill_tokens_per_ms=1 / 0.65,
        prefill=PrefillSettings(max_chunk_tokens=512),
        decode_step_ms=1.0,
        decode_step_per_seq_ms=0.0,
    )
    cluster = SimCluster.build(
        1, 2, 1, prefill_speeds=[1.0, 0.25], costs=costs, name="2 prefill, 1 and 0.25"
    )
    rng = np.random.default_rng(seed)
    profiles = [RequestProfile(int(n), max_tokens=8) for n in rng.integers(120, 1344, requests)]
    return cluster, Workload(
        "text 120-1343 tokens", profiles, np.cumsum(rng.exponential(1.0, requests))
    )
