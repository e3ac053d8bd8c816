"""A live ingress replica among others (cluster/routing.py route_shared): a large request
routes on the other replicas' bookings as of now and publishes its own at once; a small one,
or a replica alone, makes no call (no Ray: the controller's side is a stand-in object)."""

from __future__ import annotations

import asyncio

from cluster.metrics import Metrics
from cluster.routing import LiveRouting
from router.cost_model import CostPriors
from router.router import Router
from router.types import RequestProfile, WorkerKind
from tests.unit.conftest import fleet

P = WorkerKind.PREFILL
LARGE, SMALL = RequestProfile(20_000), RequestProfile(200)


class Controller:
    """The fleet controller's heartbeat as FleetClient.share_now and publish reach it."""

    def __init__(self, num_replicas: int, others_booked: dict | None, answers: bool = True):
        self.num_replicas, self.others_booked = num_replicas, None
        self._others, self._answers = others_booked, answers
        self.shared: list[dict] = []
        self.published: list[dict] = []

    async def share_now(self, booked: dict, timeout_s: float) -> bool:
        self.shared.append(booked)
        if self._answers:
            self.others_booked = self._others
        return self._answers

    def publish(self, booked: dict) -> None:
        self.published.append(booked)


def _live(controller: Controller) -> LiveRouting:
    router = Router(fleet(1, 2, 1), CostPriors(), "joint")
    floor = router.prefill_floor_ms(LARGE)
    return LiveRouting(router, Metrics(), 8192, shares=controller, sync_above_ms=floor / 2)


def test_a_large_request_routes_around_what_another_replica_booked_just_now():
    busy = {"encoder": [0.0], "prefill": [5_000.0, 0.0]}  # another replica loaded worker 0
    controller = Controller(2, busy)
    live = _live(controller)
    decision = asyncio.run(live.route_shared(LARGE))
    assert decision.prefill == 1
    assert len(controller.shared) == 1 and controller.shared[0]["prefill"] == [0.0, 0.0]
    booked = decision.estimate.prefill_ms
    assert controller.published == [{"encoder": [0.0], "prefill": [0.0, booked]}]
    assert _syncs(live, "shared") == 1 and _syncs(live, "unanswered") == 0


def test_small_requests_and_a_lone_replica_make_no_call():
    controller = Controller(2, {"encoder": [0.0], "prefill": [5_000.0, 0.0]})
    asyncio.run(_live(controller).route_shared(SMALL))
    alone = Controller(1, None)
    asyncio.run(_live(alone).route_shared(LARGE))
    assert controller.shared == controller.published == alone.shared == alone.published == []


def test_a_controller_that_does_not_answer_leaves_the_last_share():
    controller = Controller(2, {"encoder": [0.0], "prefill": [5_000.0, 0.0]}, answers=False)
    live = _live(controller)
    assert asyncio.run(live.route_shared(LARGE)).prefill == 0  # routed on no share: the tie's first
    assert live.router.view.foreign_queue_ms(P) is None  # nothing shared was made up
    assert len(controller.published) == 1
    assert _syncs(live, "unanswered") == 1


def _syncs(live: LiveRouting, outcome: str) -> float:
    labels = {"model_name": "", "outcome": outcome}
    return live.metrics.registry.get_sample_value("epd:route_syncs_total", labels) or 0.0
