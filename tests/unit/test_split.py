"""Encoder pools split by modality (router/split.py): a request whose modalities no single
encoder hosts is encoded across several, booked and released on each, in the router, the
live cluster's routing glue and the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from router.cost_model import CostPriors
from router.policies import POLICIES
from router.router import Router
from router.sim.cluster_model import ClusterShapeError, SimCluster
from router.sim.loop import make_router
from router.sim.loop import run_router as run_engine
from router.types import RequestProfile, WorkerInfo, WorkerKind
from router.view import NoWorkerError
from tests.unit.conftest import (
    AUDIO,
    VISION,
    assert_idle,
    audio,
    fleet,
    media,
    mixed_workload,
    split_fleet,
)

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


MIXED = RequestProfile(2000, (media("i1"), audio("a1"), media("i2")))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_mixed_request_is_split_booked_and_released_per_encoder(policy):
    router = Router(split_fleet(), CostPriors(), policy, seed=1)
    decision = router.route(MIXED, 0.0)
    vision = decision.encoder_for("image")
    assert (
        vision in (0, 1)
        and decision.encoder_for("audio") == 2
        and decision.encoder_for("video") is None
    )
    assert decision.encoder_by_modality == (("audio", 2), ("image", vision))
    assert set(decision.encoders) == {vision, 2} and decision.encoder == decision.encoders[0]
    by_encoder = {share.encoder: share for share in decision.shares}
    assert by_encoder[vision].num_items == 2 and by_encoder[2].num_items == 1
    view = router.view
    assert view.outstanding[E] == [2 if e == vision else 1 if e == 2 else 0 for e in range(3)]
    assert (
        view.outstanding_ms[E][2] == pytest.approx(by_encoder[2].encode_ms)
        and by_encoder[2].encode_ms > 50
    )
    assert view.outstanding_ms[E][vision] == pytest.approx(by_encoder[vision].encode_ms)
    # The groups encode in parallel: the estimate follows the one arriving last (the 30 s audio
    # clip)
    last = max(decision.shares, key=lambda s: s.queue_ms + s.encode_ms + s.transfer_ms)
    assert last.encoder == 2 and decision.estimate.encode_ms == pytest.approx(last.encode_ms)
    assert set(decision.encode_items) == set(MIXED.items)
    router.encode_done(
        decision, 0.1, duration_ms=120.0
    )  # calibration credits each item's own encoder
    router.prefill_done(decision, 0.2, duration_ms=50.0)
    router.decode_done(decision, 0.3)
    assert_idle(router)
    cost = router.cost
    assert cost.encode_ms(2, "audio", 30.0) != pytest.approx(
        cost.encode_ms(1 - vision, "audio", 30.0)
    )
    assert cost.encode_ms(vision, "image", 0.113) != pytest.approx(
        cost.encode_ms(1 - vision, "image", 0.113)
    )


def test_joint_routes_the_heaviest_group_with_the_prefill_worker():
    router = Router(split_fleet(), CostPriors(), "joint")
    router.view.begin(E, 0, 1, 40.0)  # vision encoder 0 busy: its image goes to encoder 1
    decision = router.route(MIXED, 0.0)
    assert decision.encoder == 2  # audio (~85 ms) outweighs two images (~10 ms)
    assert decision.encoder_for("image") == 1
    # a cached item skips its encoder's queue and encode, and is not booked as a miss
    router.publish(E, 0, now_s=0.0, cached_identifiers=frozenset({"i1", "i2"}))
    hit = router.route(RequestProfile(2000, (media("i1"), audio("a2"), media("i2"))), 0.0)
    share = next(s for s in hit.shares if "image" in s.modalities)
    assert share.encoder == 0 and share.encode_items == () and share.queue_ms == 0.0


def test_one_encoder_hosting_all_is_not_split():
    workers = [
        WorkerInfo(E, 0, modalities=VISION),
        WorkerInfo(E, 1, modalities=VISION | AUDIO),
        WorkerInfo(P, 0),
        WorkerInfo(D, 0),
    ]
    router = Router(workers, CostPriors(), "joint")
    decision = router.route(MIXED, 0.0)
    assert decision.shares == () and decision.encoder == 1
    assert decision.encoder_for("audio") == decision.encoder_for("image") == 1
    assert decision.encoder_by_modality == (("audio", 1), ("image", 1))
    router.set_healthy(
        E, 1, False
    )  # the only all-modality encoder is down: now audio has no host at all
    with pytest.raises(NoWorkerError, match="no healthy encoder worker hosts audio"):
        router.route(MIXED, 0.0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_live_routing_credits_and_releases_each_encoder(policy):
    from actors.types import EncodeStats, PrefillResult
    from cluster.metrics import Metrics
    from cluster.routing import LiveRouting

    live = LiveRouting(Router(split_fleet(), CostPriors(), policy, seed=2), Metrics(), 8192)
    decision = live.route(MIXED)
    stats = tuple(
        EncodeStats(item.identifier, 0.0, 40.0 if item.modality == "audio" else 4.0, 1)
        for item in MIXED.items
    )
    live.prefill_finished(decision, PrefillResult("r", 1, 2000, 0.0, 30.0, stats), transfer_ms=1.0)
    live.release(decision, before_prefill=False)
    assert_idle(live.router)
    cost = live.router.cost
    # 40 ms per audio item observed on encoder 2 only (the prior is ~85 ms)
    assert cost.encode_ms(2, "audio", 30.0) < cost.encode_ms(
        decision.encoder_for("image"), "audio", 30.0
    )
    second = live.route(MIXED)  # released before the prefill finished (a client gone)
    live.release(second, before_prefill=True)
    assert_idle(live.router)


# -- the simulator ---------------------------------------------------------------------------------


def test_split_cluster_shapes():
    c = SimCluster.parse("4x4x4-split")
    assert [w.modalities for w in c.encoders] == [VISION, VISION, AUDIO, AUDIO]
    c = SimCluster.parse("3x2x2-hetero-split")
    assert [w.modalities for w in c.encoders] == [VISION, VISION, AUDIO] and c.encoders[
        2
    ].speed == 0.5
    with pytest.raises(ClusterShapeError, match="at least 2 encoders"):
        SimCluster.parse("1x1x1-split")
    with pytest.raises(ClusterShapeError, match="cannot parse"):
        SimCluster.parse("4x4x4-split-split")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_simulator_splits_mixed_requests_and_releases_every_encoder(policy):
    cluster = SimCluster.parse("3x2x2-split")  # encoders 0-1 vision, 2 audio
    router = make_router(cluster, policy, seed=4)
    decisions = []
    route = router.route
    router.route = lambda profile, now_s: decisions.append(route(profile, now_s)) or decisions[-1]
    result = run_engine(
        cluster,
        mixed_workload(400),
        router,
        policy,
        slo_ms=1000,
        progress=False,
        record_decisions=False,
        load=None,
    )
    assert result.completed == 400 and np.all(result.ttft_ms >= result.service_ms - 1e-6)
    split = [d for d in decisions if d.shares]
    assert len(split) == 100  # every image + audio request
    for d in split:
        assert d.encoder_for("audio") == 2 and d.encoder_for("image") in (0, 1)
    assert {d.encoder_for("image") for d in split} == {0, 1}  # both vision encoders used
    assert_idle(router)


def test_live_routing_learns_prefill_cost_from_the_workers_own_compute_not_its_span():
    """A prompt's prefill_ms also holds the chunks of requests sharing its worker's steps (shortest
    remaining first); its compute_ms is its own. The router's cost is the latter."""
    from actors.types import PrefillResult
    from cluster.metrics import Metrics
    from cluster.routing import LiveRouting

    text = RequestProfile(1000)

    def learned(compute_ms: float) -> float:
        live = LiveRouting(Router(fleet(1, 1, 1), CostPriors(), "joint", seed=2), Metrics(), 8192)
        for _ in range(30):
            decision = live.route(text)
            live.prefill_finished(
                decision,
                PrefillResult("r", 1, 1000, 0.0, 400.0, compute_ms=compute_ms),
                transfer_ms=None,
            )
            live.release(decision, before_prefill=False)
        assert_idle(live.router)
        return live.router.cost.prefill_ms(0, 1000)

    assert learned(compute_ms=40.0) == pytest.approx(40.0, rel=0.1)
    assert learned(compute_ms=0.0) == pytest.approx(400.0, rel=0.1), (
        "a worker that reports no compute_ms: its span"
    )
