"""The simulated workers, one class per pool: its queues, its caches and its service model.

The pools schedule their own completions on the engine's event heap and report what a live
worker would through the engine's router; the engine (router/sim/loop.py) routes requests,
moves them between pools and dispatches events. Per-worker state lives in small slotted
objects, so a pool's code reads `worker.queue` rather than `queue[index]`.

Ground truth is `cluster_model.SimCosts`; with variability on, each encode batch and prefill
draws a multiplier (`Multipliers.service`) at its start, in the order the engine starts them.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from heapq import heappop, heappush
from typing import TYPE_CHECKING

from router.prefill_schedule import Chunk, num_packed, order_key
from router.sim.cluster_model import PREFILL_ORDERS, SimCosts, SimWorker
from router.types import Placement, WorkerKind

if TYPE_CHECKING:
    from router.sim.loop import Engine

# event types; the order is the tie-break at equal times: completions before new work
EV_ENC_DONE = 0
EV_PF_DONE = 1
EV_DEC_DONE = 2
EV_PF_ARRIVE = 3
EV_PUBLISH = 4
EV_ADMIT = (
    5  # a request's ingress overhead is over (only with SimCosts.ingress_ms / ingress_media_ms)
)

_SAME, _CROSS = Placement.SAME_NODE, Placement.CROSS_NODE


class Network:
    """Transfer times: latency + bytes / bandwidth of the placement (same node or across)."""

    def __init__(self, costs: SimCosts):
        self.same_bw, self.cross_bw = (
            costs.bandwidth_bytes_per_ms[_SAME],
            costs.bandwidth_bytes_per_ms[_CROSS],
        )
        self.same_lat, self.cross_lat = (
            costs.transfer_latency_ms[_SAME],
            costs.transfer_latency_ms[_CROSS],
        )

    def send_ms(self, node_a: int, node_b: int, num_bytes: int) -> tuple[Placement, float]:
        if node_a == node_b:
            return _SAME, self.same_lat + num_bytes / self.same_bw
        return _CROSS, self.cross_lat + num_bytes / self.cross_bw


class KeySnapshots:
    """An LRU's keys as a set, and a frozen copy of it re-taken only after a change (to publish)."""

    __slots__ = ("keys", "dirty", "_frozen")

    def __init__(self) -> None:
        self.keys: set = set()
        self.dirty, self._frozen = True, frozenset()

    def frozen(self) -> frozenset:
        if self.dirty:
            self._frozen, self.dirty = frozenset(self.keys), False
        return self._frozen


class Request:
    """A request in flight: what routing decided, and its encode progress."""

    __slots__ = ("profile", "decision", "pending", "encode_ms", "wall_ms", "encoded", "walls")

    def __init__(self, profile) -> None:
        self.profile, self.decision = profile, None
        self.pending = 0  # items still being encoded
        self.encode_ms = 0.0  # compute time of its items (their shares of the batches)
        self.wall_ms = 0.0  # full times of the batches its items rode in
        self.encoded: tuple = ()  # the items actually encoded (cache misses)
        self.walls: dict[int, float] | None = (
            None  # split requests: encoder -> its batches' full times
        )


class Encoder:
    __slots__ = (
        "speed",
        "node",
        "queues",
        "queued",
        "batch",
        "busy_ms",
        "cache",
        "cache_bytes",
        "snap",
    )

    def __init__(self, worker: SimWorker, node: int):
        self.speed, self.node = worker.speed, node
        self.queues: dict[
            str, deque
        ] = {}  # modality -> deque[(t_enq, r, size, identifier, bytes)]; non-empty only
        self.queued = 0
        self.batch: tuple | None = (
            None  # in service: (items, batch_ms, ms per item, ms per unit of size)
        )
        self.busy_ms = 0.0
        self.cache: OrderedDict[str, int] = OrderedDict()  # identifier -> embedding bytes, LRU
        self.cache_bytes = 0
        self.snap = KeySnapshots()


