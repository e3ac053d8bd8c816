"""How busy each prefill worker has been: the wait a request meets grows with it.

A prefill worker serves the shortest remaining prompt first, so the booked work ahead of a
request is not all of its wait: prompts that arrive while it waits and are shorter go first. A
request that waits W ms for booked work at a worker whose utilisation is rho waits, shorter
arrivals included, about W / (1 - rho) (a busy period). The router priced only W, so at high load
joint kept adding long prompts to the fast workers until they starved: on two workers of speeds 1
and 0.25 at 80% load its p99 was 7-12% worse than least_loaded's (docs/BENCHMARKS.md).

rho is each worker's booked prefill work per unit time, an exponentially weighted rate with a
memory of `CalibrationConfig.busy_memory_s`, capped at `max_busy`. Kept as values relative to a
reference time, so a read costs one exp for all workers.

Off by default (max_busy 0: booked work alone). In the simulator, exact costs, max_busy 0.95
brought joint to 0.94-1.02x least_loaded's p99 on that shape and the 16x16x16-hetero target from
54% to 56-57% below least_loaded; on that shape live it did not: 1.03-1.26x, with the long prompts
of its tail sent to the slow worker (the live rho, learned from the router's own estimates, sits
near the cap, where 1 / (1 - rho) is steepest). scripts/bench_busy.py and docs/BENCHMARKS.md have
the figures.
"""

from __future__ import annotations

import math

_REBASE = 50.0  # rebase when the reference is this many memories old (keeps e**x finite)


class BusyRates:
    def __init__(self, num_workers: int, memory_s: float, max_busy: float):
        self.memory_ms, self.max_busy = memory_s * 1e3, max_busy
        self.value = (
            [0.0] * num_workers
        )  # rho of each worker at the reference time, scaled by e**((t - ref) / memory)
        self.ref_ms = 0.0
        self._cache: tuple[float, int, list[float]] | None = None  # (now, version, factors)
        self.version = 0
        self.ones = [1.0] * num_workers  # the factors while off

    def book(self, worker: int, ms: float, now_s: float) -> None:
        """`ms` of work booked on `worker` at `now_s`."""
        if self.max_busy <= 0.0 or not ms > 0.0:
            return
        now_ms = now_s * 1e3
        if (now_ms - self.ref_ms) / self.memory_ms > _REBASE:
            decay = math.exp(-(now_ms - self.ref_ms) / self.memory_ms)
            self.value = [v * decay for v in self.value]
            self.ref_ms = now_ms
        self.value[worker] += (
            ms / self.memory_ms * math.exp((now_ms - self.ref_ms) / self.memory_ms)
        )
        self.version += 1

    def utilisation(self, now_s: float) -> list[float]:
        """rho of every worker now."""
        decay = math.exp(-(now_s * 1e3 - self.ref_ms) / self.memory_ms)
        return [v * decay for v in self.value]

    def factors(self, now_s: float) -> list[float]:
        """1 / (1 - min(rho, max_busy)) of every worker now: what its booked work's wait grows
        by."""
        if self.max_busy <= 0.0:
            return self.ones
        cache = self._cache
        if cache is not None and cache[0] == now_s and cache[1] == self.version:
            return cache[2]
        cap = self.max_busy
        out = [1.0 / (1.0 - (rho if rho < cap else cap)) for rho in self.utilisation(now_s)]
        self._cache = (now_s, self.version, out)
        return out
