"""The router's view of the fleet: who is up, how much work each worker has, who caches what.

Two sources, on purpose:
- the router's own dispatch counts (jobs and estimated ms, added on route, released when
  the stage finishes), so the view is never staler than its own decisions;
- reports the workers publish (queue sizes, cached media identifiers, prefix blocks),
  which are trusted for `staleness_s` only; a worker silent for `dead_after_s` after
  having reported leaves the candidate set until it reports again.

Several ingress replicas route to one fleet, each with its own view. A worker's reported
queue counts every replica's requests, so what it holds beyond this view's own bookings is
other replicas' work (`foreign`: jobs, encoder: items), which the cost model prices like
the request at hand; decode takes the larger of its own and the reported running count.

Time is always passed in (`now_s`), so the simulator and the live ingress drive the same
code. Cache contents are kept by router/holder_index.py.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Iterable, Mapping

from router.holder_index import HolderIndex
from router.types import (
    ALL_MODALITIES,
    MediaJob,
    Placement,
    RequestProfile,
    RouteDecision,
    WorkerInfo,
    WorkerKind,
    WorkerReport,
    WorkerState,
)

# Leading prefix blocks the router assumes a prefill worker holds right after dispatch, until its
# next report (32 x 16 = 512 tokens: the head of a shared system prompt). Recording every block
# would cost O(prompt) dict inserts per route, the largest cost of a decision.
OPTIMISTIC_PREFIX_BLOCKS = 32
_E, _P, _D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


class NoWorkerError(RuntimeError):
    pass


def _as_infos(
    workers: Iterable[WorkerInfo] | Mapping[WorkerKind, int],
) -> dict[WorkerKind, list[WorkerInfo]]:
    if isinstance(
        workers, Mapping
    ):  # the stand-in's {kind: count}: one node, encoders host everything
        workers = [
            WorkerInfo(kind, i, modalities=ALL_MODALITIES if kind is _E else frozenset())
            for kind, n in workers.items()
            for i in range(n)
        ]
    by_kind: dict[WorkerKind, list[WorkerInfo]] = {kind: [] for kind in WorkerKind}
    for info in sorted(workers, key=lambda w: w.index):
        by_kind[info.kind].append(info)
    for kind, infos in by_kind.items():
        if [w.index for w in infos] != list(range(len(infos))):
            raise ValueError(
                f"{kind.value} worker indices must be 0..n-1, got {[w.index for w in infos]}"
            )
    return by_kind


class ClusterView:
    def __init__(
        self,
        workers: Iterable[WorkerInfo] | Mapping[WorkerKind, int],
        *,
        staleness_s: float = 5.0,
        dead_after_s: float = 10.0,
    ):
        self.workers = _as_infos(workers)
        self.staleness_s, self.dead_after_s = staleness_s, dead_after_s
        sizes = {kind: len(infos) for kind, infos in self.workers.items()}
        # Per kind, lists indexed by worker. The hot paths bind the list of one kind to a local
        # once; the lists are only ever updated in place, so such a binding never goes stale.
        self.outstanding = {
            kind: [0] * n for kind, n in sizes.items()
        }  # jobs (encoder: items) dispatched, not done
        self.outstanding_ms = {kind: [0.0] * n for kind, n in sizes.items()}  # their estimated work
        self.healthy = {kind: [True] * n for kind, n in sizes.items()}  # explicit set_healthy
        self.reports: dict[WorkerKind, list[WorkerReport | None]] = {
            kind: [None] * n for kind, n in sizes.items()
        }
        self.foreign = {
            kind: [0] * n for kind, n in sizes.items()
        }  # reported jobs beyond our own (module doc)
        self.num_foreign = {
            kind: 0 for kind in sizes
        }  # sum of each: 0 lets the cost model skip them
        # Other replicas' booked ms per encoder and prefill worker, as they last shared them
        # (share_foreign); None until then. Shared bookings replace the counts above.
        self.foreign_ms: dict[WorkerKind, list[float] | None] = {_E: None, _P: None}
        self._num_others = 0  # the other replicas sharing (foreign_queue_ms)
        self._booked_at_share: dict[WorkerKind, list[float]] = {}
        # Estimated ms of work ever booked on each encoder and prefill worker: what autoscaling
        # reads as offered load (cluster/pool_scaling.py).
        self.booked_ms_total = {kind: [0.0] * n for kind, n in sizes.items()}
        self.encoder_cache = HolderIndex(sizes[_E], staleness_s)
        self.prefix_cache = HolderIndex(sizes[_P], staleness_s)
        self._place(self.workers)
        self._prefix_memo: tuple[tuple[str, ...] | None, int, int, dict[int, int]] = (
            None,
            0,
            -1,
            {},
        )
        # The prefill job presumably in service on each worker: when it started, in ms on the view's
        # clock (inf: none), and its booked ms; the cost model credits the part of it already done
        # (CostModel.prefill_queue_ms). The router sees no start events, so it infers them: a job
        # booked on an idle worker starts once its embeddings are in (its estimated encoder queue +
        # encode + transfer after dispatch: begin_route); the next one as soon as a job finishes,
        # its booked ms taken as the mean of those left (end). Both may be early (the next job may
        # still be encoding). Either way service_ms <= outstanding_ms.
        self.service_started_ms = [math.inf] * sizes[_P]
        self.service_ms = [0.0] * sizes[_P]
        # The booked ms of each job on each prefill worker, ascending, for a wait by shortest
        # first (router/prefill_wait.py); outstanding_ms[_P] is their sum.
        self.prefill_jobs_ms: list[list[float]] = [[] for _ in range(sizes[_P])]
        # decode_loads(), kept up to date on every change instead of rebuilt per decision:
        self._loads = [0] * sizes[_D]  # max(own running, reported running) per decode worker
        self._reported_running = [0] * sizes[
            _D
        ]  # `running` of each fresh report (0: none or stale)
        self._oldest_running_at = (
            math.inf
        )  # at_s of the oldest report counted there: recount once it is stale
        self.now_s = -math.inf
        self._dirty = (
            True  # candidate lists are recomputed when dirty or once now_s passes _valid_until
        )
        self._valid_until = math.inf
        self._candidates: dict[WorkerKind, list[int]] = {}
        self._masks: dict[WorkerKind, int] = {}
        # modalities (or one modality's name) -> (candidate encoders hosting them, the same per
        # node id)
        self._by_modalities: dict[frozenset[str] | str, tuple[list[int], dict[int, list[int]]]] = {}
        self._splittable: set[frozenset[str]] = (
            set()
        )  # modality sets no encoder hosts together, each hosted by some

    def _place(self, workers: dict[WorkerKind, list[WorkerInfo]]) -> None:
        """Where each worker runs: node ids and the encoders sharing each prefill's process."""
        self.workers = workers
        nodes = sorted({w.node for infos in workers.values() for w in infos})
        self.node_ids = {
            kind: [nodes.index(w.node) for w in infos] for kind, infos in workers.items()
        }
        self.num_nodes = len(nodes)
        self.colocated = [
            tuple(e.index for e in workers[_E] if p.process is not None and e.process == p.process)
            for p in workers[_P]
        ]
        self.any_colocated = any(self.colocated)
        self._dirty = True

    def set_infos(self, workers: Iterable[WorkerInfo]) -> None:
        """The same workers' slots, placed anew (a worker started on another node)."""
        placed = _as_infos(workers)
        if {k: len(v) for k, v in placed.items()} != {k: len(v) for k, v in self.workers.items()}:
            raise ValueError("set_infos takes the same worker slots, placed anew")
        self._place(placed)

    def forget(self, kind: WorkerKind, index: int, now_s: float) -> None:
        """Worker `index` stopped (its slot is empty): out of routing, its caches out of view."""
        self.set_healthy(kind, index, False)
        self.reports[kind][index] = None
        if kind is _E:
            self.encoder_cache.publish(index, frozenset(), now_s)
        elif kind is _P:
            self.prefix_cache.publish(index, frozenset(), now_s)
        elif kind is _D:
            self._report_running(index, None, now_s)
        if kind is not _D:
            self._report_foreign(kind, index, 0)

    # -- time, liveness, candidates -----------------------------------------------------------
    def refresh(self, now_s: float) -> None:
        """Advance the view's clock: expire stale cache reports and silent workers. Called several
        times per request, so it only compares times until a cache has something to expire."""
        if now_s > self.now_s:
            self.now_s = now_s
        now_s = self.now_s
        if now_s >= self.encoder_cache.due:
            self.encoder_cache.refresh(now_s)
        if now_s >= self.prefix_cache.due:
            self.prefix_cache.refresh(now_s)

    def state(self, kind: WorkerKind, index: int) -> WorkerState:
        if not self.healthy[kind][index]:
            return WorkerState.DOWN
        report = self.reports[kind][index]
        if report is not None and self.now_s - report.at_s > self.dead_after_s:
            return WorkerState.SILENT
        return WorkerState.UP

    def _recompute(self) -> None:
        self._dirty, self._valid_until = False, math.inf
        for kind, infos in self.workers.items():
            up = [i for i in range(len(infos)) if self.state(kind, i) is WorkerState.UP]
            self._candidates[kind], self._masks[kind] = up, sum(1 << i for i in up)
            for i in up:  # when the next of them falls silent
                report = self.reports[kind][i]
                if report is not None:
                    self._valid_until = min(self._valid_until, report.at_s + self.dead_after_s)
        self._by_modalities = {}
        self._splittable = set()

    def _ensure(self) -> None:
        if self._dirty or self.now_s > self._valid_until:
            self._recompute()

    def candidates(self, kind: WorkerKind, modalities: frozenset[str] = frozenset()) -> list[int]:
        """Workers to route to (do not mutate); encoders must host all of `modalities`."""
        self._ensure()
        if kind is not _E or not modalities:
            if not self._candidates[kind]:
                raise NoWorkerError(f"no healthy {kind.value} worker")
            return self._candidates[kind]
        found = self._hosting(modalities, modalities)[0]
        if not found:
            raise self._unhosted(modalities)
        return found

    def encoders_for(self, items: tuple[MediaJob, ...]) -> tuple[list[int], dict[int, list[int]]]:
        """candidates(ENCODER, the modalities of `items`), and the same per node id (each list in
        index order; do not mutate). Memoised; a one-item request skips building the modality set.

        Empty lists when no encoder hosts them all but each is hosted by some encoder: the request
        is then split by modality (router/split.py). NoWorkerError when a modality has no host."""
        self._ensure()
        key = items[0].modality if len(items) == 1 else frozenset(item.modality for item in items)
        found = self._by_modalities.get(key)
        if found is None or not found[0]:  # not memoised yet, or nobody hosts them all
            modalities = frozenset([key]) if len(items) == 1 else key
            found = self._hosting(key, modalities)
            if not found[0] and key not in self._splittable:
                if len(items) == 1 or self._missing(modalities):
                    raise self._unhosted(modalities)
                self._splittable.add(key)
        return found

    def encoders_hosting(self, modality: str) -> list[int]:
        """Candidate encoders hosting `modality` (do not mutate); NoWorkerError if none."""
        self._ensure()
        found = self._hosting(modality, frozenset([modality]))[0]
        if not found:
            raise self._unhosted(frozenset([modality]))
        return found

    def _hosting(
        self, key: frozenset[str] | str, modalities: frozenset[str]
    ) -> tuple[list[int], dict[int, list[int]]]:
        found = self._by_modalities.get(key)
        if found is None:
            encoders = [
                i for i in self._candidates[_E] if modalities <= self.workers[_E][i].modalities
            ]
            on_node: dict[int, list[int]] = {}
            for e in encoders:
                on_node.setdefault(self.node_ids[_E][e], []).append(e)
            found = self._by_modalities[key] = (encoders, on_node)
        return found

    def _missing(self, modalities: frozenset[str]) -> list[str]:
        """Those of `modalities` no candidate encoder hosts."""
        hosted = set().union(*(self.workers[_E][i].modalities for i in self._candidates[_E]))
        return sorted(modalities - hosted)

    def _unhosted(self, modalities: frozenset[str]) -> NoWorkerError:
        missing = self._missing(modalities)
        what = " + ".join(missing) if missing else "all of " + " + ".join(sorted(modalities))
        return NoWorkerError(f"no healthy encoder worker hosts {what}")

    def candidate_mask(self, kind: WorkerKind) -> int:
        self._ensure()
        return self._masks[kind]

    def set_healthy(self, kind: WorkerKind, index: int, healthy: bool) -> None:
        self.healthy[kind][index] = healthy
        self._dirty = True

    def publish(
        self,
        kind: WorkerKind,
        index: int,
        *,
        now_s: float,
        queued: int | None = None,
        running: int | None = None,
        cached_identifiers: frozenset[str] | None = None,
        prefix_hashes: frozenset[str] | None = None,
    ) -> None:
        """A worker's report (also its heartbeat); None fields leave what the router knew."""
        self.now_s = max(self.now_s, now_s)
        was_silent = self.state(kind, index) is WorkerState.SILENT
        self.reports[kind][index] = WorkerReport(
            now_s, queued, running, cached_identifiers, prefix_hashes
        )
        if kind is _D:
            self._report_running(index, running, now_s)
        elif queued is not None:
            self._report_foreign(kind, index, queued + (running or 0))
        if was_silent or now_s + self.dead_after_s < self._valid_until:
            self._dirty = True
        if kind is _E and cached_identifiers is not None:
            self.encoder_cache.publish(index, cached_identifiers, now_s)
        if kind is _P and prefix_hashes is not None:
            self.prefix_cache.publish(index, prefix_hashes, now_s)

    def share_foreign(
        self, kind: WorkerKind, booked_ms: list[float] | None, num_others: int
    ) -> None:
        """The other `num_others` replicas' booked ms on each worker of `kind` (summed), as of
        their last share: they replace the reported counts in the queue (foreign_queue_ms).
        None: no other replica shares any more; reported counts are priced again."""
        if booked_ms is None and self.foreign_ms[kind] is None:
            return  # not sharing, as before: the reported counts stand
        self.foreign_ms[kind], self._num_others = booked_ms, num_others
        self._booked_at_share[kind] = list(self.booked_ms_total[kind])
        self.num_foreign[kind] = 0
        self.foreign[kind] = [0] * len(self.outstanding[kind])

    def foreign_queue_ms(self, kind: WorkerKind) -> list[float] | None:
        """Other replicas' work queued on each worker, in ms: what they last shared, plus what
        they have presumably booked since. Routers with the same information make the same
        choices, so until the next share each of this router's bookings stands for one by
        each of the others on the same worker: they spread instead of herding."""
        shared = self.foreign_ms[kind]
        if shared is None or not self._num_others:
            return shared
        k, since = self._num_others, self._booked_at_share[kind]
        return [f + k * (t - b) for f, t, b in zip(shared, self.booked_ms_total[kind], since)]

    def _report_foreign(self, kind: WorkerKind, index: int, reported: int) -> None:
        if kind in self.foreign_ms and self.foreign_ms[kind] is not None:
            return  # bookings shared: exact, where reported counts are priced by guess
        own = self.outstanding[kind][index]
        foreign = reported - own if reported > own else 0
        self.num_foreign[kind] += foreign - self.foreign[kind][index]
        self.foreign[kind][index] = foreign

    # -- placement and caches -----------------------------------------------------------------
    def placement(self, encoder: int, prefill: int) -> Placement:
        if encoder in self.colocated[prefill]:
            return Placement.SAME_PROCESS
        same = self.node_ids[_E][encoder] == self.node_ids[_P][prefill]
        return Placement.SAME_NODE if same else Placement.CROSS_NODE

    def holds_item(self, encoder: int, identifier: str) -> bool:
        return bool(self.encoder_cache.holders(identifier) >> encoder & 1)

    def item_holders(self, items: tuple[MediaJob, ...]) -> list[int]:
        """Per item, the bitmask of the encoders holding it."""
        holders = self.encoder_cache.holders
        return [holders(item.identifier) for item in items]

    def prefix_blocks(self, prefill: int, prefix_hashes: tuple[str, ...]) -> int:
        memo = self._prefix_memo  # the policy usually just matched this very prompt
        if (
            memo[0] is prefix_hashes
            and memo[1] >> prefill & 1
            and memo[2] == self.prefix_cache.version
        ):
            return memo[3].get(prefill, 0)
        version, found = (
            self.prefix_cache.version,
            self.prefix_cache.longest_runs(prefix_hashes, 1 << prefill),
        )
        self._prefix_memo = (prefix_hashes, 1 << prefill, version, found)  # dispatch() asks again
        return found.get(prefill, 0)

    def prefix_matches(self, prefix_hashes: tuple[str, ...]) -> dict[int, int]:
        """Leading blocks held, per candidate prefill worker holding at least one (read-only)."""
        if not prefix_hashes:
            return {}
        among, version, memo = self.candidate_mask(_P), self.prefix_cache.version, self._prefix_memo
        if memo[0] is prefix_hashes and memo[1] == among and memo[2] == version:
            return memo[3]
        found = self.prefix_cache.longest_runs(prefix_hashes, among)
        self._prefix_memo = (
            prefix_hashes,
            among,
            version,
            found,
        )  # holds the tuple, so `is` stays sound
        return found

    # -- decode load ------------------------------------------------------------------------------
    def least_loaded_decode(self) -> int:
        """The candidate decode worker of fewest running sequences (decode_loads()); ties to the
        lowest index."""
        self._ensure()
        decoders, loads = self._candidates[_D], self._loads
        if self._oldest_running_at < self.now_s - self.staleness_s:  # decode_loads(), inlined
            self._recount_running()
        if not decoders:
            raise NoWorkerError(f"no healthy {_D.value} worker")
        if len(decoders) == len(
            loads
        ):  # all are candidates (the usual case): the first minimum, at C speed
            return loads.index(min(loads))
        return min(decoders, key=loads.__getitem__)

    def decode_loads(self) -> list[int]:
        """Running sequences per decode worker: ours, or its fresh report if that counts more
        (other ingress replicas route to it too). Do not mutate.

        Maintained per worker as its count or its report changes; rebuilt only when the oldest
        report counted goes stale (reports arrive in rounds, so that is rare)."""
        if self._oldest_running_at < self.now_s - self.staleness_s:
            self._recount_running()
        return self._loads

    def _report_running(self, index: int, running: int | None, at_s: float) -> None:
        self._reported_running[index] = 0 if running is None else running
        self._set_load(index)
        if running is not None:
            self._oldest_running_at = min(self._oldest_running_at, at_s)

    def _recount_running(self) -> None:
        limit, self._oldest_running_at = self.now_s - self.staleness_s, math.inf
        for d, report in enumerate(self.reports[_D]):
            fresh = report is not None and report.running is not None and not report.at_s < limit
            self._reported_running[d] = report.running if fresh else 0
            if fresh:
                self._oldest_running_at = min(self._oldest_running_at, report.at_s)
            self._set_load(d)

    def _set_load(self, index: int) -> None:
        own, reported = self.outstanding[_D][index], self._reported_running[index]
        self._loads[index] = own if own >= reported else reported

    # -- dispatch bookkeeping -----------------------------------------------------------------
    def begin(self, kind: WorkerKind, index: int | None, amount: int = 1, ms: float = 0.0) -> None:
        if index is not None:
            self.outstanding[kind][index] += amount
            self.outstanding_ms[kind][index] += ms
            if kind is _D:
                self._set_load(index)
            elif kind is _P:
                for _ in range(amount):
                    insort(self.prefill_jobs_ms[index], ms / amount)

    def end(
        self, kind: WorkerKind, index: int | None, amount: int = 1, ms: float | None = None
    ) -> None:
        """Release finished work; without `ms`, the finished jobs' share of the worker's ms."""
        if index is None:
            return
        counts, booked = self.outstanding[kind], self.outstanding_ms[kind]
        count = counts[index]
        left = count - amount if count > amount else 0
        counts[index] = left
        if left:
            total = booked[index]
            if ms is None:  # amount < count here
                ms = total * amount / count
            left_ms = total - ms
            booked[index] = left_ms if left_ms > 0.0 else 0.0
        else:
            booked[index] = 0.0  # no float residue when idle
        if kind is _D:
            self._set_load(index)
        elif kind is _P:  # the next job, if any, starts now (see __init__)
            self.service_started_ms[index] = self.now_s * 1e3 if left else math.inf
            self.service_ms[index] = booked[index] / left if left else 0.0
            jobs = self.prefill_jobs_ms[index]
            if not left:
                jobs.clear()
            elif amount == 1 and ms in jobs:  # the finished job's own booking (the router's)
                jobs.remove(ms)
            else:  # unknown which: the longest
                del jobs[max(0, len(jobs) - amount) :]

    def begin_route(self, decision: RouteDecision, num_items: int) -> None:
        """begin() for each stage of the decision (encoder: its items and their estimated ms)."""
        estimate, encoder, prefill, decode = (
            decision.estimate,
            decision.encoder,
            decision.prefill,
            decision.decode,
        )
        counts, booked = self.outstanding, self.outstanding_ms
        totals = self.booked_ms_total
        if decision.shares:  # split by modality: each encoder books its own part
            for share in decision.shares:
                counts[_E][share.encoder] += share.num_items
                booked[_E][share.encoder] += share.encode_ms
                totals[_E][share.encoder] += share.encode_ms
        elif encoder is not None:
            counts[_E][encoder] += num_items
            booked[_E][encoder] += estimate.encode_ms
            totals[_E][encoder] += estimate.encode_ms
        jobs = counts[_P]
        if not jobs[prefill]:  # an idle worker: the job starts once its embeddings are in
            ahead_ms = estimate.encoder_queue_ms + estimate.encode_ms + estimate.transfer_ms
            self.service_started_ms[prefill] = self.now_s * 1e3 + ahead_ms  # see __init__
            self.service_ms[prefill] = estimate.prefill_ms
        jobs[prefill] += 1
        booked[_P][prefill] += estimate.prefill_ms
        insort(self.prefill_jobs_ms[prefill], estimate.prefill_ms)
        totals[_P][prefill] += estimate.prefill_ms
        running = counts[_D]
        own = running[decode] = running[decode] + 1
        if own > self._loads[decode]:  # what _set_load() gives
            self._loads[decode] = own

    def dispatch(self, decision: RouteDecision, profile: RequestProfile) -> None:
        """Record a routed request: its work, and the caches it will warm (what they lack)."""
        self.begin_route(decision, len(profile.items))
        if decision.shares:
            for share in decision.shares:
                self.encoder_cache.add(
                    share.encoder, tuple([item.identifier for item in share.encode_items])
                )
        elif decision.encode_items:
            self.encoder_cache.add(
                decision.encoder, tuple([item.identifier for item in decision.encode_items])
            )
        if profile.prefix_hashes:
            held = self.prefix_blocks(decision.prefill, profile.prefix_hashes)
            self.prefix_cache.add(
                decision.prefill, profile.prefix_hashes[held:OPTIMISTIC_PREFIX_BLOCKS]
            )

    def queue_depth(self, kind: WorkerKind) -> int:
        return sum(self.outstanding[kind])


def unique_items(items: tuple[MediaJob, ...]) -> tuple[MediaJob, ...]:
    """An identifier twice in one request is encoded once (the second is a cache hit)."""
    if len(items) < 2 or len({item.identifier for item in items}) == len(items):
        return items
    seen: dict[str, MediaJob] = {}
    for item in items:
        seen.setdefault(item.identifier, item)
    return tuple(seen.values())
