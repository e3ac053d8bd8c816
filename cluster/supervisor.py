"""Keeps the fleet whole: pings every worker, takes a dead one out of routing and
restarts it (re-forming the collective group when tensors travel over one)."""
from __future__ import annotations

import asyncio
import logging

from cluster.fleet import Fleet
from router.types import WorkerKind
from router.view import ClusterView

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 2.0
PING_TIMEOUT_S = 10.0


class Supervisor:
    def __init__(self, fleet: Fleet, view: ClusterView):
        self.fleet, self.view = fleet, view
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
                if not await self._alive(actor):
                    await self._restart(kind, index)

    @staticmethod
    async def _alive(actor) -> bool:
        try:
            return await asyncio.wait_for(actor.ready.remote(), timeout=PING_TIMEOUT_S)
        except Exception:
            return False

    async def _restart(self, kind: WorkerKind, index: int) -> None:
        log.warning("%s worker %d is down; restarting it", kind.value, index)
        self.view.set_healthy(kind, index, False)
        await asyncio.to_thread(self.fleet.replace, kind, index)
        self.view.set_healthy(kind, index, True)
        self.num_restarts += 1
