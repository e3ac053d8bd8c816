"""The discrete-event loop: simulated workers, the real `Router` deciding.

Every request is routed by `router.router.Router.route` (the live cluster's router:
same cost model, view and policy objects); the simulator then plays the request
through the chosen workers following the ground truth in `cluster_model`, and reports
back what a live worker would: `encode_done` / `prefill_done` with measured durations
(so the cost model calibrates online), `observe_transfer`, `decode_done`, and every
`publish_interval_s` each worker's queue sizes and cache contents through `publish`.

A request's life:

    arrival -> route -> encoder queue (cache hits skip it) -> batch done
            -> embeddings transfer -> prefill queue -> first token (TTFT ends here)
            -> KV transfer -> decode (continuous batch) -> done

The workers are three pools (router/sim/pools.py: EncoderPool, PrefillPool, DecodePool), each
with its queues, caches and service model; this module routes requests, moves them between
the pools and dispatches events. A cached item still sends its embeddings; a request the
router split by modality (RouteDecision.shares) moves to prefill once its last item is
encoded, each encoder's part in parallel (the slowest transfer counts).

Variability (SimCosts.variability, off by default): each encode batch and prefill takes its
cost-model time x (1 + contention x the other busy requests at its start) x the host's
slowness then x its own noise (mean-1 lognormals); busy requests are those arrived whose
first token is not out, less those waiting in a prefill worker's queue (they use no CPU). An
ingress overhead (SimCosts.ingress_ms, ingress_media_ms; 0 by default) delays a request's
routing, scaled the same way with its own noise (router/sim/variability.py).

Hot path: events are plain tuples (time_s, type, a, b) on a heapq (ties broken by
type then ints, so runs are deterministic); arrivals stream from the workload and
never touch the heap.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from router.router import SYNC_ABOVE_MS
from router.sim.cluster_model import SimCluster, capacity_rps
from router.sim.pools import (
    EV_ADMIT,
    EV_PF_ARRIVE,
    EV_PUBLISH,
    DecodePool,
    EncoderPool,
    Network,
    PrefillPool,
    Request,
)
from router.sim.variability import Multipliers
from router.sim.workload import Workload


@dataclass
class SimResult:
    policy: str
    cluster: str
    workload: str
    slo_ms: float
    offered_rps: float
    load: float | None  # offered / capacity, when known
    arrival_s: np.ndarray
    ttft_ms: np.ndarray  # simulated: arrival -> end of prefill
    estimate_ms: np.ndarray  # the router's TTFT estimate at routing time
    service_ms: np.ndarray  # encode batches + embeddings transfer + prefill service of each request
    span_s: float  # first arrival -> last completion
    utilisation: dict[str, float]
    wall_s: float
    cache_hits: int = 0
    media_items: int = 0
    completed: int = 0  # requests that finished decoding (== len(ttft_ms) after a full run)
    measured_ttft_ms: np.ndarray | None = None
    decisions: list | None = None  # (encoder, prefill, decode) per request, when record_decisions
    decode_wait_ms: np.ndarray | None = None  # KV landed -> admitted to a decode batch, per request
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        from router.sim.report import summarize

        return summarize(self)


def default_priors(cluster: SimCluster):
    """The router's priors for a simulated cluster: the cost model's own defaults (the
    seed table); the simulated workers' truth differs (batching, speeds) and the router
    learns it online, as it would in production."""
    from router.cost_model import CostPriors

    return CostPriors()


def make_router(cluster: SimCluster, policy: str, *, seed: int, priors=None, **kwargs):
    from router.router import Router

    kwargs.setdefault("prefill_chunk_tokens", cluster.costs.prefill.max_chunk_tokens)
    kwargs.setdefault("prefill_preempts", cluster.costs.prefill.preempt_at_layers)
    return Router(
        cluster.worker_infos(),
        priors if priors is not None else default_priors(cluster),
        policy,
        seed=seed,
        **kwargs,
    )


def simulate(
    cluster: SimCluster,
    workload: Workload,
    policy: str,
    *,
    seed: int = 0,
    slo_ms: float = 1000.0,
    priors=None,
    progress: bool = False,
    record_decisions: bool = False,
    load: float | None = None,
    router_kwargs: dict | None = None,
    routers: int = 1,
    sync_above_ms: float = SYNC_ABOVE_MS,
) -> SimResult:
    """Play `workload` through `cluster`, every request routed by a fresh
    `Router(cluster.worker_infos(), priors, policy, seed=seed)`; `priors` default to
    the cost model's own (`CostPriors()`), which the router then calibrates online.
    `routers` > 1: that many ingress replicas' routers take turns (router/sim/routers.py),
    sharing what they booked every publish interval, and at once around a request whose
    prefill is estimated above `sync_above_ms` (0: never).
    Raises ClusterShapeError (before simulating) when no encoder hosts a modality the
    workload needs. Returns per-request TTFTs and pool statistics (`.summary()`)."""
    cluster.check_workload(workload.modalities())
    kwargs = router_kwargs or {}
    router = make_router(cluster, policy, seed=seed, priors=priors, **kwargs)
    if routers > 1:
        from router.sim.routers import RouterGroup

        others = [
            make_router(cluster, policy, seed=seed + i, priors=priors, **kwargs)
            for i in range(1, routers)
        ]
        router = RouterGroup([router, *others], sync_above_ms)
    if load is None:
        try:
            cap = capacity_rps(cluster, workload)
            load = workload.rate_rps / cap if cap > 0 and math.isfinite(workload.rate_rps) else None
        except ValueError:
            load = None
    return run_router(
        cluster,
        workload,
        router,
        policy,
        slo_ms=slo_ms,
        progress=progress,
        record_decisions=record_decisions,
        load=load,
    )


def run_router(
    cluster: SimCluster,
    workload: Workload,
    router,
    policy: str,
    *,
    slo_ms: float,
    progress: bool,
    record_decisions: bool,
    load: float | None,
) -> SimResult:
    """Play `workload` through `cluster` with an existing router (simulate() builds one)."""
    wall0 = time.perf_counter()
    engine = Engine(cluster, workload, router, record_decisions=record_decisions)
    engine.run(_progress_bar(len(workload), policy) if progress else None)
    span_s = max(engine.last_done - (engine.arrivals[0] if engine.arrivals else 0.0), 1e-9)
    span_ms, costs = span_s * 1e3, cluster.costs
    n_enc, n_pf, n_dec = len(cluster.encoders), len(cluster.prefill), len(cluster.decode)
    util = {
        "encoder": engine.encoders.busy_ms() / (span_ms * n_enc) if n_enc else 0.0,
        "prefill": engine.prefill.busy_ms() / (span_ms * n_pf),
        "decode": engine.decode.slot_ms / (span_ms * n_dec * costs.decode_max_batch),
    }
    return SimResult(
        policy=policy,
        cluster=cluster.name,
        workload=workload.name,
        slo_ms=slo_ms,
        offered_rps=workload.rate_rps,
        load=load,
        arrival_s=np.asarray(engine.arrivals),
        ttft_ms=np.asarray(engine.ttft),
        estimate_ms=np.asarray(engine.estimate),
        service_ms=np.asarray(engine.service),
        span_s=span_s,
        utilisation=util,
        wall_s=time.perf_counter() - wall0,
        cache_hits=engine.encoders.cache_hits,
        media_items=engine.media_items,
        completed=engine.completed,
        measured_ttft_ms=workload.measured_ttft_ms,
        decisions=engine.decisions,
        decode_wait_ms=np.asarray(engine.decode_wait),
    )


def _progress_bar(n: int, policy: str):
    from tqdm import tqdm

    return tqdm(total=n, desc=f"simulate {policy}", unit="req", mininterval=0.5, smoothing=0.05)


class Engine:
    """The event loop: arrivals stream from the workload, everything else is a
    (time_s, event type, int, int) tuple on a heap, handled by the pool it concerns."""

    def __init__(
        self, cluster: SimCluster, workload: Workload, router, *, record_decisions: bool = False
    ):
        costs = cluster.costs
        nodes = sorted({w.node for w in (*cluster.encoders, *cluster.prefill, *cluster.decode)})
        self.workload, self.router, self.heap = workload, router, []
        self.arrivals: list[float] = workload.arrival_s.tolist()
        n = len(self.arrivals)
        self.network = Network(costs)
        self.encoders = EncoderPool(cluster.encoders, nodes, costs, self)
        self.prefill = PrefillPool(cluster.prefill, nodes, costs, self)
        self.decode = DecodePool(cluster.decode, nodes, costs, self)
        self.kv_bytes_per_token, self.publish_s = costs.kv_bytes_per_token, costs.publish_interval_s
        # service-time variability: off by default (then nothing draws)
        self.mult = Multipliers(costs.variability) if costs.variability.enabled else None
        self.count_decoding = costs.variability.count_decoding
        self.ingress_ms, self.ingress_media_ms = costs.ingress_ms, costs.ingress_media_ms
        self.inflight = (
            0  # requests arrived whose first token is not out yet (the host's contention)
        )
        self.requests: list[Request | None] = [None] * n
        self.ttft, self.estimate, self.service = [0.0] * n, [0.0] * n, [0.0] * n
        self.decode_wait = [0.0] * n  # ms a request's landed KV waited for a decode slot
        self.decisions: list | None = [None] * n if record_decisions else None
        self.media_items = self.completed = 0
        self.last_done = self.arrivals[0] if n else 0.0

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, bar=None) -> None:
        arrivals, heap, n = self.arrivals, self.heap, len(self.arrivals)
        if not n:
            return
        handlers = (
            self._encode_done,
            self._prefill_done,
            self._decode_done,
            self._prefill_arrive,
            self._publish,
            self._admit,
        )  # indexed by event type
        delayed = (
            self.ingress_ms > 0 or self.ingress_media_ms > 0
        )  # routed once their ingress overhead is over
        self._publish(arrivals[0], 0, 0)
        profiles, arrive, i, tick, next_arrival = (
            iter(self.workload.profiles),
            self._route,
            0,
            0,
            arrivals[0],
        )
        while True:
            if heap and heap[0][0] <= next_arrival:
                now, ev, a, b = heappop(heap)
                handlers[ev](now, a, b)
                continue
            if i >= n:
                break
            now, r = next_arrival, i
            i += 1
            next_arrival = arrivals[i] if i < n else math.inf
            req = self.requests[r] = Request(next(profiles))
            self.inflight += 1
            if delayed:
                heappush(heap, (now + self._ingress_ms(req.profile, now) * 1e-3, EV_ADMIT, r, 0))
            else:
                arrive(r, req, now)
            if bar is not None:
                tick += 1
                if tick >= 4096:
                    bar.update(tick)
                    tick = 0
        if bar is not None:
            bar.update(tick)
            bar.close()

    def scaled(self, ms: float, now: float) -> float:
        """A service's ms with variability applied (drawn at its start)."""
        return ms if self.mult is None else ms * self.mult.service(self._busy_others(), now)

    def _busy_others(self) -> int:
        """Other requests in flight doing work (not waiting in a prefill queue), and with
        count_decoding those decoding: the host's contention."""
        n = self.inflight - self.prefill.waiting() - 1
        return n + self.decode.num_active if self.count_decoding else n

    def _ingress_ms(self, prof, now: float) -> float:
        """The request's ingress overhead (admission, RPCs, hand-overs: no modelled worker)."""
        ms = self.ingress_ms + self.ingress_media_ms if prof.items else self.ingress_ms
        return ms * self.mult.ingress(self._busy_others(), now) if self.mult is not None else ms

    # -- a request's path -------------------------------------------------------------------------
    def _route(self, r: int, req: Request, now: float) -> None:
        decision = req.decision = self.router.route(req.profile, now)
        self.estimate[r] = decision.estimate.total_ms
        if self.decisions is not None:
            self.decisions[r] = (decision.encoder, decision.prefill, decision.decode)
        if req.profile.items:
            self.media_items += len(req.profile.items)
            if not self.encoders.queue_request(r, req, now):  # all cached: straight on
                self.to_prefill(r, req, now, 0.0, 0.0, ())
        else:  # text only: straight to the prefill worker
            self.prefill.arrive(decision.prefill, r, now)

    def to_prefill(
        self, r: int, req: Request, now: float, encode_ms: float, wall_ms: float, encoded
    ) -> None:
        """r's items are encoded (or needed no encoding): report it, send the embeddings on.
        `encode_ms`: compute time of r's items, `wall_ms`: their batches' full times."""
        decision, p = req.decision, req.decision.prefill
        self.router.encode_done(decision, now, encode_ms, encoded)
        if decision.shares:  # each encoder sends its part, in parallel: the slowest arrives last
            xfer = 0.0
            for share in decision.shares:
                x = self._send(
                    share.encoder,
                    p,
                    [it for it in req.profile.items if it.modality in share.modalities],
                )
                xfer = x if x > xfer else xfer
        else:
            xfer = self._send(decision.encoder, p, req.profile.items)
        self.service[r] = wall_ms + xfer
        heappush(self.heap, (now + xfer * 1e-3, EV_PF_ARRIVE, r, 0))

    def _send(self, e: int, p: int, items) -> float:
        """Transfer ms of `items`' embeddings from encoder e to prefill worker p (reported to the
        router)."""
        num_bytes = sum([it.embedding_bytes for it in items])
        placement, ms = self.network.send_ms(
            self.encoders.workers[e].node, self.prefill.workers[p].node, num_bytes
        )
        self.router.observe_transfer(placement, num_bytes, ms)
        return ms

    # -- events -----------------------------------------------------------------------------------
    def _encode_done(self, now: float, e: int, _: int) -> None:
        self.encoders.finish_batch(e, now)

    def _prefill_arrive(self, now: float, r: int, _: int) -> None:
        self.prefill.arrive(self.requests[r].decision.prefill, r, now)

    def _prefill_done(self, now: float, p: int, r: int) -> None:
        """First token out: TTFT ends; the KV cache leaves for decode; the next job starts.
        (Only a chunk of r's prompt, with SimCosts.prefill.max_chunk_tokens: the worker went on.)"""
        done = self.prefill.finish(p, r, now)
        if done is None:
            return
        self.inflight -= 1
        ms, uncached = done
        req = self.requests[r]
        prof, decision = req.profile, req.decision
        self.ttft[r] = (now - self.arrivals[r]) * 1e3
        self.service[r] += ms
        self.router.prefill_done(decision, now, ms, uncached)
        if prof.prefix_hashes:
            self.prefill.remember(p, prof.prefix_hashes)
        d = decision.decode
        _, kv_ms = self.network.send_ms(
            self.prefill.workers[p].node,
            self.decode.node[d],
            prof.num_prompt_tokens * self.kv_bytes_per_token,
        )
        self.decode.submit(d, r, prof.max_tokens, now + kv_ms * 1e-3)
        self.prefill.start_next(p, now)

    def _decode_done(self, now: float, d: int, r: int) -> None:
        self.router.decode_done(self.requests[r].decision, now)
        self.requests[r] = None
        self.completed += 1
        self.last_done = now
        self.decode.finish(d, now)

    def _admit(self, now: float, r: int, _: int) -> None:
        self._route(r, self.requests[r], now)  # its ingress overhead is over

    def _publish(self, now: float, _a: int, _b: int) -> None:
        """Every publish interval each worker reports its queues and cache contents."""
        publish = self.router.publish
        self.encoders.publish(publish, now)
        self.prefill.publish(publish, now)
        self.decode.publish(publish, now)
        if hasattr(self.router, "share"):  # several routers: they share their bookings too
            self.router.share()
        if self.completed < len(self.arrivals):
            heappush(self.heap, (now + self.publish_s, EV_PUBLISH, 0, 0))
