"""Online calibration of the cost model: pool-wide curves times per-worker relative times.

A per-worker fit runs away: equal workers' fits drift apart on noise, a fit learned in a
burst stays wrong once the router stops sending to that worker, and the router then piles
onto whichever workers look fastest. So each stage (and modality) has

- one pool-wide curve `a + b * x` (OnlineLinear) with a short memory: every worker's
  observations feed it, so it follows the host (a burst moves it, not one worker's fit);
- per worker a relative time t_w (a multiplier: 2 = twice as slow as the pool's typical
  worker), learned slowly from the ratio of its observations to the pool curve, with the
  geometric mean of the pool's t_w held at 1 so curve and multipliers cannot drift together;
- healing: a worker not observed for `idle_rounds` rounds of its pool (a round: as many pool
  observations as it has workers) has log t_w pulled toward 0, half the way every `heal_rounds`
  rounds, so a stale estimate returns to the pool's and the router sends it work again, which
  measures it afresh. Healing is a probe, not forgetting: when that fresh observation lies
  nearer the estimate the worker had before healing than the healed one, learning resumes from
  the old estimate, so a worker that is still slow is not learned as ever faster between its
  rare observations (a 4x worker used to settle near 2.3x).

A worker's estimate is t_w * (a + b * x). Each fit also tracks its own relative error (an EWMA of
the squared log residual), which the joint policy uses to tell near-ties apart from real gaps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_INF = math.inf


@dataclass(frozen=True)
class LinearCost:
    fixed_ms: float = 0.0
    per_unit_ms: float = 0.0


@dataclass(frozen=True)
class CalibrationConfig:
    """How the cost model learns from observed timings (see the module doc)."""

    pool_memory: float = 10.0  # observations: the pool curve's memory (short: it follows the host)
    speed_rate: float = (
        0.05  # per own observation: how far a worker's log relative time moves toward what it saw
    )
    idle_rounds: float = 16.0  # a worker unobserved for this many rounds of its pool starts to heal
    heal_rounds: float = (
        16.0  # rounds of healing in which a worker's log relative time is halved toward the pool's
    )
    max_relative: float = 16.0  # relative times are held within [1/max_relative, max_relative]
    error_memory: float = 50.0  # observations: the memory of each fit's own error
    resume_after_heal: bool = (
        True  # a probe that finds a healed worker as slow as before restores its estimate
    )
    # joint: candidates within spread_z x the fit's error of the best are near-ties (0: argmin)
    spread_z: float = 1.0
    busy_memory_s: float = (
        20.0  # seconds: memory of each prefill worker's utilisation (router/busy.py)
    )
    # joint ranks prefill workers by booked / (1 - utilisation), utilisation capped here; 0 (the
    # default): by booked work alone. An experiment: it helps in simulation, it hurt p99 live
    # (router/busy.py)
    max_busy: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"calibration {f.name} must be a finite number, got {value!r}")
            if f.name == "spread_z" and value < 0:
                raise ValueError(f"calibration spread_z must be >= 0, got {value!r}")
        for name in ("pool_memory", "error_memory", "heal_rounds", "idle_rounds"):
            if not getattr(self, name) >= 1:
                raise ValueError(
                    f"calibration {name} must be >= 1 (observations / rounds), "
                    f"got {getattr(self, name)!r}"
                )
        if not self.busy_memory_s > 0:
            raise ValueError(
                f"calibration busy_memory_s must be > 0 (seconds), got {self.busy_memory_s!r}"
            )
        if not 0 <= self.max_busy < 1:
            raise ValueError(f"calibration max_busy must be in [0, 1), got {self.max_busy!r}")
        if not 0 < self.speed_rate <= 1:
            raise ValueError(f"calibration speed_rate must be in (0, 1], got {self.speed_rate!r}")
        if not self.max_relative > 1:
            raise ValueError(f"calibration max_relative must be > 1, got {self.max_relative!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationConfig:
        known = {f.name for f in fields(cls)}
        if unknown := set(data) - known:
            raise ValueError(
                f"unknown calibration setting(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        if "busy_memory_s" in data and not data.get("max_busy"):
            raise ValueError(
                "calibration busy_memory_s has no effect while max_busy is 0 (the default): "
                "set max_busy > 0 or drop it"
            )
        return cls(**data)


class OnlineLinear:
    """y ~ a + b*x, exponentially weighted least squares; until the sizes seen vary enough to
    fit a slope, the prior scaled by an EWMA of observed/predicted. a, b stay finite and >= 0.

    `observe` only updates the sufficient statistics (a few multiply-adds); the fit is redone
    lazily, the next time the coefficients are read, so a burst of observations between two
    routing decisions costs one fit. The fit is a pure function of the statistics, so the
    coefficients are exactly those an eager refit after every observation would give."""

    DECAY, RATIO_ALPHA, MIN_WEIGHT, MIN_CV = 0.9, 0.2, 3.0, 0.1

    __slots__ = (
        "prior",
        "_p0",
        "_p1",
        "ratio",
        "sw",
        "sx",
        "sy",
        "sxx",
        "sxy",
        "_coefficients",
        "stale",
        "decay",
    )

    def __init__(self, prior: LinearCost, decay: float | None = None):
        self.prior, self.ratio = prior, 1.0
        self.decay = self.DECAY if decay is None else decay
        self._p0, self._p1 = (
            prior.fixed_ms,
            prior.per_unit_ms,
        )  # the prior's coefficients, for observe()
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self._coefficients = (prior.fixed_ms, prior.per_unit_ms)  # (a, b) as of the last fit
        self.stale = False  # observed since the last fit

    @property
    def a(self) -> float:
        return self.coefficients()[0]

    @property
    def b(self) -> float:
        return self.coefficients()[1]

    def coefficients(self) -> tuple[float, float]:
        """(a, b), refitted first if anything was observed since the last fit."""
        if self.stale:
            self._coefficients = self._fit()
            self.stale = False
        return self._coefficients

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x

    def observe(self, x: float, y: float) -> None:
        if not (0.0 <= x < _INF and 0.0 <= y < _INF):
            return  # a broken timing (NaN, infinite, negative) must not poison the fit
        expected = self._p0 + self._p1 * x
        if expected > 0:
            ratio = y / expected
            ratio = 1e-3 if ratio < 1e-3 else 1e3 if ratio > 1e3 else ratio
            self.ratio += self.RATIO_ALPHA * (ratio - self.ratio)
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self.stale = True

    def _fit(self) -> tuple[float, float]:
        sw = self.sw
        if sw >= self.MIN_WEIGHT:
            mx, my = self.sx / sw, self.sy / sw
            var = self.sxx / sw - mx * mx
            if (
                var > (self.MIN_CV * mx) ** 2 and var > 1e-12
            ):  # else (nearly) one size seen: a slope would be noise
                b = (self.sxy / sw - mx * my) / var
                if b >= 0:
                    a = my - b * mx
                    if a < 0:  # through the origin instead
                        a, b = 0.0, self.sxy / self.sxx
                    if -_INF < a < _INF and -_INF < b < _INF:  # both finite (NaN fails too)
                        return a, b
        return (
            self.ratio * self.prior.fixed_ms,
            self.ratio * self.prior.per_unit_ms,
        )  # the prior, scaled


class RelativeTimes:
    """Per-worker time multipliers of one pool, geometric mean held at 1 (see the module doc).
    O(1) to learn from one observation; the fits rebuild their per-worker lists when next read."""

    def __init__(self, num_workers: int, config: CalibrationConfig):
        self.n, self.config = max(num_workers, 1), config  # n >= 1: the mean of an empty pool is 0
        self.log = [0.0] * num_workers  # log t_w before the mean is taken off
        self.sum = 0.0  # of self.log
        self.last_seen = [
            0
        ] * num_workers  # the pool observation count at each worker's last observation
        self.count = 0  # observations of the pool
        self.version = 0  # bumped on every change, so fits know to refresh their per-worker lists
        self.exp = [1.0] * num_workers  # exp(self.log), kept up to date: t_w = exp[w] * scale()
        self.learned = [0.0] * num_workers  # log t_w right after its last observation
        self.healed = [False] * num_workers  # pulled toward the pool's since its last observation
        self._bound = math.log(config.max_relative)
        self._heal = 0.5 ** (1.0 / config.heal_rounds)
        self._idle = int(config.idle_rounds * len(self.log))  # pool observations

    def log_relative(self, worker: int) -> float:
        """log t_w: the worker's time over the pool's typical worker's, in log."""
        return self.log[worker] - self.sum / self.n

    def scale(self) -> float:
        """exp(-mean of log): what turns exp[w] into t_w."""
        return math.exp(-self.sum / self.n)

    def factors(self) -> list[float]:
        """t_w of every worker."""
        scale = self.scale()
        return [e * scale for e in self.exp]

    def learn(self, worker: int, log_ratio: float) -> None:
        """The worker took exp(log_ratio) x the pool curve's time: move its relative time a little
        toward it."""
        mean = self.sum / self.n
        current = start = self.log[worker] - mean
        if (
            self.config.resume_after_heal
            and self.healed[worker]
            and abs(log_ratio - self.learned[worker]) < abs(log_ratio - current)
        ):
            start = self.learned[worker]  # healing went the wrong way: resume from before it
        moved = start + self.config.speed_rate * (log_ratio - start)
        bound = self._bound
        moved = -bound if moved < -bound else bound if moved > bound else moved
        self.sum += moved + mean - self.log[worker]
        self.log[worker] = moved + mean
        self.exp[worker] = math.exp(moved + mean)
        self.learned[worker], self.healed[worker] = moved, False
        self.count += 1
        self.last_seen[worker] = self.count
        if self.count % self.n == 0:
            self._heal_unseen()
        self.version += 1

    def _heal_unseen(self) -> None:
        """Workers not observed for idle_rounds drift back toward the pool's typical worker."""
        since, mean, heal = self.count - self._idle, self.sum / self.n, self._heal
        for w in range(len(self.log)):
            value = self.log[w] - mean  # re-centred: only differences matter, and they stay small
            if self.last_seen[w] <= since:
                value *= heal
                self.healed[w] = True
            self.log[w] = value
        self.sum = math.fsum(self.log)  # ~0; also clears the rounding the incremental sum gathered
        self.exp = [math.exp(v) for v in self.log]


