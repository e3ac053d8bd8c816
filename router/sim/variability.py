"""Service-time variability for the simulator, and its fit from a recorded trace.

The simulated workers are deterministic by default: a service always takes its cost-model
time. Workers that share a host's CPU are not (docs/BENCHMARKS.md, issue #4: on a 2-core
host prefill ran 0.5-3.4x its calibrated time, slower the more requests were in flight).
`Variability` gives each service (an encode batch, a prefill, a request's ingress overhead)
a multiplier

    (1 + contention * min(n, max_others)) * exp(sigma * Z - sigma**2 / 2),   Z ~ N(0, 1)

where n is the number of other busy requests on the host when the service starts: arrived,
first token not yet out, and not waiting in a prefill worker's queue (a queued request uses
no CPU; counting it let a burst feed on itself until the simulated host collapsed, which the
live one never did). The first factor is host contention (processor sharing, frozen at the
service's start), held beyond the largest n the fit saw; the second is per-service noise with
mean 1, so noise alone leaves mean service times unchanged. Both are off by default.

`fit_service` finds contention and sigma from measured service times (the live cluster's
trace records each request's prefill_ms and prefill_queue_ms, and `busy` counts n from them
and the arrivals and TTFTs): the maximum-likelihood contention of the lognormal model, by a
grid search, and the fixed + per-token cost of the service free of contention, by least squares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_BLOCK = 4096  # normal draws per refill


@dataclass(frozen=True)
class Variability:
    contention: float = 0.0  # extra fraction of service time per other request in flight
    sigma: float = 0.0  # lognormal sigma of encode-batch and prefill times
    ingress_sigma: float = 0.0  # lognormal sigma of the ingress overhead (SimCosts.ingress_ms)
    seed: int = 0
    max_others: int = 1 << 30  # contention stops growing here (fits: the most busy requests they saw)

    @property
    def enabled(self) -> bool:
        return self.contention > 0 or self.sigma > 0 or self.ingress_sigma > 0

    def validate(self) -> None:
        for name in ("contention", "sigma", "ingress_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"variability {name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.max_others, int) and self.max_others >= 0):
            raise ValueError(f"variability max_others must be an integer >= 0, got {self.max_others!r}")


class Multipliers:
    """Draws the multipliers during a run, from a seeded generator in blocks (one numpy call
    per _BLOCK services, not one per service)."""

    def __init__(self, variability: Variability):
        self.contention, self.cap = variability.contention, variability.max_others
        self._rng = np.random.default_rng([variability.seed, 0x5EED])
        self._service = self._stream(variability.sigma)
        self._ingress = self._stream(variability.ingress_sigma)

    def _stream(self, sigma: float):
        """An endless iterator of mean-1 lognormal factors (all 1.0 when sigma is 0)."""
        if sigma <= 0:
            while True:
                yield 1.0
        while True:
            yield from np.exp(sigma * self._rng.standard_normal(_BLOCK) - sigma * sigma / 2).tolist()

    def service(self, others: int) -> float:
        return (1.0 + self.contention * (others if others < self.cap else self.cap)) * next(self._service)

    def ingress(self, others: int) -> float:
        return (1.0 + self.contention * (others if others < self.cap else self.cap)) * next(self._ingress)


# ----------------------------------------------------------------------------- fitting


def in_flight(arrival_s: np.ndarray, ttft_ms: np.ndarray, at_s: np.ndarray) -> np.ndarray:
    """For each time in `at_s`: requests in flight then (arrival <= t < arrival + TTFT)."""
    arrival_s = np.asarray(arrival_s, dtype=float)
    return covering(arrival_s, arrival_s + np.asarray(ttft_ms, dtype=float) / 1e3, at_s)


def covering(starts: np.ndarray, ends: np.ndarray, at_s: np.ndarray) -> np.ndarray:
    """For each time in `at_s`: how many of the intervals [start, end) hold it."""
    at = np.asarray(at_s, dtype=float)
    return np.searchsorted(np.sort(starts), at, side="right") - np.searchsorted(np.sort(ends), at, side="right")


def busy(arrival_s: np.ndarray, ttft_ms: np.ndarray, prefill_ms: np.ndarray, prefill_queue_ms: np.ndarray,
         at_s: np.ndarray) -> np.ndarray:
    """For each time in `at_s`: requests in flight then, less those waiting in a prefill queue
    (which ends when the prefill starts, prefill_ms before the first token)."""
    arrival_s = np.asarray(arrival_s, dtype=float)
    queue_end = arrival_s + (np.asarray(ttft_ms, dtype=float) - np.asarray(prefill_ms, dtype=float)) / 1e3
    waiting = covering(queue_end - np.asarray(prefill_queue_ms, dtype=float) / 1e3, queue_end, at_s)
    return in_flight(arrival_s, ttft_ms, at_s) - waiting


@dataclass(frozen=True)
class ServiceFit:
    """measured_ms ~ (fixed_ms + per_unit_ms * x) * (1 + contention * n) * lognormal(sigma)."""

    fixed_ms: float
    per_unit_ms: float
    contention: float
    sigma: float
    samples: int

    def base_ms(self, x: np.ndarray | float) -> np.ndarray | float:
        return self.fixed_ms + self.per_unit_ms * x


def linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y ~ a + b x with a, b >= 0 (through the origin when the intercept comes out negative)."""
    if len(x) >= 2 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    if (x * x).sum() > 0:
        b = float((x * y).sum() / (x * x).sum())
        if b > 0:
            return 0.0, b
    return float(np.mean(y)), 0.0


