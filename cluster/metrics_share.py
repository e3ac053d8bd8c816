"""A replica's side of the app-wide /metrics: it pushes its own exposition to the fleet
controller every PUSH_PERIOD_S, and answers a scrape with its own live registry merged
with the other replicas' latest pushes and the retired sum (cluster/metrics_merge.py has
the rule per metric kind). So a scrape through Serve's proxy reads the same totals
whichever replica answers, at most PUSH_PERIOD_S behind for the others' requests.

A scrape hands the controller the exposition it shows before it answers: were the replica to
die right after, the book (and so the retired sum) would still hold those counts, and the next
scrape, on another replica, cannot read less. Prometheus takes any drop of a counter for a
restart and counts the whole total again as new requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from cluster.fleet_client import FleetClient
from cluster.metrics_merge import merge

log = logging.getLogger(__name__)

PUSH_PERIOD_S = 1.0
_CONTROLLER_TIMEOUT_S = 5.0  # a controller busy longer than this: the last peers seen stand in


class MetricsShare:
    def __init__(
        self,
        fleet: FleetClient,
        own: Callable[[], bytes],
        booked: Callable[[], dict[str, list[float]]] = dict,
    ):
        """`own()`: this replica's exposition (Metrics.exposition); `booked()`: its router's
        running totals of booked ms per worker, pushed alongside (the controller's
        autoscaling load)."""
        self._fleet, self._own, self._booked = fleet, own, booked
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._peers: list[
            str | bytes
        ] = []  # the last answer, for a scrape while the controller is busy or gone
        self._renderings = itertools.count(
            1
        )  # numbers each exposition handed over: the book keeps the latest

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
            try:
                await self.push()
            except (
                Exception
            ) as exc:  # pushing must outlive a controller's restart; the next push tries again
                log.info("pushing metrics to the fleet controller failed: %s", type(exc).__name__)
            await asyncio.sleep(PUSH_PERIOD_S)

    async def push(self) -> None:
        seq = next(self._renderings)
        own = await asyncio.to_thread(
            self._own
        )  # ~10 ms of rendering each second: off the event loop
        await asyncio.wait_for(
            self._fleet.controller.report_metrics.remote(
                self._fleet.owner, own, seq, self._booked()
            ),
            _CONTROLLER_TIMEOUT_S,
        )

    async def exposition(self) -> bytes:
        """This replica's live metrics plus every other replica's (live: latest push; dead:
        retired)."""
        seq, own = next(self._renderings), self._own()
        try:
            share = self._fleet.controller.share_metrics.remote(self._fleet.owner, own, seq)
            self._peers = await asyncio.wait_for(share, _CONTROLLER_TIMEOUT_S)
        except Exception as exc:  # the others' last known counts beat none: totals must not drop
            log.warning(
                "the fleet controller gave no peer metrics (%s); merging the last seen",
                type(exc).__name__,
            )
        if not self._peers:  # the only replica there ever was
            return own
        return await asyncio.to_thread(
            merge, [own, *self._peers]
        )  # tens of ms of parsing: not on the event loop