class EncoderPool:
    """One batch at a time per encoder: up to `encode_max_batch` items of the modality whose oldest
    queued item is oldest, timed by `EncodeCost.batch_ms`; each item's share of the batch time is
    in proportion to its solo cost. Items are cached (LRU of `encoder_cache_bytes`) when their batch
    finishes; an item the chosen encoder holds at routing (or twice in one request) skips the
    queue."""

    def __init__(
        self, workers: tuple[SimWorker, ...], nodes: list[str], costs: SimCosts, engine: Engine
    ):
        self.workers = [Encoder(w, nodes.index(w.node)) for w in workers]
        self.cost = {
            m: (c.fixed_ms, c.per_unit_ms, c.batch_exponent - 1.0) for m, c in costs.encode.items()
        }
        self.max_batch, self.cache_cap = costs.encode_max_batch, costs.encoder_cache_bytes
        self.engine = engine
        self.cache_hits = 0

    def queue_request(self, r: int, req: Request, now: float) -> bool:
        """Queue the request's items on their encoders (cache hits skip); False if none needs
        encoding."""
        decision, items, workers = req.decision, req.profile.items, self.workers
        split = decision.shares
        counts: dict[int, int] = {}
        encoded, seen = [], set()
        for it in items:
            e = decision.encoder_for(it.modality) if split else decision.encoder
            ident, worker = it.identifier, workers[e]
            if ident in worker.cache or ident in seen:
                self.cache_hits += 1
                continue
            seen.add(ident)
            q = worker.queues.get(it.modality)
            if q is None:
                q = worker.queues[it.modality] = deque()
            q.append((now, r, it.size, ident, it.embedding_bytes))
            encoded.append(it)
            counts[e] = counts.get(e, 0) + 1
        if not encoded:
            return False
        req.pending, req.encoded = len(encoded), tuple(encoded)
        if split:
            req.walls = {}
        for e, k in counts.items():
            worker = workers[e]
            worker.queued += k
            if worker.batch is None:
                self.start_batch(e, now)
        return True

    def start_batch(self, e: int, now: float) -> None:
        worker = self.workers[e]
        queues = worker.queues
        best = min(queues, key=lambda m: queues[m][0][0]) if len(queues) > 1 else next(iter(queues))
        q = queues[best]
        fixed, per, exponent = self.cost[best]
        k = len(q)
        if k == 1:
            items = [q.popleft()]
            total, scale = items[0][2], 1.0
        else:
            k = min(k, self.max_batch)
            items = [q.popleft() for _ in range(k)]
            total = 0.0
            for it in items:
                total += it[2]
            scale = k**exponent
        if not q:
            del queues[best]
        worker.queued -= k
        solo = k * fixed + per * total
        ms = (fixed + per * total * scale) / worker.speed
        ms = self.engine.scaled(ms, now)
        unit = ms / solo if solo > 0 else 0.0
        worker.batch = (items, ms, unit * fixed, unit * per)
        worker.busy_ms += ms
        heappush(self.engine.heap, (now + ms * 1e-3, EV_ENC_DONE, e, 0))

    def finish_batch(self, e: int, now: float) -> None:
        """Batch done: cache its items, credit each request, hand on the fully encoded ones."""
        worker = self.workers[e]
        items, ms, share0, share1 = worker.batch
        worker.batch = None
        cache, snap, cap, used = worker.cache, worker.snap, self.cache_cap, worker.cache_bytes
        requests, prev = self.engine.requests, -1
        for _, r, size, ident, nb in items:
            if ident in cache:
                cache.move_to_end(ident)
            elif nb <= cap:
                cache[ident] = nb
                snap.keys.add(ident)
                snap.dirty = True
                used += nb
                while used > cap:
                    old, old_bytes = cache.popitem(last=False)
                    snap.keys.discard(old)
                    used -= old_bytes
            req = requests[r]
            req.encode_ms += share0 + share1 * size
            if r != prev:  # a request's items in one batch are consecutive
                if req.walls is None:
                    req.wall_ms += ms
                else:  # split: its encoders work in parallel
                    req.walls[e] = req.walls.get(e, 0.0) + ms
                prev = r
            req.pending -= 1
            if req.pending == 0:
                if req.walls is not None:
                    req.wall_ms, req.walls = max(req.walls.values()), None
                self.engine.to_prefill(r, req, now, req.encode_ms, req.wall_ms, req.encoded)
                req.encoded = ()
        worker.cache_bytes = used
        if worker.queued:
            self.start_batch(e, now)

    def publish(self, publish, now: float) -> None:
        for e, w in enumerate(self.workers):
            publish(
                WorkerKind.ENCODER,
                e,
                now_s=now,
                queued=w.queued,
                running=0 if w.batch is None else len(w.batch[0]),
                cached_identifiers=w.snap.frozen(),
            )

    def busy_ms(self) -> float:
        return sum(w.busy_ms for w in self.workers)


