"""Per-pool autoscaling decisions: how many workers a pool wants, from its load over time.

- Load: the work offered to the pool, in workers' worth (1.0: one worker busy all the time).
  Encoders and prefill: the router's booked estimate of compute per second, summed over the
  ingress replicas, or what the workers measured (`MeasuredLoad`) where that is more;
  decode: rows generating or waiting over the batch size (the controller measures them,
  cluster/pool_scaling.py).
- Up: the workers that would run at the target utilisation, at once (a 3x burst asks for 3),
  once the load has stayed above it for `up_delay_s`.
- Down: one worker at a time, once even one worker fewer would have stayed at or below the
  target for `down_delay_s`: a brief lull does not drop a worker that a burst needs again.
- Workers still starting count as the pool's, so a slow start does not ask for more again.

Plain Python: time is passed in, so tests and the simulator drive it without a cluster.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

_EPS = 1e-9  # a load of exactly n x target asks for n workers, not n + 1


@dataclass(frozen=True)
class ScalingRule:
    """One pool's bounds and pace, from its config's `autoscaling` section."""

    min_workers: int
    max_workers: int
    target_utilization: float  # the busy fraction each worker is sized to, in (0, 1]
    up_delay_s: float  # how long the load must stay above target before growing
    down_delay_s: float  # how long it must stay low before shrinking

    def wanted(self, load_workers: float) -> int:
        """Workers that carry `load_workers` at the target utilisation, within the bounds."""
        need = math.ceil(load_workers / self.target_utilization - _EPS)
        return min(max(need, self.min_workers), self.max_workers)


class PoolScaler:
    """The decisions for one pool; `decide` is called once per controller period."""

    def __init__(self, rule: ScalingRule):
        self.rule = rule
        self._up_since_s: float | None = None  # when the load first wanted more, this spell
        self._down_since_s: float | None = None  # when it first wanted fewer, this spell

    def decide(self, load_workers: float, num_workers: int, now_s: float) -> int:
        """The pool size to have now, given its current size (live + starting) and load."""
        wanted = self.rule.wanted(load_workers)
        if num_workers < self.rule.min_workers:  # e.g. a worker lost: back to the floor at once
            return self.rule.min_workers
        if wanted > num_workers:
            self._down_since_s = None
            self._up_since_s = now_s if self._up_since_s is None else self._up_since_s
            if now_s - self._up_since_s >= self.rule.up_delay_s:
                self._up_since_s = None
                return wanted
            return num_workers
        self._up_since_s = None
        if wanted < num_workers:
            self._down_since_s = now_s if self._down_since_s is None else self._down_since_s
            if now_s - self._down_since_s >= self.rule.down_delay_s:
                self._down_since_s = now_s  # the next worker off waits a whole delay again
                return num_workers - 1
            return num_workers
        self._down_since_s = None
        return num_workers


class MeasuredLoad:
    """A pool's load from its workers' own counters, needing no calibrated estimate: the
    device time they spent (`busy_s`), or the work that arrived (`work_in`: embeddings, prompt
    tokens) at the device time a unit of it took lately (`busy_s` per `work_done`), whichever
    is more. The second is not capped by the pool's size: one worker under a burst of three
    workers' worth measures 1.0 busy but 3.0 offered."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, tuple[float, float, float]] = {}  # slot -> its counters
        self._unit_s: float | None = None  # device seconds per unit of work, lately

    def update(self, counters: Mapping[Hashable, Mapping[str, float]], dt_s: float) -> float:
        """Workers' worth over the last `dt_s`, from each answering worker's counters (a slot
        whose counters went back has a new worker: it counts from the next period)."""
        busy_s = work_in = work_done = 0.0
        for slot, stats in counters.items():
            now = tuple(float(stats.get(k, 0.0)) for k in ("busy_s", "work_in", "work_done"))
            before, self._seen[slot] = self._seen.get(slot), now
            if before is None or any(n < b for n, b in zip(now, before)):
                continue
            busy_s, work_in, work_done = (
                busy_s + now[0] - before[0],
                work_in + now[1] - before[1],
                work_done + now[2] - before[2],
            )
        if work_done > 0 and busy_s > 0:
            self._unit_s = busy_s / work_done
        offered = work_in * self._unit_s if self._unit_s is not None else 0.0
        return max(busy_s, offered) / dt_s
