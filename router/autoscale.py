"""Per-pool autoscaling decisions: how many workers a pool wants, from its load over time.

- Load: the work offered to the pool, in workers' worth (1.0: one worker busy all the time).
  Encoders and prefill: the router's booked estimate of compute per second, summed over the
  ingress replicas; decode: rows generating or waiting over the batch size (the controller
  measures both, cluster/pool_scaling.py).
- Up: the workers that would run at the target utilisation, at once (a 3x burst asks for 3),
  once the load has stayed above it for `up_delay_s`.
- Down: one worker at a time, once even one worker fewer would have stayed at or below the
  target for `down_delay_s`: a brief lull does not drop a worker that a burst needs again.
- Workers still starting count as the pool's, so a slow start does not ask for more again.

Plain Python: time is passed in, so tests and the simulator drive it without a cluster.
"""

from __future__ import annotations

import math
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