class Prefill:
    __slots__ = (
        "speed",
        "node",
        "queue",
        "current",
        "busy_ms",
        "prefix",
        "snap",
        "left",
        "nested",
        "nested_until",
        "delay_ms",
        "packed",
    )

    def __init__(self, worker: SimWorker, node: int):
        self.speed, self.node = worker.speed, node
        self.queue: list[tuple[tuple[float, int], int]] = []  # heap of (order_key, r)
        self.current: tuple | None = (
            None  # in service: (r, ms, uncached tokens), ms of the whole prefill
        )
        self.left = 0  # the job in service's tokens left, the part in service included
        # Layer-boundary preemption: prompts run inside the job in service (r -> (ms, uncached)),
        # when the last of them ends, and what they add to the part in service
        self.nested: dict[int, tuple[float, int]] = {}
        self.nested_until = 0.0
        self.delay_ms = 0.0
        self.packed = False  # the job in service leads a pack (`pack_prompts`)
        self.busy_ms = 0.0
        self.prefix: OrderedDict[str, None] = OrderedDict()  # block hashes, LRU
        self.snap = KeySnapshots()


class PrefillPool:
    """One request at a time per worker: prefill_fixed_ms + uncached / prefill_tokens_per_ms, the
    uncached part being what the worker's prefix LRU (`prefix_cache_blocks`) misses at the start.
    The queue is in the live engine's own order (`order_key` of router/prefill_schedule.py, under
    the engine's settings `SimCosts.prefill`): shortest prompt first, less `aging_tokens_per_s`
    for each second at the worker, or arrival order (`SimCosts.prefill_order`).
    With `max_chunk_tokens` a prompt runs in chunks and goes back to the queue, keyed by the tokens
    it has left, after each one, so a shorter prompt that arrived meanwhile goes next (the engine's
    chunk-wise preemption); the service drawn at its start is spread over its chunks by tokens.
    With `preempt_at_layers` a prompt that fits one chunk and goes before the job in service runs
    at once, and the part in service ends that much later (the engine runs it between the
    part's layers). With `pack_prompts` a worker that takes a whole prompt from its queue takes
    the whole prompts behind it that the engine would pack with it (`num_packed`), all in one
    service of prefill_fixed_ms + their uncached tokens / prefill_tokens_per_ms, ending together,
    each one's service its share by tokens (no prompt jumps into a pack here)."""

    def __init__(
        self, workers: tuple[SimWorker, ...], nodes: list[str], costs: SimCosts, engine: Engine
    ):
        self.workers = [Prefill(w, nodes.index(w.node)) for w in workers]
        self.fixed_ms, self.tokens_per_ms = costs.prefill_fixed_ms, costs.prefill_tokens_per_ms
        self.prefix_cap = costs.prefix_cache_blocks
        self.order = PREFILL_ORDERS[costs.prefill_order]
        self.chunk_tokens = costs.prefill.max_chunk_tokens
        self.aging = costs.prefill.aging_tokens_per_s
        self.preempts = costs.prefill.preempt_at_layers
        self.packs = costs.prefill.pack_prompts
        self.arrived: dict[int, tuple[float, int]] = {}  # r -> (when, order) it reached its worker
        self.parts: dict[
            int, list
        ] = {}  # r -> [tokens left, (r, ms, uncached)]: prompts begun in chunks
        self.arrivals = (
            itertools.count()
        )  # at a worker (after encode and transfer): the order of arrival, as the engine counts it
        self.engine = engine

    def arrive(self, p: int, r: int, now: float) -> None:
        self.arrived[r] = (now, next(self.arrivals))
        if self.workers[p].current is None:
            self.start(p, r, now)
        elif not (self.preempts and self._jump(p, r, now)):
            self._queue(p, r, self.engine.requests[r].profile.num_prompt_tokens)

    def _key(self, r: int, num_tokens_left: int) -> tuple[float, int]:
        added_s, arrival = self.arrived[r]
        return order_key(num_tokens_left, added_s, arrival, self.order, self.aging)

    def _jump(self, p: int, r: int, now: float) -> bool:
        """Run r inside the job in service if it fits one chunk and goes before that job."""
        worker = self.workers[p]
        if worker.packed:
            return False
        uncached = self._uncached(worker, self.engine.requests[r].profile)
        fits = uncached <= self.chunk_tokens if self.chunk_tokens else True
        if not fits or self._key(r, uncached) >= self._key(worker.current[0], worker.left):
            return False
        ms = self._service_ms(worker, uncached, now)
        worker.nested[r] = (ms, uncached)
        worker.nested_until = max(worker.nested_until, now) + ms * 1e-3
        worker.delay_ms += ms
        heappush(self.engine.heap, (worker.nested_until, EV_PF_DONE, p, r))
        return True

    def _queue(self, p: int, r: int, num_tokens_left: int) -> None:
        """r waits at p, at its place in the engine's order."""
        heappush(self.workers[p].queue, (self._key(r, num_tokens_left), r))

    @staticmethod
    def _uncached(worker: Prefill, prof) -> int:
        uncached = prof.num_prompt_tokens
        if prof.prefix_hashes:
            hit = 0
            for h in prof.prefix_hashes:
                if h not in worker.prefix:
                    break
                hit += 1
            uncached = max(1, uncached - hit * prof.block_size)
        return uncached

    def _service_ms(self, worker: Prefill, uncached: int, now: float) -> float:
        ms = self.engine.scaled((self.fixed_ms + uncached / self.tokens_per_ms) / worker.speed, now)
        worker.busy_ms += ms
        return ms

    def start(self, p: int, r: int, now: float) -> None:
        worker = self.workers[p]
        uncached = self._uncached(worker, self.engine.requests[r].profile)
        ms = self._service_ms(worker, uncached, now)
        worker.current, worker.left = (r, ms, uncached), uncached
        if 0 < self.chunk_tokens < uncached:
            self.parts[r] = [uncached, worker.current]
            self._run_chunk(p, r, now)
        else:
            heappush(self.engine.heap, (now + ms * 1e-3, EV_PF_DONE, p, r))

    def _run_chunk(self, p: int, r: int, now: float) -> None:
        """The next chunk of r's prompt, r in service on p: its share of the service, by tokens."""
        part = self.parts[r]
        tokens = part[0] if part[0] < self.chunk_tokens else self.chunk_tokens
        self.workers[p].left = part[0]
        part[0] -= tokens
        _, ms, uncached = part[1]
        heappush(self.engine.heap, (now + ms * tokens / uncached * 1e-3, EV_PF_DONE, p, r))

    def finish(self, p: int, r: int, now: float) -> tuple[float, int] | None:
        """r is done at p: (its ms, its uncached tokens); call start_next() after. None when
        only a chunk of it is (it went back to the queue and the worker went on), or when
        prompts ran inside its part in service (which then ends that much later)."""
        worker = self.workers[p]
        if r in worker.nested:
            del self.arrived[r]
            return worker.nested.pop(r)
        if worker.delay_ms > 0.0:
            heappush(self.engine.heap, (now + worker.delay_ms * 1e-3, EV_PF_DONE, p, r))
            worker.delay_ms = 0.0
            return None
        _, ms, uncached = worker.current
        worker.current, worker.packed = None, False
        part = self.parts.get(r) if self.parts else None
        if part is not None:
            if part[0] > 0:
                self._queue(p, r, part[0])
                self.start_next(p, now)
                return None
            del self.parts[r]
        del self.arrived[r]
        return ms, uncached

    def remember(self, p: int, prefix_hashes: tuple[str, ...]) -> None:
        """The worker now holds the prompt's blocks (LRU, evicted after the whole prompt is in)."""
        worker = self.workers[p]
        cache, snap = worker.prefix, worker.snap
        for h in prefix_hashes:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                snap.keys.add(h)
                snap.dirty = True
        while len(cache) > self.prefix_cap:
            snap.keys.discard(cache.popitem(last=False)[0])

    def start_next(self, p: int, now: float) -> None:
        worker = self.workers[p]
        if worker.queue and worker.current is None:  # (a prompt run inside one leaves it busy)
            r = heappop(worker.queue)[1]
            part = self.parts.get(r) if self.parts else None
            if part is None and self.packs and len(pack := self._pack(p, r)) > 1:
                self._start_pack(p, pack, now)
            elif part is None:
                self.start(p, r, now)
            else:  # a prompt begun in chunks goes on where it stopped
                worker.current = part[1]
                self._run_chunk(p, r, now)

    def _pack(self, p: int, r: int) -> list[tuple[int, int]]:
        """r, just taken from p's queue, and the whole prompts next in it that the engine would
        pack with r (`num_packed`), taken too: (request, uncached tokens) each."""
        worker, max_slots = self.workers[p], self.chunk_tokens or math.inf
        pack, chunks, lengths = [], [], []
        while True:
            prof = self.engine.requests[r].profile
            uncached = self._uncached(worker, prof)
            chunks.append(Chunk(str(r), prof.num_prompt_tokens - uncached, prof.num_prompt_tokens))
            lengths.append(prof.num_prompt_tokens)
            # (a prompt of more than a chunk is longer than max_slots: it packs with none)
            if pack and num_packed(chunks, lengths, max_slots) < len(chunks):
                self._queue(p, r, prof.num_prompt_tokens)  # back, keyed as it came
                return pack
            pack.append((r, uncached))
            if not worker.queue or (self.parts and worker.queue[0][1] in self.parts):
                return pack
            r = heappop(worker.queue)[1]

    def _start_pack(self, p: int, pack: list[tuple[int, int]], now: float) -> None:
        """One service for the pack, all ending together: the first in service, the others
        finishing as prompts run inside it do, each with its share by tokens."""
        worker, num_tokens = self.workers[p], sum(uncached for _, uncached in pack)
        ms = self._service_ms(worker, num_tokens, now)
        (r, uncached), others = pack[0], pack[1:]
        worker.current, worker.left = (r, ms * uncached / num_tokens, uncached), uncached
        worker.packed = True
        heappush(self.engine.heap, (now + ms * 1e-3, EV_PF_DONE, p, r))
        for other, tokens in others:
            worker.nested[other] = (ms * tokens / num_tokens, tokens)
            heappush(self.engine.heap, (now + ms * 1e-3, EV_PF_DONE, p, other))

    def waiting(self) -> int:
        """Requests queued (not in service) on any prefill worker: they use no CPU."""
        return sum(len(w.queue) for w in self.workers)

    def publish(self, publish, now: float) -> None:
        for p, w in enumerate(self.workers):
            publish(
                WorkerKind.PREFILL,
                p,
                now_s=now,
                queued=len(w.queue),
                running=0 if w.current is None else 1,
                prefix_hashes=w.snap.frozen(),
            )

    def busy_ms(self) -> float:
        return sum(w.busy_ms for w in self.workers)


