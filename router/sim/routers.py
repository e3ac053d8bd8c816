"""Several ingress replicas' routers over one simulated fleet, as the live cluster runs them.

Serve spreads requests over the replicas (here round-robin); each replica's router books only
the requests it routed and learns of the others' from the workers' reports, which every router
receives at each publish (`SimCosts.publish_interval_s`: the sharing period; the live
supervisor polls every 0.2 s). A worker's reported queue beyond a router's own bookings is
other replicas' work, which its cost model prices (router/view.py, `foreign`).

At each publish the routers also share what they booked (`share`): each learns the others'
booked ms per encoder and prefill worker, as the live replicas do through the fleet
controller's heartbeat, and prices it as queued work (router/view.py, `foreign_queue_ms`).

Completions go back to the router that routed the request; transfer timings, which carry no
request, calibrate every router (the network is the same for all).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.router import Router
from router.types import RequestProfile, RouteDecision


class RouterGroup:
    """The Router interface the simulator's engine drives, over `routers`."""

    def __init__(self, routers: Sequence[Router]):
        self.routers = list(routers)
        self._turn = 0
        self._owner: dict[int, Router] = {}  # id(decision) -> its router, until decode_done

    def route(self, profile: RequestProfile, now_s: float) -> RouteDecision:
        router = self.routers[self._turn]
        self._turn = (self._turn + 1) % len(self.routers)
        decision = router.route(profile, now_s)
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
        """Each router learns the others' booked ms per encoder and prefill worker, summed (the
        live fleet controller's heartbeat answer)."""
        booked = [router.outstanding_ms() for router in self.routers]
        for router, own in zip(self.routers, booked):
            others = {
                kind: [sum(ms) - mine for ms, mine in zip(zip(*(b[kind] for b in booked)), values)]
                for kind, values in own.items()
            }
            router.share_foreign(others, len(self.routers) - 1)
