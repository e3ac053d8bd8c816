"""Supervision (cluster/supervisor.py) tells a busy worker from a dead one: a poll that
times out keeps the worker in routing (a heartbeat), Ray's word that the actor died takes
it out and restarts it, and only a worker silent for HUNG_AFTER_S is restarted as hung.
The fleet is a stand-in whose actors answer slowly, die or answer; the router is real."""

from __future__ import annotations

import asyncio

import ray.exceptions as rx

from cluster import supervisor as sup
from cluster.snapshot import FleetSnapshot
from router.router import Router
from router.types import WorkerInfo, WorkerKind

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


class _Method:
    def __init__(self, actor: _Actor, value):
        self.actor, self.value = actor, value

    def remote(self):
        return self.actor.answer(self.value)


class _Actor:
    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.stats = _Method(self, {"queued": 0, "running": 0})
        self.cached_identifiers = _Method(self, frozenset())
        self.prefix_hashes = _Method(self, frozenset({"block-0"}))

    async def answer(self, value):
        if self.mode == "dead":
            raise rx.ActorDiedError()
        if self.mode == "busy":
            await asyncio.sleep(60)
        return value


class _Fleet:
    def __init__(self):
        self.pools = {E: [_Actor()], P: [_Actor()], D: [_Actor()]}
        self.replaced: list[tuple[WorkerKind, int]] = []
        self.booked: list[dict | None] = []  # what each heartbeat shared
        self.others_booked: dict | None = None
        self.num_replicas = 1

    async def sync(self, booked: dict | None = None) -> list[tuple[WorkerKind, int]]:
        self.booked.append(booked)
        return []

    @property
    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(
            len(self.replaced),
            {k: tuple(a) for k, a in self.pools.items()},
            {k: tuple(str(id(x)) for x in a) for k, a in self.pools.items()},
            (),
            None,
        )

    def replace(self, kind: WorkerKind, index: int) -> list[tuple[WorkerKind, int]]:
        self.replaced.append((kind, index))
        self.pools[kind][index] = _Actor()
        return [(kind, index)]


def _setup(monkeypatch):
    monkeypatch.setattr(sup, "PING_TIMEOUT_S", 0.05)
    fleet = _Fleet()
    router = Router(
        [WorkerInfo(E, 0, modalities=frozenset({"image"})), WorkerInfo(P, 0), WorkerInfo(D, 0)],
        dead_after_s=10.0,
    )
    return fleet, router, sup.Supervisor(fleet, router)


def test_a_busy_worker_stays_in_routing_and_is_not_restarted(monkeypatch):
    fleet, router, supervisor = _setup(monkeypatch)
    fleet.pools[D][0].mode = "busy"

    async def run():
        stats = await supervisor.check(0.05)
        return stats, router.view.candidates(D)

    stats, candidates = asyncio.run(run())
    assert candidates == [0] and fleet.replaced == []
    assert "busy" in stats[D][0]["error"] and stats[P][0] == {"queued": 0, "running": 0}


def test_prefill_workers_fill_the_routers_prefix_index(monkeypatch):
    fleet, router, supervisor = _setup(monkeypatch)
    asyncio.run(supervisor.check(0.05))
    assert router.view.prefix_matches(("block-0", "block-1")) == {0: 1}
    assert router.view.prefix_matches(("block-1",)) == {}


def test_a_dead_worker_leaves_routing_at_once_and_is_replaced(monkeypatch):
    fleet, router, supervisor = _setup(monkeypatch)
    fleet.pools[P][0].mode = "dead"

    async def run():
        await supervisor.check(0.05)
        healthy_during = router.view.healthy[P][0]
        await asyncio.gather(*supervisor._restarting.values())
        return healthy_during

    assert asyncio.run(run()) is False
    assert (
        fleet.replaced == [(P, 0)]
        and router.view.healthy[P][0] is True
        and supervisor.num_restarts == 1
    )


def test_a_worker_silent_past_the_hung_limit_is_restarted(monkeypatch):
    fleet, router, supervisor = _setup(monkeypatch)
    fleet.pools[E][0].mode = "busy"
    monkeypatch.setattr(sup, "HUNG_AFTER_S", 0.0)

    async def run():
        await supervisor.check(0.05)  # first silence: noted
        await supervisor.check(0.05)  # still silent past the (zero) limit: hung
        await asyncio.gather(*supervisor._restarting.values())

    asyncio.run(run())
    assert fleet.replaced == [(E, 0)]


def test_checks_slow_down_while_the_cluster_is_quiet_and_speed_up_with_work(monkeypatch):
    fleet, router, supervisor = _setup(monkeypatch)
    monkeypatch.setattr(sup, "CHECK_PERIOD_S", 0.01)
    monkeypatch.setattr(sup, "IDLE_CHECK_PERIOD_S", 0.4)
    decode = fleet.pools[D][0]

    async def run() -> tuple[int, int]:
        supervisor.ensure_running()
        await asyncio.sleep(0.3)  # one check, then a quiet period
        num_quiet = len(fleet.booked)
        decode.stats = _Method(decode, {"queued": 0, "running": 1})  # a row decoding
        await asyncio.sleep(0.9)  # the next check sees it; the ones after come quickly
        supervisor.stop()
        return num_quiet, len(fleet.booked) - num_quiet

    num_quiet, num_busy = asyncio.run(run())
    assert supervisor.quiet is False
    assert num_quiet == 1
    assert num_busy >= 5


def test_booked_work_anywhere_keeps_checks_at_the_busy_period():
    assert sup._nothing_booked({"encoder": [0.0], "prefill": [0.0, 0.0]}, None)
    assert not sup._nothing_booked({"encoder": [0.0], "prefill": [0.0, 12.5]}, None)
    assert not sup._nothing_booked({"encoder": [0.0]}, {"prefill": [3.0]})  # another replica's