class DecodePool:
    """Continuous batching, approximated: admitted while fewer than `decode_max_batch` run, else
    FIFO; a request admitted as the b-th active takes max_tokens x (step + per_seq x b) / speed, b
    frozen then. To save an event, admission is decided when the prefill finishes and takes effect
    when the KV lands."""

    def __init__(
        self, workers: tuple[SimWorker, ...], nodes: list[str], costs: SimCosts, engine: Engine
    ):
        self.speed = [w.speed for w in workers]
        self.node = [nodes.index(w.node) for w in workers]
        self.active = [0] * len(workers)
        self.num_active = 0  # sum of active: requests decoding (admitted) on any worker
        self.wait: list[deque[tuple[int, float]]] = [
            deque() for _ in workers
        ]  # (r, KV landing time)
        self.step_ms, self.per_seq_ms, self.max_batch = (
            costs.decode_step_ms,
            costs.decode_step_per_seq_ms,
            costs.decode_max_batch,
        )
        self.slot_ms = 0.0  # sum of admitted requests' decode ms (utilisation)
        self.engine = engine

    def submit(self, d: int, r: int, max_tokens: int, kv_at: float) -> None:
        """Request r's KV lands on d at `kv_at`: admit it then if a slot is free, else queue it."""
        if self.active[d] < self.max_batch:
            self._admit(d, r, max_tokens, kv_at)
        else:
            self.wait[d].append((r, kv_at))

    def _admit(self, d: int, r: int, max_tokens: int, at: float) -> None:
        b = self.active[d] = self.active[d] + 1
        self.num_active += 1
        ms = max_tokens * (self.step_ms + self.per_seq_ms * b) / self.speed[d]
        self.slot_ms += ms
        heappush(self.engine.heap, (at + ms * 1e-3, EV_DEC_DONE, d, r))

    def finish(self, d: int, now: float) -> None:
        self.active[d] -= 1
        self.num_active -= 1
        if self.wait[d]:
            r, kv_at = self.wait[d].popleft()
            if now > kv_at:  # its KV waited for a slot: the stream stalls after the first token
                self.engine.decode_wait[r] = (now - kv_at) * 1e3
            self._admit(
                d, r, self.engine.requests[r].profile.max_tokens, kv_at if kv_at > now else now
            )

    def publish(self, publish, now: float) -> None:
        for d, active in enumerate(self.active):
            publish(WorkerKind.DECODE, d, now_s=now, queued=len(self.wait[d]), running=active)
