"""The discrete-event loop: simulated workers, the real `Router` deciding.

Every request is routed by `router.router.Router.route` (the live cluster's router:
same cost model, view and policy objects); the simulator then plays the request
through the chosen workers following the ground truth in `cluster_model`, and reports
back what a live worker would: `encode_done` / `prefill_done` with measured durations
(so the cost model calibrates online), `observe_transfer`, `decode_done`, and every
`publish_interval_s` each worker's queue sizes and cache contents through `publish`.

A request's life:

    arrival -> route -> encoder queue (cache hits skip it) -> batch done
            -> embeddings transfer -> prefill FIFO -> first token (TTFT ends here)
            -> KV transfer -> decode (continuous batch) -> done

Workers:
- encoder: one batch at a time; the next batch is up to `encode_max_batch` items of the
  modality whose oldest queued item is oldest; batch time from `EncodeCost.batch_ms`.
  An LRU of identifiers holding up to `encoder_cache_bytes` of embeddings; an item whose identifier the chosen
  encoder holds at dispatch (or appears twice in the request) skips encoding, though
  its embeddings still travel. Items are cached when their batch finishes. A request the
  router split by modality (RouteDecision.shares) queues each item on its modality's
  encoder; its embeddings move to prefill once the last item is encoded, each encoder's
  part in parallel (the slowest transfer counts), and its encoders are released then.
- prefill: FIFO, one request at a time; the uncached part of the prompt is what the
  worker's prefix LRU (of `prefix_cache_blocks` block hashes) misses at service start.
- decode: admitted while fewer than `decode_max_batch` run, else FIFO wait; duration
  fixed at admission (see cluster_model). To save an event per request, admission is
  decided when the prefill finishes and takes effect when the KV cache lands.

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
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from router.sim.cluster_model import SimCluster, capacity_rps
from router.sim.variability import Multipliers
from router.sim.workload import Workload
from router.types import Placement, WorkerKind

_E, _P, _D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE

# event types; the order is the tie-break at equal times: completions before new work
EV_ENC_DONE = 0
EV_PF_DONE = 1
EV_DEC_DONE = 2
EV_PF_ARRIVE = 3
EV_PUBLISH = 4
EV_ADMIT = 5  # a request's ingress overhead is over (only with SimCosts.ingress_ms / ingress_media_ms)


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

    return Router(cluster.worker_infos(), priors if priors is not None else default_priors(cluster), policy,
                  seed=seed, **kwargs)


def simulate(cluster: SimCluster, workload: Workload, policy: str, *, seed: int = 0, slo_ms: float = 1000.0,
             priors=None, progress: bool = False, record_decisions: bool = False, load: float | None = None,
             router_kwargs: dict | None = None) -> SimResult:
    """Play `workload` through `cluster`, every request routed by a fresh
    `Router(cluster.worker_infos(), priors, policy, seed=seed)`; `priors` default to
    the cost model's own (`CostPriors()`), which the router then calibrates online.
    Raises ClusterShapeError (before simulating) when no encoder hosts a modality the
    workload needs. Returns per-request TTFTs and pool statistics (`.summary()`)."""
    cluster.check_workload(workload.modalities())
    router = make_router(cluster, policy, seed=seed, priors=priors, **(router_kwargs or {}))
    if load is None:
        try:
            cap = capacity_rps(cluster, workload)
            load = workload.rate_rps / cap if cap > 0 and math.isfinite(workload.rate_rps) else None
        except ValueError:
            load = None
    return _run(cluster, workload, router, policy, slo_ms=slo_ms, progress=progress,
                record_decisions=record_decisions, load=load)


def _run(cluster: SimCluster, workload: Workload, router, policy: str, *, slo_ms: float, progress: bool,
         record_decisions: bool, load: float | None) -> SimResult:
    wall0 = time.perf_counter()
    costs = cluster.costs
    n = len(workload)
    arrivals = workload.arrival_s.tolist()
    profiles_iter = iter(workload.profiles)

    # ---- static per-worker data
    enc_speed = [w.speed for w in cluster.encoders]
    pf_speed = [w.speed for w in cluster.prefill]
    dec_speed = [w.speed for w in cluster.decode]
    nodes = sorted({w.node for w in (*cluster.encoders, *cluster.prefill, *cluster.decode)})
    enc_node = [nodes.index(w.node) for w in cluster.encoders]
    pf_node = [nodes.index(w.node) for w in cluster.prefill]
    dec_node = [nodes.index(w.node) for w in cluster.decode]
    bw = costs.bandwidth_bytes_per_ms
    lat = costs.transfer_latency_ms
    same_bw, cross_bw = bw[Placement.SAME_NODE], bw[Placement.CROSS_NODE]
    same_lat, cross_lat = lat[Placement.SAME_NODE], lat[Placement.CROSS_NODE]
    SAME, CROSS = Placement.SAME_NODE, Placement.CROSS_NODE
    enc_cost = {m: (c.fixed_ms, c.per_unit_ms, c.batch_exponent - 1.0) for m, c in costs.encode.items()}
    max_batch = costs.encode_max_batch
    cache_cap = costs.encoder_cache_bytes
    pf_fixed, pf_tpm = costs.prefill_fixed_ms, costs.prefill_tokens_per_ms
    prefix_cap = costs.prefix_cache_blocks
    step0, step1 = costs.decode_step_ms, costs.decode_step_per_seq_ms
    dec_max = costs.decode_max_batch
    kv_bpt = costs.kv_bytes_per_token
    publish_dt = costs.publish_interval_s
    # Service-time variability (off by default: then `mult` is None and nothing below draws)
    mult = Multipliers(costs.variability) if costs.variability.enabled else None
    ingress0, ingress_media = costs.ingress_ms, costs.ingress_media_ms
    delayed = ingress0 > 0 or ingress_media > 0  # requests are routed once their ingress overhead is over
    inflight = 0  # requests arrived whose first token is not out yet (the host's contention)

    n_enc, n_pf, n_dec = len(enc_speed), len(pf_speed), len(dec_speed)

    # ---- dynamic per-worker state
    enc_q: list[dict[str, deque]] = [{} for _ in range(n_enc)]  # modality -> deque[(t_enq, req, size, ident, bytes)]
    enc_queued = [0] * n_enc
    enc_batch: list[tuple | None] = [None] * n_enc  # in service: (items, batch_ms, share_fixed, share_per_unit)
    enc_busy_ms = [0.0] * n_enc
    enc_cache: list[OrderedDict] = [OrderedDict() for _ in range(n_enc)]  # identifier -> bytes
    enc_cache_used = [0] * n_enc
    enc_cache_set: list[set] = [set() for _ in range(n_enc)]  # same keys, for cheap snapshots
    enc_cache_dirty = [True] * n_enc
    enc_cache_snap: list[frozenset] = [frozenset()] * n_enc

    pf_q: list[deque] = [deque() for _ in range(n_pf)]
    pf_cur: list[tuple | None] = [None] * n_pf  # (req, dur_ms, uncached)
    pf_busy_ms = [0.0] * n_pf
    pf_cache: list[OrderedDict] = [OrderedDict() for _ in range(n_pf)]
    pf_cache_set: list[set] = [set() for _ in range(n_pf)]
    pf_cache_dirty = [True] * n_pf
    pf_cache_snap: list[frozenset] = [frozenset()] * n_pf

    dec_active = [0] * n_dec
    dec_wait: list[deque] = [deque() for _ in range(n_dec)]
    dec_slot_ms = 0.0

    # ---- per-request state
    req_prof: list = [None] * n
    req_dec: list = [None] * n
    req_pending = [0] * n
    req_enc_ms = [0.0] * n  # compute time of its items (shares of batches)
    req_enc_wall = [0.0] * n  # full times of the batches its items rode in
    req_encoded: list = [None] * n  # the items actually encoded (cache misses)
    req_walls: list = [None] * n  # split requests: encoder -> full times of the batches its items rode in there
    ttft = [0.0] * n
    est = [0.0] * n
    svc = [0.0] * n
    decisions = [None] * n if record_decisions else None

    heap: list[tuple] = []
    inf = math.inf
    route = router.route
    encode_done = router.encode_done
    prefill_done = router.prefill_done
    decode_done = router.decode_done
    observe_transfer = router.observe_transfer
    publish = router.publish

    cache_hits = 0
    media_items = 0
    completed = 0
    last_done = arrivals[0] if n else 0.0

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=f"simulate {policy}", unit="req", mininterval=0.5, smoothing=0.05)
    tick = 0

    def do_publish(now: float) -> None:
        for e in range(n_enc):
            if enc_cache_dirty[e]:
                enc_cache_snap[e] = frozenset(enc_cache_set[e])
                enc_cache_dirty[e] = False
            publish(_E, e, now_s=now, queued=enc_queued[e], running=0 if enc_batch[e] is None else len(enc_batch[e][0]),
                    cached_identifiers=enc_cache_snap[e])
        for p in range(n_pf):
            if pf_cache_dirty[p]:
                pf_cache_snap[p] = frozenset(pf_cache_set[p])
                pf_cache_dirty[p] = False
            publish(_P, p, now_s=now, queued=len(pf_q[p]), running=0 if pf_cur[p] is None else 1,
                    prefix_hashes=pf_cache_snap[p])
        for d in range(n_dec):
            publish(_D, d, now_s=now, queued=len(dec_wait[d]), running=dec_active[d])

    def start_batch(e: int, now: float) -> None:
        queues = enc_q[e]  # only non-empty queues are kept
        if len(queues) == 1:
            for best, q in queues.items():
                pass
        else:
            best = None
            best_t = inf
            for m, mq in queues.items():
                if mq[0][0] < best_t:
                    best_t = mq[0][0]
                    best = m
            q = queues[best]
        k = len(q)
        if k == 1:
            items = [q.popleft()]
            total = items[0][2]
            scale = 1.0
        else:
            if k > max_batch:
                k = max_batch
            items = [q.popleft() for _ in range(k)]
            total = 0.0
            for it in items:
                total += it[2]
            scale = k ** enc_cost[best][2]
        if not q:
            del queues[best]
        enc_queued[e] -= k
        fixed, per, _ = enc_cost[best]
        solo = k * fixed + per * total
        ms = (fixed + per * total * scale) / enc_speed[e]
        if mult is not None:
            ms *= mult.service(busy_others(), now)
        # each item's share of the batch time, in proportion to its solo cost
        unit = ms / solo if solo > 0 else 0.0
        enc_batch[e] = (items, ms, unit * fixed, unit * per)
        enc_busy_ms[e] += ms
        heappush(heap, (now + ms * 1e-3, EV_ENC_DONE, e, 0))

    def to_prefill(r: int, dec, now: float, enc_ms: float, wall_ms: float, encoded) -> None:
        """Encoding of r finished (or was not needed): report, move embeddings to prefill.
        `enc_ms`: compute time of r's items (their shares of the batches they rode in),
        `wall_ms`: the batches' full times, `encoded`: the items actually encoded."""
        p = dec.prefill
        encode_done(dec, now, enc_ms, encoded)  # (duration_ms, items): positional, a little faster
        if dec.shares:  # each encoder sends its part, in parallel: the slowest arrives last
            xfer = 0.0
            for share in dec.shares:
                x = send_embeddings(share.encoder, p, [it for it in req_prof[r].items if it.modality in share.modalities])
                xfer = x if x > xfer else xfer
        else:  # send_embeddings(dec.encoder, p, items), inlined: once per media request
            items = req_prof[r].items
            nbytes = items[0].embedding_bytes if len(items) == 1 else sum([it.embedding_bytes for it in items])
            if enc_node[dec.encoder] == pf_node[p]:
                pl, xfer = SAME, same_lat + nbytes / same_bw
            else:
                pl, xfer = CROSS, cross_lat + nbytes / cross_bw
            observe_transfer(pl, nbytes, xfer)
        svc[r] = wall_ms + xfer
        heappush(heap, (now + xfer * 1e-3, EV_PF_ARRIVE, r, 0))

    def send_embeddings(e: int, p: int, items) -> float:
        """Transfer ms of `items`' embeddings from encoder e to prefill worker p (reported to the router)."""
        nbytes = 0
        for it in items:
            nbytes += it.embedding_bytes
        if enc_node[e] == pf_node[p]:
            pl, xfer = SAME, same_lat + nbytes / same_bw
        else:
            pl, xfer = CROSS, cross_lat + nbytes / cross_bw
        observe_transfer(pl, nbytes, xfer)
        return xfer

    def arrive_split(r: int, dec, items, now: float) -> None:
        """Queue each item of a request split by modality on its own encoder (cache hits skip it)."""
        nonlocal cache_hits
        by_encoder: dict[int, int] = {}
        encoded, seen = [], set()
        for it in items:
            e, ident = dec.encoder_for(it.modality), it.identifier
            if ident in enc_cache[e] or ident in seen:
                cache_hits += 1
                continue
            seen.add(ident)
            q = enc_q[e].get(it.modality)
            if q is None:
                q = enc_q[e][it.modality] = deque()
            q.append((now, r, it.size, ident, it.embedding_bytes))
            encoded.append(it)
            by_encoder[e] = by_encoder.get(e, 0) + 1
        if not encoded:
            to_prefill(r, dec, now, 0.0, 0.0, ())
            return
        req_pending[r], req_enc_ms[r], req_enc_wall[r] = len(encoded), 0.0, 0.0
        req_encoded[r], req_walls[r] = tuple(encoded), {}
        for e, k in by_encoder.items():
            enc_queued[e] += k
            if enc_batch[e] is None:
                start_batch(e, now)

    def start_prefill(p: int, r: int, now: float) -> None:
        prof = req_prof[r]
        tokens = prof.num_prompt_tokens
        hashes = prof.prefix_hashes
        if hashes:
            cache = pf_cache[p]
            hit = 0
            for h in hashes:
                if h in cache:
                    hit += 1
                else:
                    break
            uncached = tokens - hit * prof.block_size
            if uncached < 1:
                uncached = 1
        else:
            uncached = tokens
        ms = (pf_fixed + uncached / pf_tpm) / pf_speed[p]
        if mult is not None:
            ms *= mult.service(busy_others(), now)
        pf_cur[p] = (r, ms, uncached)
        pf_busy_ms[p] += ms
        heappush(heap, (now + ms * 1e-3, EV_PF_DONE, p, r))

    def busy_others() -> int:
        """Other requests in flight that are doing work, not waiting in a prefill worker's queue:
        what contends for the host (a loop over the prefill workers: only with variability on)."""
        waiting = 0
        for q in pf_q:
            waiting += len(q)
        return inflight - waiting - 1

    def ingress_ms(prof, now: float) -> float:
        """The request's ingress overhead (admission, RPCs, hand-overs: no modelled worker)."""
        ms = ingress0 + ingress_media if prof.items else ingress0
        return ms * mult.ingress(busy_others(), now) if mult is not None else ms  # it counts as in flight already

    def admit_decode(d: int, r: int, now: float) -> None:
        nonlocal dec_slot_ms
        b = dec_active[d] + 1
        dec_active[d] = b
        ms = req_prof[r].max_tokens * (step0 + step1 * b) / dec_speed[d]
        dec_slot_ms += ms
        heappush(heap, (now + ms * 1e-3, EV_DEC_DONE, d, r))

    if n:
        do_publish(arrivals[0])
        heappush(heap, (arrivals[0] + publish_dt, EV_PUBLISH, 0, 0))

    i = 0
    next_arrival = arrivals[0] if n else inf
    while True:
        if heap and heap[0][0] <= next_arrival:
            now, ev, a, b = heappop(heap)
            if ev == EV_ENC_DONE:
                e = a
                items, ms, share0, share1 = enc_batch[e]
                enc_batch[e] = None
                cache = enc_cache[e]
                keys = enc_cache_set[e]
                prev = -1
                used = enc_cache_used[e]
                for _, r, size, ident, nb in items:
                    if ident in cache:
                        cache.move_to_end(ident)
                    elif nb <= cache_cap:
                        cache[ident] = nb
                        keys.add(ident)
                        enc_cache_dirty[e] = True
                        used += nb
                        while used > cache_cap:
                            old, ob = cache.popitem(last=False)
                            keys.discard(old)
                            used -= ob
                    req_enc_ms[r] += share0 + share1 * size
                    if r != prev:  # a request's items in one batch are consecutive
                        walls = req_walls[r]
                        if walls is None:
                            req_enc_wall[r] += ms
                        else:  # split: its encoders work in parallel
                            walls[e] = walls.get(e, 0.0) + ms
                        prev = r
                    left = req_pending[r] - 1
                    req_pending[r] = left
                    if left == 0:
                        if req_walls[r] is not None:
                            req_enc_wall[r], req_walls[r] = max(req_walls[r].values()), None
                        to_prefill(r, req_dec[r], now, req_enc_ms[r], req_enc_wall[r], req_encoded[r])
                        req_encoded[r] = None
                enc_cache_used[e] = used
                if enc_queued[e]:
                    start_batch(e, now)
                continue
            elif ev == EV_PF_ARRIVE:
                r = a
                p = req_dec[r].prefill
                if pf_cur[p] is None:
                    start_prefill(p, r, now)
                else:
                    pf_q[p].append(r)
                continue
            elif ev == EV_PF_DONE:
                p, r = a, b
                inflight -= 1
                _, ms, uncached = pf_cur[p]
                pf_cur[p] = None
                dec = req_dec[r]
                ttft[r] = (now - arrivals[r]) * 1e3
                svc[r] += ms
                prefill_done(dec, now, ms, uncached)  # (duration_ms, uncached_tokens)
                prof = req_prof[r]
                hashes = prof.prefix_hashes
                if hashes:
                    cache = pf_cache[p]
                    keys = pf_cache_set[p]
                    for h in hashes:
                        if h in cache:
                            cache.move_to_end(h)
                        else:
                            cache[h] = None
                            keys.add(h)
                            pf_cache_dirty[p] = True
                    while len(cache) > prefix_cap:
                        keys.discard(cache.popitem(last=False)[0])
                d = dec.decode
                nbytes = prof.num_prompt_tokens * kv_bpt
                if pf_node[p] == dec_node[d]:
                    t_kv = now + (same_lat + nbytes / same_bw) * 1e-3
                else:
                    t_kv = now + (cross_lat + nbytes / cross_bw) * 1e-3
                # decode admission is decided now, effective when the KV cache lands (t_kv)
                active = dec_active[d]
                if active < dec_max:
                    active += 1
                    dec_active[d] = active
                    ms = prof.max_tokens * (step0 + step1 * active) / dec_speed[d]
                    dec_slot_ms += ms
                    heappush(heap, (t_kv + ms * 1e-3, EV_DEC_DONE, d, r))
                else:
                    dec_wait[d].append((r, t_kv))
                if pf_q[p]:
                    start_prefill(p, pf_q[p].popleft(), now)
                continue
            elif ev == EV_DEC_DONE:
                d, r = a, b
                dec_active[d] -= 1
                decode_done(req_dec[r], now)
                req_dec[r] = None
                req_prof[r] = None
                completed += 1
                last_done = now
                if dec_wait[d]:
                    r, t_kv = dec_wait[d].popleft()
                    admit_decode(d, r, t_kv if t_kv > now else now)
                continue
            elif ev == EV_ADMIT:  # its ingress overhead is over: route it (below)
                r = a
                prof = req_prof[r]
            else:  # EV_PUBLISH
                do_publish(now)
                if completed < n:
                    heappush(heap, (now + publish_dt, EV_PUBLISH, 0, 0))
                continue
        else:
            if i >= n:
                break
            # ---- arrival of request i
            now = next_arrival
            r = i
            i += 1
            next_arrival = arrivals[i] if i < n else inf
            prof = next(profiles_iter)
            inflight += 1
            if delayed:
                req_prof[r] = prof
                heappush(heap, (now + ingress_ms(prof, now) * 1e-3, EV_ADMIT, r, 0))
                continue
        # ---- route request r and send it on
        dec = route(prof, now)
        req_prof[r] = prof
        req_dec[r] = dec
        est[r] = dec.estimate.total_ms
        if decisions is not None:
            decisions[r] = (dec.encoder, dec.prefill, dec.decode)
        items = prof.items
        if items and dec.shares:  # no encoder hosts all its modalities
            media_items += len(items)
            arrive_split(r, dec, items, now)
        elif items:
            e = dec.encoder
            media_items += len(items)
            cache = enc_cache[e]
            queues = enc_q[e]
            encoded = []
            seen = None
            for it in items:
                ident = it.identifier
                if ident in cache or (seen is not None and ident in seen):
                    cache_hits += 1
                    continue
                if len(items) > 1:
                    if seen is None:
                        seen = set()
                    seen.add(ident)
                q = queues.get(it.modality)
                if q is None:
                    q = queues[it.modality] = deque()
                q.append((now, r, it.size, ident, it.embedding_bytes))
                encoded.append(it)
            pending = len(encoded)
            if pending:
                req_pending[r] = pending
                req_enc_ms[r] = 0.0
                req_enc_wall[r] = 0.0
                req_encoded[r] = tuple(encoded)
                enc_queued[e] += pending
                if enc_batch[e] is None:
                    start_batch(e, now)
            else:
                to_prefill(r, dec, now, 0.0, 0.0, ())
        else:  # text only: straight to the prefill worker
            svc[r] = 0.0
            p = dec.prefill
            if pf_cur[p] is None:
                start_prefill(p, r, now)
            else:
                pf_q[p].append(r)
        if bar is not None:
            tick += 1
            if tick >= 4096:
                bar.update(tick)
                tick = 0
    if bar is not None:
        bar.update(tick)
        bar.close()

    first = arrivals[0] if n else 0.0
    span_s = max(last_done - first, 1e-9)
    span_ms = span_s * 1e3
    util = {
        "encoder": sum(enc_busy_ms) / (span_ms * n_enc) if n_enc else 0.0,
        "prefill": sum(pf_busy_ms) / (span_ms * n_pf),
        "decode": dec_slot_ms / (span_ms * n_dec * dec_max),
    }
    return SimResult(
        policy=policy, cluster=cluster.name, workload=workload.name, slo_ms=slo_ms,
        offered_rps=workload.rate_rps, load=load, arrival_s=np.asarray(arrivals),
        ttft_ms=np.asarray(ttft), estimate_ms=np.asarray(est), service_ms=np.asarray(svc), span_s=span_s,
        utilisation=util, wall_s=time.perf_counter() - wall0, cache_hits=cache_hits, media_items=media_items,
        completed=completed,
        measured_ttft_ms=workload.measured_ttft_ms, decisions=decisions,
    )
