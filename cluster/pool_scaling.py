"""The fleet controller's autoscaling: each autoscaled pool sized by its own load.

Every PERIOD_S the controller calls `step`, which
1. routes to workers that became ready (a new worker asks Ray for its pool's resources, so on
   a `ray up` or KubeRay cluster the autoscaler may launch a node first; until then the worker
   is *starting* and its slot is empty in the replicas' snapshots);
2. stops draining workers that hold nothing any more (after DRAIN_GRACE_S, by which time every
   replica has stopped routing to them);
3. measures each pool's load, in workers' worth: encoders and prefill from the estimated ms the
   replicas' routers booked on them (pushed with their metrics each second), or what the
   workers measured where that is more (their device time, or the work that reached them at
   its measured cost: router/autoscale.py MeasuredLoad); decode from the rows generating or
   waiting over max_batch_size; and asks router/autoscale.py for a size;
4. grows by taking a draining worker back, then by starting workers in empty slots; shrinks by
   cancelling a start, then by draining the highest-index live worker.

Plain bookkeeping around the Fleet, which owns the actors; the controller's lock is held.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import ray

from cluster.config import PoolConfig
from cluster.snapshot import Scaling, Slot
from router.autoscale import MeasuredLoad, PoolScaler
from router.types import WorkerInfo, WorkerKind

if TYPE_CHECKING:  # the fleet imports the actors (torch): the ingress imports this module
    from cluster.fleet import Fleet

log = logging.getLogger(__name__)

PERIOD_S = 1.0
DRAIN_GRACE_S = 2.0  # well above a replica's snapshot sync (supervisor.CHECK_PERIOD_S)
_POLL_TIMEOUT_S = 2.0  # the controller's lock is held: snapshots wait meanwhile
# A worker holds nothing when every one of these stats is zero (absent ones count as zero).
_HOLDING = (
    "queued",
    "running",
    "rows",
    "held_kv",
    "held_embeddings",
    "open_streams",
    "cache_encoding_entries",
    "cache_referenced_entries",
)


class BookedLoad:
    """Estimated ms booked per worker since the last `take`, summed over the replicas, from
    their routers' running totals (a replica's first report counts from zero: it started
    after the controller)."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, list[float]]] = {}  # owner -> its latest totals
        self._since: dict[tuple[str, int], float] = {}  # (kind, index) -> ms since take()

    def report(self, owner: str, totals: Mapping[str, Sequence[float]]) -> None:
        last = self._last.get(owner, {})
        for kind, values in totals.items():
            before = last.get(kind, [])
            for index, total in enumerate(values):
                gained = total - (before[index] if index < len(before) else 0.0)
                if gained > 0:
                    self._since[(kind, index)] = self._since.get((kind, index), 0.0) + gained
        self._last[owner] = {kind: list(values) for kind, values in totals.items()}

    def forget(self, owner: str) -> None:
        self._last.pop(owner, None)

    def take(self) -> dict[tuple[str, int], float]:
        since, self._since = self._since, {}
        return since


@dataclasses.dataclass
class _Pool:
    kind: WorkerKind
    slots: range
    config: PoolConfig
    scaler: PoolScaler
    measured: MeasuredLoad = dataclasses.field(default_factory=MeasuredLoad)