class PoolFit:
    """One stage (and modality) of a pool: its curve, the pool's relative times, its own error, and
    the per-worker coefficients t_w * a, t_w * b as flat lists for the routing fast path."""

    __slots__ = ("curve", "times", "a", "b", "_synced", "err2", "_err_alpha")

    PRIOR_ERROR = 0.25  # relative error assumed before any observation

    def __init__(self, prior: LinearCost, times: RelativeTimes, config: CalibrationConfig):
        self.curve = OnlineLinear(prior, decay=1.0 - 1.0 / config.pool_memory)
        self.times = times
        self.a = [prior.fixed_ms] * len(times.log)
        self.b = [prior.per_unit_ms] * len(times.log)
        self._synced = -1
        self.err2, self._err_alpha = self.PRIOR_ERROR**2, 1.0 / config.error_memory
        self.sync()

    def observe(self, worker: int, x: float, y: float) -> None:
        if not (0.0 <= x < _INF and 0.0 < y < _INF):
            return  # a broken timing (NaN, infinite, negative, zero) must not poison the fit
        times = self.times
        log_rel = times.log_relative(worker)
        pool = self.curve.predict(
            x
        )  # refitted if stale: a burst between two reads is judged against itself
        if pool > 0.0:
            log_ratio = math.log(y / pool)
            residual = log_ratio - log_rel  # against this worker's estimate: the fit's own error
            self.err2 += self._err_alpha * (residual * residual - self.err2)
            times.learn(worker, log_ratio)
        self.curve.observe(
            x, y * math.exp(-log_rel)
        )  # as the pool's typical worker (t = 1) would have taken

    @property
    def error(self) -> float:
        """The fit's relative error (std of the log residual of its per-worker estimates)."""
        return math.sqrt(self.err2)

    @property
    def stale(self) -> bool:
        return self.curve.stale or self._synced != self.times.version

    def sync(self) -> None:
        a, b = self.curve.coefficients()
        scale, exp = self.times.scale(), self.times.exp
        a, b = a * scale, b * scale
        self.a[:] = [e * a for e in exp]  # t_w * a, in place: callers may hold the lists
        self.b[:] = [e * b for e in exp]
        self._synced = self.times.version
