"""Keeps the fleet whole and the router's view fresh: polls every worker's stats (its
load and, for encoders, the media it holds), publishes them to the router, takes a dead
worker out of routing and restarts it (re-forming the collective group when tensors
travel over one)."""
from __future__ import annotations

import asyncio
import logging
import time

from cluster.fleet import Fleet
from router.router import Router
from router.types import WorkerKind

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 2.0
PING_TIMEOUT_S = 10.0


class Supervisor:
    def __init__(self, fleet: Fleet, router: Router):
        self.fleet, self.router = fleet, router
        self._task: asyncio.Task | None = None
        self.num_restarts = 0

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_PERIOD_S)
            try:
                await self.check()
            except Exception:  # supervision must outlive any one failure
                log.exception("supervisor check failed")

    async def check(self) -> None:
        for kind in WorkerKind:
            for index, actor in enumerate(list(self.fleet.pools[kind])):
                report = await self._poll(kind, actor)
                if report is None:
                    await self._restart(kind, index)
                else:
                    self._publish(kind, index, *report)

    @staticmethod
    async def _poll(kind: WorkerKind, actor):
        try:
            stats = await asyncio.wait_for(actor.stats.remote(), timeout=PING_TIMEOUT_S)
            cached = None
            if kind == WorkerKind.ENCODER:
                cached = await asyncio.wait_for(actor.cached_identifiers.remote(), timeout=PING_TIMEOUT_S)
            return stats, cached
        except Exception:
            return None

    def _publish(self, kind: WorkerKind, index: int, stats: dict, cached: frozenset[str] | None) -> None:
        self.router.publish(
            kind, index, now_s=time.monotonic(), queued=stats.get("queued"), running=stats.get("running"), cached_identifiers=cached
        )

    async def _restart(self, kind: WorkerKind, index: int) -> None:
        log.warning("%s worker %d is down; restarting it", kind.value, index)
        self.router.set_healthy(kind, index, False)
        await asyncio.to_thread(self.fleet.replace, kind, index)
        self.router.set_healthy(kind, index, True)
        self.num_restarts += 1