def fit_service(x: np.ndarray, measured_ms: np.ndarray, others: np.ndarray,
                grid: np.ndarray | None = None) -> ServiceFit:
    """Fit measured service times of one worker (x: the cost unit, e.g. prompt tokens; others:
    requests in flight besides this one when its service started). For each contention c on
    the grid, the service free of contention (measured / (1 + c n)) is fitted linearly in x,
    and the c of least variance of the log residual wins (the lognormal model's likelihood)."""
    x, y, n = (np.asarray(v, dtype=float) for v in (x, measured_ms, others))
    keep = (y > 0) & np.isfinite(y)
    x, y, n = x[keep], y[keep], n[keep]
    if len(y) < 3:
        raise ValueError(f"need at least 3 positive service times to fit variability, got {len(y)}")
    best = None
    for c in (np.arange(0.0, 2.0001, 0.01) if grid is None else grid):
        factor = 1.0 + c * n
        a, b = linear_fit(x, y / factor)
        resid = np.log(y / (factor * np.maximum(a + b * x, 1e-9)))
        if best is None or resid.var() < best[0] - 1e-12:
            best = (resid.var(), float(c), a, b)
    var, c, a, b = best
    return ServiceFit(a, b, c, float(math.sqrt(var)), int(len(y)))


def lognormal_sigma(ratio: np.ndarray) -> float:
    """sigma of the log of positive ratios (measured / modelled); 0 without two of them."""
    r = np.asarray(ratio, dtype=float)
    r = r[(r > 0) & np.isfinite(r)]
    return float(np.log(r).std()) if len(r) >= 2 else 0.0


@dataclass(frozen=True)
class TraceFit:
    """What a live trace (records with ttft_ms, prefill_ms, prefill_queue_ms, encode_ms and
    route) says about its host: the reference prefill worker's cost free of contention,
    each other prefill worker's speed relative to it, host contention and noise, and the
    ingress overhead (TTFT less the measured encode, prefill queue and prefill)."""

    prefill: ServiceFit  # of `reference`: per_unit_ms is per prompt token
    reference: int
    speeds: dict[int, float]  # prefill worker -> speed relative to the reference (3 requests at least)
    ingress_ms: float  # a text request's overhead, free of contention
    ingress_media_ms: float  # what media adds to it
    ingress_sigma: float
    max_others: int  # the most other busy requests a fitted service saw

    def variability(self, seed: int = 0) -> Variability:
        return Variability(self.prefill.contention, self.prefill.sigma, self.ingress_sigma, seed, self.max_others)


TIMINGS = ("arrival_s", "ttft_ms", "prefill_ms", "prefill_queue_ms", "encode_ms")


def fit_trace(records: list[dict], reference: int = 0, grid: np.ndarray | None = None) -> TraceFit:
    """Fit a trace recorded on the live cluster (router/sim/workload.py has the format; records
    without the measured timings are left out). `grid`: the contentions to try (fit_service's
    default; [0.0] fits no contention)."""
    timed = [r for r in records if all(k in r for k in TIMINGS)]
    if len(timed) < 3:
        raise ValueError(f"the trace has {len(timed)} records with measured timings; fitting needs 3 or more")
    col = {k: np.array([r[k] for r in timed], dtype=float) for k in TIMINGS}
    tokens = np.array([r["num_prompt_tokens"] for r in timed], dtype=float)
    worker = np.array([r["route"][1] for r in timed])
    media = np.array([bool(r["items"]) for r in timed])

    def others(at_s: np.ndarray) -> np.ndarray:  # other busy requests at each time (of one request's own)
        return busy(col["arrival_s"], col["ttft_ms"], col["prefill_ms"], col["prefill_queue_ms"], at_s) - 1

    at_prefill = others(col["arrival_s"] + (col["ttft_ms"] - col["prefill_ms"]) / 1e3)  # it ends with the first token
    ref = worker == reference
    fit = fit_service(tokens[ref], col["prefill_ms"][ref], at_prefill[ref], grid)
    speeds = {}
    for w in sorted(set(worker.tolist()) - {reference}):
        mine = worker == w
        if mine.sum() >= 3:
            expected = fit.base_ms(tokens[mine]) * (1 + fit.contention * at_prefill[mine])
            speeds[int(w)] = float(expected.sum() / col["prefill_ms"][mine].sum())
    resid = col["ttft_ms"] - col["encode_ms"] - col["prefill_queue_ms"] - col["prefill_ms"]
    free = resid / (1 + fit.contention * others(col["arrival_s"]))
    text = float(free[~media].mean()) if (~media).any() else 0.0
    extra = float(free[media].mean()) - text if media.any() else 0.0
    base = np.where(media, text + extra, text)
    return TraceFit(fit, reference, speeds, max(text, 0.0), max(extra, 0.0), lognormal_sigma(free / np.maximum(base, 1e-9)),
                    int(at_prefill.max()))
