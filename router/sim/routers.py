"""Several ingress replicas' routers over one simulated fleet, as the live cluster runs them.

Serve spreads requests over the replicas (here round-robin); each replica's router books only
the requests it routed and learns of the others' from the workers' reports, which every router
receives at each publish (`SimCosts.publish_interval_s`: the sharing period; the live
supervisor polls every 0.2 s). A worker's reported queue beyond a router's own bookings is
other replicas' work, which its cost model prices (router/view.py, `foreign`).

At each publish the routers also share what they booked (`share`): each learns the others'
booked ms per encoder and prefill worker, as the live replicas do through the fleet
controller's heartbeat, and prices it as queued work (router/view.py, `foreign_queue_ms`).
A large request (`sync_above_ms`: its prefill estimated above that on the fastest worker) does
not wait for the period: its router heartbeats before routing it, learning what the others
last published, and again after booking it, publishing its own (the live replicas'
`router.sync_above_ms`). Stale views herd large requests onto the same idle worker; these
heartbeats keep them apart (at 50 ms, 71% of the seed mix's requests on 16x16x16-hetero).

Completions go back to the router that routed the request; transfer timings, which carry no
request, calibrate every router (the network is the same for all).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.router import Router
from router.types import RequestProfile, RouteDecision


class RouterGroup:
    """The Router interface the simulator's engine drives, over `routers`."""

    def __init__(self, routers: Sequence[Router], sync_above_ms: float = 0.0):
        self.routers = list(routers)
        self.sync_above_ms = sync_above_ms  # 0: only the periodic share
        self._turn = 0
        self._owner: dict[int, Router] = {}  # id(decision) -> its router, until decode_done
        # Each router's outstanding_ms() as of its last heartbeat: what the others learn.
        self._published: list[dict[str, list[float]] | None] = [None] * len(self.routers)

    def route(self, profile: RequestProfile, now_s: float) -> RouteDecision:
        turn = self._turn
        router = self.routers[turn]
        self._turn = (turn + 1) % len(self.routers)
        large = 0 < self.sync_above_ms < router.prefill_floor_ms(profile)
        if large:
            self._heartbeat(turn)
        decision = router.route(profile, now_s)
        if large:
            self._published[turn] = router.outstanding_ms()
        self._owner[id(decision)] = router
        return decision

    def encode_done(self, decision: RouteDecision, now_s: float, *args) -> None:
        self._owner[id(decision)].encode_done(decision, now_s, *args)

    def prefill_done(self, decision: RouteDecision, now_s: float, *args) -> None:
        self._owner[id(decision)].prefill_done(decision, now_s, *args)

    def decode_done(self, decision: RouteDecision, now_s: float) -> None:
        self._owner.pop(id(decision)).decode_done(decision, now_s)

    def observe_transfer(self, *args) -> None:
        for router in self.routers:
            router.observe_transfer(*args)

    def publish(self, *args, **kwargs) -> None:
        for router in self.routers:
            router.publish(*args, **kwargs)

    def share(self) -> None:
        """Every router heartbeats: each learns the others' booked ms per encoder and prefill
        worker, summed (the live fleet controller's heartbeat answer)."""
        self._published = [router.outstanding_ms() for router in self.routers]
        for turn in range(len(self.routers)):
            self._learn(turn)

    def _heartbeat(self, turn: int) -> None:
        self._published[turn] = self.routers[turn].outstanding_ms()
        self._learn(turn)

    def _learn(self, turn: int) -> None:
        others = [b for i, b in enumerate(self._published) if i != turn and b is not None]
        if not others:
            return
        summed = {kind: [sum(ms) for ms in zip(*(b[kind] for b in others))] for kind in others[0]}
        self.routers[turn].share_foreign(summed, len(self.routers) - 1)
