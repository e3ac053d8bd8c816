"""Several ingress replicas' routers in the simulator (router/sim/routers.py): each books only
its own requests, they share bookings at each publish and around a large request, and the
sharing period shows in the tail (no torch, no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from router.cost_model import CostPriors
from router.router import Router
from router.sim.cli import main as cli_main
from router.sim.cluster_model import SimCluster, capacity_rps
from router.sim.loop import simulate
from router.sim.routers import RouterGroup
from router.sim.workload import make_workload
from router.types import MediaJob, RequestProfile, WorkerKind
from tests.unit.conftest import fleet

E, P = WorkerKind.ENCODER, WorkerKind.PREFILL
IMAGE = RequestProfile(800, (MediaJob("x", "image", 0.1, 256, 256 * 4096),))


def _group(n: int, sync_above_ms: float = 0.0) -> RouterGroup:
    routers = [Router(fleet(2, 2, 1), CostPriors(), "joint") for _ in range(n)]
    return RouterGroup(routers, sync_above_ms)


def test_routers_take_turns_and_completions_return_to_the_router_that_routed():
    group = _group(2)
    first, second = group.route(IMAGE, 0.0), group.route(IMAGE, 0.0)
    a, b = (r.view for r in group.routers)
    assert sum(a.outstanding[P]) == 1 and sum(b.outstanding[P]) == 1  # each booked its own
    for decision in (first, second):
        group.encode_done(decision, 0.01, 5.0)
        group.prefill_done(decision, 0.05, 30.0)
        group.decode_done(decision, 0.5)
    assert all(
        ms == 0.0 for view in (a, b) for values in view.outstanding_ms.values() for ms in values
    )


def test_shared_bookings_price_the_others_queue_in_ms():
    group = _group(3)
    decision = group.route(IMAGE, 0.0)  # router 0 books it
    group.share()
    others = group.routers[1].view
    booked = decision.estimate.prefill_ms
    assert others.foreign_queue_ms(P)[decision.prefill] == pytest.approx(booked)
    assert group.routers[0].view.foreign_queue_ms(P) == [0.0, 0.0]  # its own is not foreign
    # the next request at router 1 avoids the worker router 0 loaded, knowing its cost in ms
    assert group.route(IMAGE, 0.0).prefill != decision.prefill


def test_until_the_next_share_a_routers_own_bookings_count_for_each_other_router():
    group = _group(3)
    group.share()
    view = group.routers[0].view
    decision = group.route(IMAGE, 0.0)  # router 0 again, after the share
    extra = view.foreign_queue_ms(P)[decision.prefill]
    assert extra == pytest.approx(2 * decision.estimate.prefill_ms)  # two others, presumably alike


def test_a_large_request_routes_on_the_others_bookings_as_of_now():
    large, small = RequestProfile(20_000), RequestProfile(200)
    floor = _group(1).routers[0].prefill_floor_ms(large)
    assert _group(1).routers[0].prefill_floor_ms(small) < floor / 10
    for sync_above_ms, apart in ((floor / 2, True), (0.0, False), (floor * 2, False)):
        group = _group(2, sync_above_ms)
        first, second = group.route(large, 0.0), group.route(large, 0.0)  # two routers, no share
        assert (first.prefill != second.prefill) is apart, sync_above_ms
    # a small request neither waits for nor publishes a share
    group = _group(2, floor / 2)
    group.route(small, 0.0)
    assert group.routers[1].view.foreign_queue_ms(P) is None


def _p99(routers: int, share_ms: float, policy: str = "joint", sync_above_ms=0.0) -> float:
    cluster = SimCluster.parse("8x8x8-hetero").with_costs(publish_interval_s=share_ms / 1e3)
    wl = make_workload("poisson", 3000, seed=5)
    wl = wl.at_rate(0.8 * capacity_rps(cluster, wl))
    result = simulate(cluster, wl, policy, seed=5, routers=routers, sync_above_ms=sync_above_ms)
    assert result.completed == len(wl)  # every request finished, whichever router routed it
    return float(np.percentile(result.ttft_ms, 99))


def test_a_shorter_sharing_period_keeps_several_routers_closer_to_one():
    often, rarely = _p99(4, 50.0), _p99(4, 1000.0)
    assert often < rarely  # fresher knowledge of the others' work: a shorter tail
    assert _p99(1, 50.0) <= often  # one router knows all it booked at once
    assert often < _p99(4, 50.0, "least_loaded")  # joint keeps its edge over least_loaded


def test_syncing_around_large_requests_shortens_the_tail_of_a_long_period():
    assert _p99(4, 1000.0, sync_above_ms=50.0) < _p99(4, 1000.0)


def test_cli_routers_and_share_period(capsys):
    argv = ["--cluster", "2x2x2", "--requests", "300", "--json", "--routers", "3"]
    assert cli_main([*argv, "--share-ms", "50"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["requests"] == 300
    assert cli_main([*argv, "--share-ms", "0"]) == 2
    assert "--share-ms must be a positive" in capsys.readouterr().err
    assert cli_main([*argv, "--sync-above-ms", "-1"]) == 2
    assert "--sync-above-ms must be 0 or more" in capsys.readouterr().err
    assert cli_main(["--routers", "0"]) == 2