class PoolScaling:
    def __init__(self, fleet: Fleet, now_s: float):
        self.fleet = fleet
        self.pools = [
            _Pool(kind, slots, pool, PoolScaler(pool.autoscaling.rule()))
            for kind, slots, pool in fleet.slots_of()
            if pool.autoscaling is not None
        ]
        self.booked = BookedLoad()
        self._starting: dict[Slot, ray.ObjectRef] = {}
        self._draining: dict[Slot, float] = {}  # slot -> when it started draining
        self._last_step_s = now_s

    def scaling(self) -> Scaling:
        return Scaling(frozenset(self._starting), frozenset(self._draining))

    def starting_refs(self) -> list[ray.ObjectRef]:
        """The `ready` refs of workers still starting: the controller wakes when one resolves,
        so a new worker is routed to as soon as it is up, not at the next period."""
        return list(self._starting.values())

    def step(self, now_s: float, infos: tuple[WorkerInfo, ...]) -> tuple[WorkerInfo, ...] | None:
        """One period's decisions; returns the new worker infos when the snapshot changed."""
        dt_s, self._last_step_s = max(now_s - self._last_step_s, 1e-3), now_s
        changed, infos = self._promote_ready(infos)
        changed |= self._stop_drained(now_s)
        booked = self.booked.take()
        for pool in self.pools:
            changed |= self._resize(pool, self._load(pool, booked, dt_s), now_s)
        return infos if changed else None

    def _promote_ready(self, infos: tuple[WorkerInfo, ...]) -> tuple[bool, tuple]:
        if not self._starting:
            return False, infos
        slots = {ref: slot for slot, ref in self._starting.items()}
        ready, _ = ray.wait(list(slots), num_returns=len(slots), timeout=0)
        for ref in ready:
            slot = slots[ref]
            del self._starting[slot]
            try:
                ray.get(ref)
            except Exception as exc:  # it died starting: the slot is free again
                log.warning("%s worker %d failed to start: %s", slot[0].value, slot[1], exc)
                self.fleet.stop(*slot)
                continue
            node = ray.get(self.fleet.node_of(*slot))
            infos = tuple(
                dataclasses.replace(w, node=node) if (w.kind, w.index) == slot else w for w in infos
            )
            log.warning("%s worker %d is ready: routed to from now", slot[0].value, slot[1])
        return bool(ready), infos

    def _stop_drained(self, now_s: float) -> bool:
        due = [s for s, since in self._draining.items() if now_s - since >= DRAIN_GRACE_S]
        if not due:
            return False
        stats = self._stats(due)
        stopped = [slot for slot, s in zip(due, stats) if s is not None and _holds_nothing(s)]
        for slot in stopped:
            del self._draining[slot]
            self.fleet.stop(*slot)
            log.warning("%s worker %d drained and stopped", slot[0].value, slot[1])
        return bool(stopped)

    def _stats(self, slots: list[Slot]) -> list[dict | None]:
        """Each worker's stats, None where it did not answer within _POLL_TIMEOUT_S (all asked
        at once: one slow worker must not stall the period)."""
        refs = [self.fleet.pools[kind][index].stats.remote() for kind, index in slots]
        if not refs:
            return []
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=_POLL_TIMEOUT_S)[0])
        return [_answer(ref) if ref in ready else None for ref in refs]

    def _load(self, pool: _Pool, booked: dict[tuple[str, int], float], dt_s: float) -> float:
        """The pool's offered load, in workers' worth: for encoders and prefill the booked
        estimate, or what the workers measured where that is more (an estimate not yet
        calibrated, e.g. the first burst after a deploy, reads low)."""
        present = [  # workers still starting have nothing to say (and may not be placed yet)
            (pool.kind, i)
            for i in pool.slots
            if self.fleet.pools[pool.kind][i] is not None and (pool.kind, i) not in self._starting
        ]
        stats = self._stats(present)
        if pool.kind is WorkerKind.DECODE:
            rows = sum(s.get("running", 0) + s.get("queued", 0) for s in stats if s)
            return rows / pool.config.max_batch_size
        ms = sum(booked.get((pool.kind.value, i), 0.0) for i in pool.slots)
        counters = {slot: s for slot, s in zip(present, stats) if s is not None}
        return max(ms / 1e3 / dt_s, pool.measured.update(counters, dt_s))

    def _resize(self, pool: _Pool, load: float, now_s: float) -> bool:
        live = [i for i in pool.slots if self._is_live(pool.kind, i)]
        starting = [i for i in pool.slots if (pool.kind, i) in self._starting]
        size = len(live) + len(starting)
        wanted = pool.scaler.decide(load, size, now_s)
        if wanted > size:
            log.warning(
                "%s pool: load %.2f workers, growing %d -> %d", pool.kind.value, load, size, wanted
            )
            for _ in range(wanted - size):
                self._grow(pool)
            return True
        if wanted < size:
            log.warning(
                "%s pool: load %.2f workers, shrinking %d -> %d",
                pool.kind.value,
                load,
                size,
                wanted,
            )
            self._shrink(pool, live, starting)
            return True
        return False

    def _is_live(self, kind: WorkerKind, index: int) -> bool:
        slot = (kind, index)
        present = self.fleet.pools[kind][index] is not None
        return present and slot not in self._starting and slot not in self._draining

    def _grow(self, pool: _Pool) -> None:
        draining = [i for i in pool.slots if (pool.kind, i) in self._draining]
        if draining:  # a warm worker back beats a cold start
            del self._draining[(pool.kind, draining[-1])]
            return
        index = next(i for i in pool.slots if self.fleet.pools[pool.kind][i] is None)
        self._starting[(pool.kind, index)] = self.fleet.start(pool.kind, index)

    def _shrink(self, pool: _Pool, live: list[int], starting: list[int]) -> None:
        if starting:
            index = starting[-1]
            del self._starting[(pool.kind, index)]
            self.fleet.stop(pool.kind, index)
        elif len(live) > 1:  # the last routable worker never drains
            self._draining[(pool.kind, live[-1])] = self._last_step_s


def _answer(ref) -> dict | None:
    try:
        return ray.get(ref)
    except Exception:  # it died: the replicas' supervisors replace it; asked again next period
        return None


def _holds_nothing(stats: dict) -> bool:
    return all(stats.get(key, 0) == 0 for key in _HOLDING)
