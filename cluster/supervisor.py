"""Keeps the fleet whole and the router's view fresh: polls every worker's stats (its
load, which counts every replica's requests, and, for encoders, the media it holds) every
CHECK_PERIOD_S (IDLE_CHECK_PERIOD_S while the last check found the cluster quiet),
publishes them to the router, takes a dead worker out of routing and has the fleet
controller replace it (re-forming the collective group when tensors travel over one).
Each check also adopts the controller's newer snapshot, so a worker another replica had
replaced comes back into routing here too.

/health runs the same check, so it reports a death as soon as Ray knows of it.

Death and slowness are told apart: only Ray's word that an actor died (a failed call)
counts as death. A poll that times out means a busy worker; it stays in routing, and
only one that stays unresponsive for HUNG_AFTER_S is restarted as hung. Requests that
see a worker fail report it here at once, so routing and /health stop using it without
waiting for the next poll.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

import ray.exceptions as rx

from cluster.fleet_client import FleetClient
from cluster.recovery import RETRYABLE, WorkerLost
from router.router import Router
from router.types import WorkerKind

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 0.2  # also how fresh other replicas' load is in this one's routing view (their
# bookings travel with each check's controller heartbeat; workers' reports with its polls)
# While nothing is booked, queued or running anywhere, a check finds nothing to publish; its
# polls (a Ray call per worker, answered there) kept 0.05-0.07 cores busy on an idle 2-core
# host, which slows the next request's two-thread forward. A request that arrives routes on
# this replica's own bookings, and the next check (within this) sees it and checks at
# CHECK_PERIOD_S again.
IDLE_CHECK_PERIOD_S = 1.0  # below pool_scaling.DRAIN_GRACE_S: a drain is seen in time
PING_TIMEOUT_S = 5.0
CONFIRM_TIMEOUT_S = (
    2.0  # a suspect named by a failed request answers within this, or is presumed busy
)
HUNG_AFTER_S = 60.0


class Poll(str, enum.Enum):
    ALIVE = "alive"
    BUSY = "busy"  # did not answer in time
    DEAD = "dead"
    EMPTY = "empty"  # an autoscaled pool's slot with no worker (yet, or any more)


class Supervisor:
    def __init__(self, fleet: FleetClient, router: Router):
        self.fleet, self.router = fleet, router
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._restarting: dict[tuple[WorkerKind, int], asyncio.Task] = {}
        self._restart_lock: asyncio.Lock | None = None  # one re-formation of the group at a time
        self._busy_since: dict[tuple[WorkerKind, int], float] = {}
        self.num_restarts = 0
        self.latest_stats: dict[
            str, list[dict]
        ] = {}  # worker kind -> the last check's stats (for /metrics)
        self._followed: tuple[int, tuple] | None = None  # generation and infos routed with
        self._draining: set[tuple[WorkerKind, int]] = set()  # out of routing while they drain
        self.quiet = False  # the last check found nothing booked, queued, running or changing

    def ensure_running(self) -> None:
        if not self._stopped and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        """For good: the replica reconfigured in place and serves with a new one."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK_PERIOD_S if self.quiet else CHECK_PERIOD_S)
            try:
                booked = self.router.outstanding_ms()
                self.follow(await self.fleet.sync(booked))
                self.router.share_foreign(self.fleet.others_booked, self.fleet.num_replicas - 1)
                stats = await self.check()
                self.quiet = _nothing_booked(booked, self.fleet.others_booked) and self._settled(
                    stats
                )
            except Exception:  # supervision must outlive any one failure
                log.exception("supervisor check failed")

    async def check(self, timeout_s: float = PING_TIMEOUT_S) -> dict[WorkerKind, list[dict]]:
        """Poll every worker at once (a slow one must not delay the others' heartbeats), act
        on what is learnt, and return each worker's stats (or why there are none)."""
        snapshot = self.fleet.snapshot
        workers = [
            (kind, index) for kind in WorkerKind for index in range(len(snapshot.pools[kind]))
        ]
        results = await asyncio.gather(
            *[self._poll(kind, index, timeout_s) for kind, index in workers]
        )
        stats: dict[WorkerKind, list[dict]] = {kind: [] for kind in WorkerKind}
        for (kind, index), (outcome, report) in zip(workers, results):
            if (kind, index) in self._restarting:
                stats[kind].append({"error": "restarting"})
                continue
            if outcome is Poll.EMPTY:
                starting = (kind, index) in snapshot.scaling.starting
                stats[kind].append({"slot": "starting" if starting else "empty"})
                continue
            self._judge(kind, index, outcome, report)
            stats[kind].append(
                {**report[0], "draining": True}
                if report and (kind, index) in snapshot.scaling.draining
                else report[0]
                if report
                else {
                    "error": f"{outcome.value} (no answer within {timeout_s} s)"
                    if outcome is Poll.BUSY
                    else outcome.value
                }
            )
        self.latest_stats = {kind.value: workers for kind, workers in stats.items()}
        return stats

    def _settled(self, stats: dict[WorkerKind, list[dict]]) -> bool:
        """Every worker answered with nothing queued or running, and no worker is being
        restarted, drained or started."""
        scaling = self.fleet.snapshot.scaling
        if self._restarting or self._draining or scaling.starting or scaling.draining:
            return False
        return all(
            report.get("queued", 1) == 0 and report.get("running", 1) == 0
            for reports in stats.values()
            for report in reports
            if report.get("slot") != "empty"
        )

    def _judge(self, kind: WorkerKind, index: int, outcome: Poll, report) -> None:
        now = time.monotonic()
        if outcome is Poll.ALIVE:
            self._busy_since.pop((kind, index), None)
            self._publish(kind, index, *report)
        elif outcome is Poll.BUSY:
            since = self._busy_since.setdefault((kind, index), now)
            if now - since < HUNG_AFTER_S:
                self.router.publish(kind, index, now_s=now)  # a heartbeat: busy, not gone
            else:
                log.warning(
                    "%s worker %d has not answered for %.0f s; restarting it as hung",
                    kind.value,
                    index,
                    now - since,
                )
                self.restart(kind, index)
        else:
            self.restart(kind, index)

    async def _poll(self, kind: WorkerKind, index: int, timeout_s: float):
        actor = self.fleet.pools[kind][index]
        if actor is None:
            return Poll.EMPTY, None
        try:
            stats = await asyncio.wait_for(actor.stats.remote(), timeout=timeout_s)
            cached = None  # encoders: media identifiers; prefill workers: prefix block hashes
            if kind == WorkerKind.ENCODER:
                cached = await asyncio.wait_for(
                    actor.cached_identifiers.remote(), timeout=timeout_s
                )
            elif kind == WorkerKind.PREFILL:
                cached = await asyncio.wait_for(actor.prefix_hashes.remote(), timeout=timeout_s)
            return Poll.ALIVE, (stats, cached)
        except asyncio.TimeoutError:
            return Poll.BUSY, None
        except (*RETRYABLE, rx.RayTaskError) as exc:
            log.info("%s worker %d failed its poll: %s", kind.value, index, type(exc).__name__)
            return Poll.DEAD, None

    def _publish(
        self, kind: WorkerKind, index: int, stats: dict, cached: frozenset[str] | None
    ) -> None:
        self.router.publish(
            kind,
            index,
            now_s=time.monotonic(),
            queued=stats.get("queued"),
            running=stats.get("running"),
            cached_identifiers=cached if kind == WorkerKind.ENCODER else None,
            prefix_hashes=cached if kind == WorkerKind.PREFILL else None,
        )

    async def handle_lost(self, lost: WorkerLost) -> None:
        """A request saw a worker fail: confirm which (a poll) and take it out at once."""
        suspects = [s for s in lost.suspects if s not in self._restarting]
        results = await asyncio.gather(
            *[self._poll(kind, index, CONFIRM_TIMEOUT_S) for kind, index in suspects]
        )
        for (kind, index), (outcome, _) in zip(suspects, results):
            if outcome is Poll.DEAD:
                self.restart(kind, index)

    def restart(self, kind: WorkerKind, index: int) -> None:
        """Out of routing now; a replacement comes up in the background (once per worker)."""
        if (kind, index) in self._restarting:
            return
        log.warning("%s worker %d is down; restarting it", kind.value, index)
        self.router.set_healthy(kind, index, False)
        self._restarting[(kind, index)] = asyncio.get_running_loop().create_task(
            self._replace(kind, index)
        )

    async def _replace(self, kind: WorkerKind, index: int) -> None:
        self._restart_lock = self._restart_lock or asyncio.Lock()
        try:
            async with self._restart_lock:
                changed = await asyncio.to_thread(self.fleet.replace, kind, index)
            self.follow(changed)
            if self.fleet.snapshot.routable(kind, index):  # also if another replica replaced it
                self.router.set_healthy(kind, index, True)
            self.num_restarts += 1
        except Exception:
            log.exception(
                "restarting %s worker %d failed; the next check tries again", kind.value, index
            )
        finally:
            self._restarting.pop((kind, index), None)
            self._busy_since.pop((kind, index), None)

    def follow(self, changed: list[tuple[WorkerKind, int]]) -> None:
        """Route as the snapshot held says: workers with a new actor (replaced, or started by
        autoscaling) route again; draining ones and empty slots leave routing, an emptied
        slot's caches the view; workers placed on a node anew are placed so."""
        snapshot = self.fleet.snapshot
        if self._followed == (snapshot.generation, snapshot.infos) and not changed:
            return
        if self._followed is not None and self._followed[1] != snapshot.infos:
            self.router.set_infos(snapshot.infos)
        self._followed, now = (snapshot.generation, snapshot.infos), time.monotonic()
        for kind, index in changed:
            self._busy_since.pop((kind, index), None)
            if snapshot.pools[kind][index] is None:
                self.router.forget(kind, index, now)
            else:
                self.router.set_healthy(kind, index, True)
        self._follow_draining(snapshot)

    def _follow_draining(self, snapshot) -> None:
        draining = {
            (kind, index)
            for kind, index in snapshot.scaling.draining
            if snapshot.pools[kind][index] is not None
        }
        for kind, index in draining - self._draining:
            self.router.set_healthy(kind, index, False)
        for kind, index in self._draining - draining:
            if snapshot.routable(kind, index):  # taken back (not stopped: that empties it)
                self.router.set_healthy(kind, index, True)
        self._draining = draining

    @property
    def restarting(self) -> list[tuple[WorkerKind, int]]:
        return list(self._restarting)


def _nothing_booked(*bookings: dict[str, list[float]] | None) -> bool:
    """No ms booked on any worker in these shares (outstanding_ms() or others_booked)."""
    return not any(ms for booked in bookings if booked for row in booked.values() for ms in row)
