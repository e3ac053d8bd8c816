"""The router's view of the fleet: who is up, how much work each worker has, who caches what.

Two sources, on purpose:
- the router's own dispatch counts (jobs and estimated ms, added on route, released when
  the stage finishes), so the view is never staler than its own decisions;
- reports the workers publish (queue sizes, cached media identifiers, prefix blocks),
  which are trusted for `staleness_s` only; a worker silent for `dead_after_s` after
  having reported leaves the candidate set until it reports again.

Time is always passed in (`now_s`), so the simulator and the live ingress drive the same
code. Cache contents are bitmasks of worker indices per key, so "which encoders hold this
image" or "how far does each prefill worker match this prompt" costs a few dict lookups.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

from router.types import MediaJob, Placement, RequestProfile, RouteDecision, WorkerInfo, WorkerKind, WorkerReport, WorkerState

ALL_MODALITIES = frozenset({"image", "video", "audio"})
# Leading prefix blocks the router assumes a prefill worker holds right after dispatch, until its
# next report (32 x 16 = 512 tokens: the head of a shared system prompt). Recording every block
# would cost O(prompt) dict inserts per route, the largest cost of a decision.
OPTIMISTIC_PREFIX_BLOCKS = 32
_E, _P, _D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


class NoWorkerError(RuntimeError):
    pass


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class HolderIndex:
    """key -> bitmask of the workers holding it: published sets (trusted while fresh) plus the
    router's own recent dispatches (kept ttl/2..ttl in two generations: O(1) per key, no per-key expiry)."""

    def __init__(self, num_workers: int, ttl_s: float):
        self.ttl_s = ttl_s
        self._published: list[frozenset[str]] = [frozenset()] * num_workers
        self._published_at: list[float | None] = [None] * num_workers
        self._mask: dict[str, int] = {}
        self._fresh = 0  # workers whose published set is not older than ttl_s
        self._fresh_until = math.inf
        self._recent: dict[str, int] = {}  # the optimistic part, newer generation
        self._older: dict[str, int] = {}
        self._rotate_at = -math.inf
        self.version = 0  # bumped on every change, so callers may memoise lookups

    def publish(self, worker: int, keys: frozenset[str], now_s: float) -> None:
        bit, old = 1 << worker, self._published[worker]
        for key in old - keys:
            left = self._mask[key] & ~bit
            if left:
                self._mask[key] = left
            else:
                del self._mask[key]
        for key in keys - old:
            self._mask[key] = self._mask.get(key, 0) | bit
        self._published[worker], self._published_at[worker] = keys, now_s
        self.version += 1
        self._fresh |= bit
        self._fresh_until = min(self._fresh_until, now_s + self.ttl_s)

    def add(self, worker: int, keys: tuple[str, ...]) -> None:
        """The router just sent these keys to `worker`: assume it holds them for a while."""
        if not keys:
            return
        bit, recent = 1 << worker, self._recent
        self.version += 1
        new = [key for key in keys if key not in recent]
        recent.update(dict.fromkeys(new, bit))  # the usual case, at C speed
        if len(new) < len(keys):
            for key in set(keys).difference(new):
                recent[key] |= bit

    def refresh(self, now_s: float) -> None:
        if now_s >= self._rotate_at:  # age the optimistic entries by one generation
            long_gap = now_s >= self._rotate_at + self.ttl_s / 2
            self._older, self._recent = ({} if long_gap else self._recent), {}
            self._rotate_at = now_s + self.ttl_s / 2
            self.version += 1
        if now_s > self._fresh_until:  # a published set went stale
            limit, self._fresh, self._fresh_until = now_s - self.ttl_s, 0, math.inf
            self.version += 1
            for i, at in enumerate(self._published_at):
                if at is not None and at >= limit:
                    self._fresh |= 1 << i
                    self._fresh_until = min(self._fresh_until, at + self.ttl_s)

    def holders(self, key: str) -> int:
        return (self._mask.get(key, 0) & self._fresh) | self._recent.get(key, 0) | self._older.get(key, 0)

    def longest_runs(self, keys: tuple[str, ...], among: int) -> dict[int, int]:
        """For each worker in `among` holding keys[0]: how many leading keys it holds."""
        out: dict[int, int] = {}
        alive, pub, fresh, recent, older = among, self._mask, self._fresh, self._recent, self._older
        for k, key in enumerate(keys):
            held = alive & pub.get(key, 0) & fresh  # the small published index first: usually enough
            if held != alive:
                held = alive & (held | recent.get(key, 0) | older.get(key, 0))
            if held != alive:
                if k:
                    for i in bits(alive ^ held):
                        out[i] = k
                alive = held
                if not alive:
                    return out
        for i in bits(alive):
            out[i] = len(keys)
        return out


