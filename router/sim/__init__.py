"""Discrete-event simulator for routing studies.

It drives the very same `router.router.Router` (cost model, cluster view, policies)
that the live cluster uses; only the workers are simulated. Plain Python + numpy:
nothing here imports torch or ray (matplotlib is imported lazily, for plots only).

    from router.sim import SimCluster, make_workload, simulate, capacity_rps
    cluster = SimCluster.parse("16x16x16-hetero")
    wl = make_workload("poisson", 100_000, seed=1)
    wl = wl.at_rate(0.8 * capacity_rps(cluster, wl))
    result = simulate(cluster, wl, "joint", seed=1, slo_ms=2000)
    print(result.summary())

`epd simulate --help` (router/sim/cli.py) is the command-line front end; `epd plan` searches
with it for the cheapest E:P:D shape meeting a TTFT SLO at a rate (router/sim/plan.py).

Imports from this project: router
Never imports: torch, ray, transformers
"""

from __future__ import annotations

from router.sim.cluster_model import (
    ClusterShapeError,
    EncodeCost,
    SimCluster,
    SimCosts,
    SimWorker,
    capacity_rps,
)
from router.sim.loop import SimResult, simulate
from router.sim.trace_file import load_trace, write_trace
from router.sim.workload import (
    DEFAULT_MIX,
    REQUEST_CLASSES,
    BurstSpec,
    RequestClass,
    Workload,
    WorkloadError,
    make_workload,
)

__all__ = [
    "BurstSpec",
    "ClusterShapeError",
    "DEFAULT_MIX",
    "EncodeCost",
    "REQUEST_CLASSES",
    "RequestClass",
    "SimCluster",
    "SimCosts",
    "SimResult",
    "SimWorker",
    "Workload",
    "WorkloadError",
    "capacity_rps",
    "load_trace",
    "make_workload",
    "simulate",
    "write_trace",
]