def _as_infos(workers: Iterable[WorkerInfo] | Mapping[WorkerKind, int]) -> dict[WorkerKind, list[WorkerInfo]]:
    if isinstance(workers, Mapping):  # the stand-in's {kind: count}: one node, encoders host everything
        workers = [WorkerInfo(kind, i, modalities=ALL_MODALITIES if kind is _E else frozenset()) for kind, n in workers.items() for i in range(n)]
    by_kind: dict[WorkerKind, list[WorkerInfo]] = {kind: [] for kind in WorkerKind}
    for info in sorted(workers, key=lambda w: w.index):
        by_kind[info.kind].append(info)
    for kind, infos in by_kind.items():
        if [w.index for w in infos] != list(range(len(infos))):
            raise ValueError(f"{kind.value} worker indices must be 0..n-1, got {[w.index for w in infos]}")
    return by_kind


class ClusterView:
    def __init__(self, workers: Iterable[WorkerInfo] | Mapping[WorkerKind, int], *, staleness_s: float = 5.0, dead_after_s: float = 10.0):
        self.workers = _as_infos(workers)
        self.staleness_s, self.dead_after_s = staleness_s, dead_after_s
        sizes = {kind: len(infos) for kind, infos in self.workers.items()}
        self.outstanding = {kind: [0] * n for kind, n in sizes.items()}  # jobs (encoder: items) dispatched, not done
        self.outstanding_ms = {kind: [0.0] * n for kind, n in sizes.items()}  # their estimated work
        self.healthy = {kind: [True] * n for kind, n in sizes.items()}  # explicit set_healthy
        self.reports: dict[WorkerKind, list[WorkerReport | None]] = {kind: [None] * n for kind, n in sizes.items()}
        self.encoder_cache = HolderIndex(sizes[_E], staleness_s)
        self.prefix_cache = HolderIndex(sizes[_P], staleness_s)
        nodes = sorted({w.node for infos in self.workers.values() for w in infos})
        self.node_ids = {kind: [nodes.index(w.node) for w in infos] for kind, infos in self.workers.items()}
        self.num_nodes = len(nodes)
        self.colocated = [tuple(e.index for e in self.workers[_E] if p.process is not None and e.process == p.process) for p in self.workers[_P]]
        self.any_colocated = any(self.colocated)
        self._prefix_memo: tuple[tuple[str, ...] | None, int, int, dict[int, int]] = (None, 0, -1, {})
        self._running_reported = False  # has any decode worker published `running`
        self.now_s = -math.inf
        self._dirty = True  # candidate lists are recomputed when dirty or once now_s passes _valid_until
        self._valid_until = math.inf
        self._candidates: dict[WorkerKind, list[int]] = {}
        self._masks: dict[WorkerKind, int] = {}
        self._by_modalities: dict[frozenset[str], list[int]] = {}

    # -- time, liveness, candidates -----------------------------------------------------------
    def refresh(self, now_s: float) -> None:
        """Advance the view's clock: expire stale cache reports and silent workers."""
        self.now_s = max(self.now_s, now_s)
        self.encoder_cache.refresh(self.now_s)
        self.prefix_cache.refresh(self.now_s)

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
        found = self._by_modalities.get(modalities)
        if found is None:
            found = self._by_modalities[modalities] = [i for i in self._candidates[_E] if modalities <= self.workers[_E][i].modalities]
        if not found:
            hosted = set().union(*(self.workers[_E][i].modalities for i in self._candidates[_E]))
            missing = sorted(modalities - hosted)
            what = " + ".join(missing) if missing else "all of " + " + ".join(sorted(modalities))
            raise NoWorkerError(f"no healthy encoder worker hosts {what}")
        return found

    def candidate_mask(self, kind: WorkerKind) -> int:
        self._ensure()
        return self._masks[kind]

    def set_healthy(self, kind: WorkerKind, index: int, healthy: bool) -> None:
        self.healthy[kind][index] = healthy
        self._dirty = True

    def publish(self, kind: WorkerKind, index: int, *, now_s: float, queued: int | None = None, running: int | None = None,
                cached_identifiers: frozenset[str] | None = None, prefix_hashes: frozenset[str] | None = None) -> None:
        """A worker's report (also its heartbeat); None fields leave what the router knew."""
        self.now_s = max(self.now_s, now_s)
        was_silent = self.state(kind, index) is WorkerState.SILENT
        self.reports[kind][index] = WorkerReport(now_s, queued, running, cached_identifiers, prefix_hashes)
        self._running_reported |= kind is _D and running is not None
        if was_silent or now_s + self.dead_after_s < self._valid_until:
            self._dirty = True
        if kind is _E and cached_identifiers is not None:
            self.encoder_cache.publish(index, cached_identifiers, now_s)
        if kind is _P and prefix_hashes is not None:
            self.prefix_cache.publish(index, prefix_hashes, now_s)

    # -- placement and caches -----------------------------------------------------------------
    def placement(self, encoder: int, prefill: int) -> Placement:
        if encoder in self.colocated[prefill]:
            return Placement.SAME_PROCESS
        same = self.node_ids[_E][encoder] == self.node_ids[_P][prefill]
        return Placement.SAME_NODE if same else Placement.CROSS_NODE

    def holds_item(self, encoder: int, identifier: str) -> bool:
        return bool(self.encoder_cache.holders(identifier) >> encoder & 1)

    def prefix_blocks(self, prefill: int, prefix_hashes: tuple[str, ...]) -> int:
        memo = self._prefix_memo  # the policy usually just matched this very prompt
        if memo[0] is prefix_hashes and memo[1] >> prefill & 1 and memo[2] == self.prefix_cache.version:
            return memo[3].get(prefill, 0)
        return self.prefix_cache.longest_runs(prefix_hashes, 1 << prefill).get(prefill, 0)

    def prefix_matches(self, prefix_hashes: tuple[str, ...]) -> dict[int, int]:
        """Leading blocks held, per candidate prefill worker holding at least one (do not mutate)."""
        if not prefix_hashes:
            return {}
        among, version, memo = self.candidate_mask(_P), self.prefix_cache.version, self._prefix_memo
        if memo[0] is prefix_hashes and memo[1] == among and memo[2] == version:
            return memo[3]
        found = self.prefix_cache.longest_runs(prefix_hashes, among)
        self._prefix_memo = (prefix_hashes, among, version, found)  # holds the tuple, so `is` stays sound
        return found

    def decode_loads(self) -> list[int]:
        """Running sequences per decode worker: ours, or its fresh report if that counts more
        (other ingress replicas route to it too). Do not mutate."""
        own, reports = self.outstanding[_D], self.reports[_D]
        if not self._running_reported:
            return own
        limit = self.now_s - self.staleness_s
        return [o if r is None or r.running is None or r.at_s < limit else max(o, r.running) for o, r in zip(own, reports)]

    # -- dispatch bookkeeping -----------------------------------------------------------------
    def begin(self, kind: WorkerKind, index: int | None, amount: int = 1, ms: float = 0.0) -> None:
        if index is not None:
            self.outstanding[kind][index] += amount
            self.outstanding_ms[kind][index] += ms

    def end(self, kind: WorkerKind, index: int | None, amount: int = 1, ms: float | None = None) -> None:
        """Release finished work; without `ms`, the finished jobs' share of the worker's ms."""
        if index is None:
            return
        count, total = self.outstanding[kind][index], self.outstanding_ms[kind][index]
        if ms is None:
            ms = total * min(amount, count) / count if count else total
        left = max(0, count - amount)
        self.outstanding[kind][index] = left
        self.outstanding_ms[kind][index] = max(0.0, total - ms) if left else 0.0  # no float residue when idle

    def begin_route(self, decision: RouteDecision, num_items: int) -> None:
        self.begin(_E, decision.encoder, num_items, decision.estimate.encode_ms)
        self.begin(_P, decision.prefill, 1, decision.estimate.prefill_ms)
        self.begin(_D, decision.decode)

    def dispatch(self, decision: RouteDecision, profile: RequestProfile) -> None:
        """Record a routed request: its work, and the caches it will warm (what they lack)."""
        self.begin_route(decision, profile.num_items)
        if decision.encoder is not None:
            self.encoder_cache.add(decision.encoder, tuple(item.identifier for item in decision.encode_items))
        held = self.prefix_blocks(decision.prefill, profile.prefix_hashes) if profile.prefix_hashes else 0
        self.prefix_cache.add(decision.prefill, profile.prefix_hashes[held:OPTIMISTIC_PREFIX_BLOCKS])

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
