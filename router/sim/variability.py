"""Service-time variability for the simulator, and its fit from a recorded trace.

The simulated workers are deterministic by default: a service always takes its cost-model
time. Workers that share a host's CPU are not (docs/BENCHMARKS.md, routing on the live cluster:
on a 2-core host prefill ran 0.5-3.4x its calibrated time, slower the more requests were in
flight).
`Variability` gives each service (an encode batch, a prefill, a request's ingress overhead)
a multiplier

    (1 + contention * min(n, max_others)) * H(t) * exp(sigma * Z - sigma**2 / 2),   Z ~ N(0, 1)

where n is the number of other busy requests on the host when the service starts: arrived,
first token not yet out, and not waiting in a prefill worker's queue (a queued request uses
no CPU; counting it let a burst feed on itself until the simulated host collapsed, which the
live one never did). The first factor is host contention (processor sharing, frozen at the
service's start), held beyond the largest n the fit saw. H(t) = exp(X(t) - host_sigma**2 / 2)
is the host's slowness at time t, shared by every service starting then: X is an
Ornstein-Uhlenbeck process (standard deviation host_sigma, correlation time host_tau_s), for
the other jobs on a shared host come and go in bursts that slow everything at once for a
while, which is what builds long queues. The last factor is each service's own noise. Both
random factors have mean 1, so they leave mean service times unchanged. All are off by default.

Instead of the random H(t), `host_profile` may give the host's slowness measured over time
(knots of log H, interpolated): a replayed trace then meets the background load its live run
met, as it meets its arrivals (`fit_measured_host` smooths it out of a trace's residuals).

`fit_service` finds contention and sigma from measured service times (the live cluster's
trace records each request's prefill_ms and prefill_queue_ms, and `busy` counts n from them
and the arrivals and TTFTs): the maximum-likelihood contention of the lognormal model, by a
grid search, and the fixed + per-token cost of the service free of contention, by least squares;
`fit_host` splits the residual's variance into the host's (correlated in time) and the
service's own, from how the residuals of services close in time correlate.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

import numpy as np

_BLOCK = 4096  # normal draws per refill


@dataclass(frozen=True)
class Variability:
    contention: float = 0.0  # extra fraction of service time per other request in flight
    sigma: float = 0.0  # lognormal sigma of encode-batch and prefill times
    ingress_sigma: float = 0.0  # lognormal sigma of the ingress overhead (SimCosts.ingress_ms)
    seed: int = 0
    max_others: int = (
        1 << 30
    )  # contention stops growing here (fits: the most busy requests they saw)
    host_sigma: float = (
        0.0  # lognormal sigma of the host's slowness H(t), common to all services starting at t
    )
    host_tau_s: float = 1.0  # correlation time of log H(t)
    host_profile: tuple[
        tuple[float, float], ...
    ] = ()  # (time_s, log H) knots: a measured H(t) instead
    count_decoding: bool = (
        False  # busy others include requests decoding (their decode steps share the host)
    )

    @property
    def enabled(self) -> bool:
        return (
            self.contention > 0
            or self.sigma > 0
            or self.ingress_sigma > 0
            or self.host_sigma > 0
            or bool(self.host_profile)
        )

    def validate(self) -> None:
        if not self.host_tau_s > 0:
            raise ValueError(f"variability host_tau_s must be > 0, got {self.host_tau_s!r}")
        for name in ("contention", "sigma", "ingress_sigma", "host_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"variability {name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.max_others, int) and self.max_others >= 0):
            raise ValueError(
                f"variability max_others must be an integer >= 0, got {self.max_others!r}"
            )
        if not isinstance(self.count_decoding, bool):
            raise ValueError(
                f"variability count_decoding must be true or false, got {self.count_decoding!r}"
            )


class Multipliers:
    """Draws the multipliers during a run, from a seeded generator in blocks (one numpy call
    per _BLOCK services, not one per service)."""

    def __init__(self, variability: Variability):
        self.contention, self.cap = variability.contention, variability.max_others
        self._rng = np.random.default_rng([variability.seed, 0x5EED])
        self._service = self._stream(variability.sigma)
        self._ingress = self._stream(variability.ingress_sigma)
        self.host_sigma, self.tau_s = variability.host_sigma, variability.host_tau_s
        self._normals = self._stream(1.0, lognormal=False)
        self._x, self._at_s = (
            self.host_sigma * next(self._normals),
            -math.inf,
        )  # X(t), from its stationary law
        self._knots_s = [t for t, _ in variability.host_profile]
        self._log_h = [x for _, x in variability.host_profile]

    def _stream(self, sigma: float, lognormal: bool = True):
        """An endless iterator of mean-1 lognormal factors (all 1.0 when sigma is 0), or of
        N(0, 1) draws."""
        if sigma <= 0:
            while True:
                yield 1.0
        while True:
            z = self._rng.standard_normal(_BLOCK)
            yield from (np.exp(sigma * z - sigma * sigma / 2) if lognormal else z).tolist()

    def host(self, now_s: float) -> float:
        """H(now): the Ornstein-Uhlenbeck state advanced exactly from its last reading (times never
        go back), or the measured profile at `now_s`."""
        if self._knots_s:
            return math.exp(interpolate(self._knots_s, self._log_h, now_s))
        if self.host_sigma <= 0:
            return 1.0
        if now_s > self._at_s:
            keep = math.exp(-(now_s - self._at_s) / self.tau_s) if self._at_s > -math.inf else 0.0
            self._x = self._x * keep + self.host_sigma * math.sqrt(1.0 - keep * keep) * next(
                self._normals
            )
            self._at_s = now_s
        return math.exp(self._x - self.host_sigma * self.host_sigma / 2)

    def service(self, others: int, now_s: float = 0.0) -> float:
        return (
            (1.0 + self.contention * (others if others < self.cap else self.cap))
            * self.host(now_s)
            * next(self._service)
        )

    def ingress(self, others: int, now_s: float = 0.0) -> float:
        return (
            (1.0 + self.contention * (others if others < self.cap else self.cap))
            * self.host(now_s)
            * next(self._ingress)
        )


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), held flat beyond the ends."""
    k = bisect.bisect_right(xs, x)
    if k == 0:
        return ys[0]
    if k == len(xs):
        return ys[-1]
    x0, x1 = xs[k - 1], xs[k]
    return ys[k - 1] + (ys[k] - ys[k - 1]) * (x - x0) / (x1 - x0)


# ----------------------------------------------------------------------------- fitting


def in_flight(arrival_s: np.ndarray, ttft_ms: np.ndarray, at_s: np.ndarray) -> np.ndarray:
    """For each time in `at_s`: requests in flight then (arrival <= t < arrival + TTFT)."""
    arrival_s = np.asarray(arrival_s, dtype=float)
    return covering(arrival_s, arrival_s + np.asarray(ttft_ms, dtype=float) / 1e3, at_s)


def covering(starts: np.ndarray, ends: np.ndarray, at_s: np.ndarray) -> np.ndarray:
    """For each time in `at_s`: how many of the intervals [start, end) hold it."""
    at = np.asarray(at_s, dtype=float)
    return np.searchsorted(np.sort(starts), at, side="right") - np.searchsorted(
        np.sort(ends), at, side="right"
    )


def busy(
    arrival_s: np.ndarray,
    ttft_ms: np.ndarray,
    prefill_ms: np.ndarray,
    prefill_queue_ms: np.ndarray,
    at_s: np.ndarray,
    decode_ms: np.ndarray | None = None,
) -> np.ndarray:
    """For each time in `at_s`: requests in flight then, less those waiting in a prefill queue
    (which ends when the prefill starts, prefill_ms before the first token); with `decode_ms`
    (first token to last), plus the requests decoding then."""
    arrival_s = np.asarray(arrival_s, dtype=float)
    queue_end = (
        arrival_s + (np.asarray(ttft_ms, dtype=float) - np.asarray(prefill_ms, dtype=float)) / 1e3
    )
    waiting = covering(queue_end - np.asarray(prefill_queue_ms, dtype=float) / 1e3, queue_end, at_s)
    n = in_flight(arrival_s, ttft_ms, at_s) - waiting
    if decode_ms is None:
        return n
    first_s = arrival_s + np.asarray(ttft_ms, dtype=float) / 1e3
    return n + covering(first_s, first_s + np.asarray(decode_ms, dtype=float) / 1e3, at_s)


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
    """Least squares y ~ a + b x with a, b >= 0 (through the origin when the intercept comes out
    negative)."""
    if len(x) >= 2 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    if (x * x).sum() > 0:
        b = float((x * y).sum() / (x * x).sum())
        if b > 0:
            return 0.0, b
    return float(np.mean(y)), 0.0


def fit_service(
    x: np.ndarray, measured_ms: np.ndarray, others: np.ndarray, grid: np.ndarray | None = None
) -> ServiceFit:
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
    for c in np.arange(0.0, 2.0001, 0.01) if grid is None else grid:
        factor = 1.0 + c * n
        a, b = linear_fit(x, y / factor)
        resid = np.log(y / (factor * np.maximum(a + b * x, 1e-9)))
        if best is None or resid.var() < best[0] - 1e-12:
            best = (resid.var(), float(c), a, b)
    var, c, a, b = best
    return ServiceFit(a, b, c, float(math.sqrt(var)), int(len(y)))


def fit_host(
    times_s: np.ndarray, log_resid: np.ndarray, max_lag_s: float = 5.0
) -> tuple[float, float]:
    """(share, tau_s): the share of the residuals' variance that is the host's, and its correlation
    time, such that residuals dt apart correlate by share * exp(-dt / tau) (least squares over all
    pairs less than max_lag_s apart; the rest of the variance is each service's own)."""
    order = np.argsort(times_s)
    t, r = np.asarray(times_s, dtype=float)[order], np.asarray(log_resid, dtype=float)[order]
    r = (r - r.mean()) / (r.std() or 1.0)
    lags, products = [], []
    for i in range(len(t) - 1):
        j = i + 1 + np.searchsorted(t[i + 1 :], t[i] + max_lag_s)
        lags.append(t[i + 1 : j] - t[i])
        products.append(r[i] * r[i + 1 : j])
    if not lags or not sum(len(x) for x in lags):
        return 0.0, 1.0
    lag, prod = np.concatenate(lags), np.concatenate(products)
    best = (np.inf, 0.0, 1.0)
    for tau in np.geomspace(0.02, 10.0, 60):
        e = np.exp(-lag / tau)
        share = float(np.clip((prod * e).sum() / (e * e).sum(), 0.0, 1.0))
        sse = float(((prod - share * e) ** 2).sum())
        if sse < best[0]:
            best = (sse, share, float(tau))
    return best[1], best[2]


BANDWIDTHS_S = (0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 4.0)


@dataclass(frozen=True)
class MeasuredHost:
    """The host's slowness over a run, as measured, and what is left around it: `prefill` has the
    contention and costs fitted jointly with it, and sigma is each service's own noise."""

    prefill: ServiceFit
    profile: tuple[tuple[float, float], ...]  # (time_s, log H) knots
    ingress_ms: float = 0.0
    ingress_media_ms: float = 0.0
    ingress_sigma: float = 0.0


def fit_measured_host(
    x: np.ndarray, y: np.ndarray, n: np.ndarray, t: np.ndarray, step_s: float = 0.1
) -> MeasuredHost:
    """Fit y ~ base(x) * (1 + c n) * H(t) * noise with log H a Gaussian-kernel average of the log
    residuals around t: for each c, the bandwidth of least leave-one-out error; the c of least such
    error wins (contention and background slowness fitted together, so neither absorbs the
    other)."""
    x, y, n, t = (np.asarray(v, dtype=float) for v in (x, y, n, t))
    kernels = []
    for bandwidth in BANDWIDTHS_S:
        w = np.exp(-0.5 * ((t[:, None] - t[None, :]) / bandwidth) ** 2)
        np.fill_diagonal(w, 0.0)
        kernels.append((bandwidth, w / np.maximum(w.sum(axis=1, keepdims=True), 1e-12)))
    best = None
    for c in np.arange(0.0, 2.0001, 0.02):
        factor = 1.0 + c * n
        a, b = linear_fit(x, y / factor)
        r = np.log(y / (factor * np.maximum(a + b * x, 1e-9)))
        for bandwidth, w in kernels:
            err = float(((r - w @ r) ** 2).mean())
            if best is None or err < best[0] - 1e-12:
                best = (err, float(c), a, b, bandwidth, r)
    _, c, a, b, bandwidth, r = best
    grid = np.arange(t.min(), t.max() + step_s, step_s)
    w = np.exp(-0.5 * ((grid[:, None] - t[None, :]) / bandwidth) ** 2)
    profile = (w @ r) / np.maximum(w.sum(axis=1), 1e-12)
    sigma = float((r - np.interp(t, grid, profile)).std())
    profile = (
        profile + sigma * sigma / 2
    )  # the simulator's noise has mean 1, so a log mean of -sigma**2 / 2
    return MeasuredHost(
        ServiceFit(a, b, c, sigma, len(y)),
        tuple(zip(grid.round(4).tolist(), profile.round(5).tolist())),
    )


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
    speeds: dict[
        int, float
    ]  # prefill worker -> speed relative to the reference (3 requests at least)
    ingress_ms: float  # a text request's overhead, free of contention
    ingress_media_ms: float  # what media adds to it
    ingress_sigma: float
    max_others: int  # the most other busy requests a fitted service saw
    host_share: float = (
        0.0  # of the prefill residual's variance, what the host's slowness H(t) explains
    )
    host_tau_s: float = 1.0
    measured: MeasuredHost | None = (
        None  # the host's slowness as measured over the run (fit_measured_host)
    )
    count_decoding: bool = False  # the trace had decode_ms: decoding requests counted as busy

    def variability(self, seed: int = 0, measured_host: bool = False) -> Variability:
        """The fitted variability: the host's share of each service's variance moves to a random
        H(t), or with `measured_host` to H(t) as measured in the trace."""
        if measured_host:
            m = self.measured
            return Variability(
                m.prefill.contention,
                m.prefill.sigma,
                m.ingress_sigma,
                seed,
                self.max_others,
                host_profile=m.profile,
                count_decoding=self.count_decoding,
            )
        host_var = self.host_share * self.prefill.sigma**2
        return Variability(
            self.prefill.contention,
            own_sigma(self.prefill.sigma, host_var),
            own_sigma(self.ingress_sigma, host_var),
            seed,
            self.max_others,
            math.sqrt(host_var),
            self.host_tau_s,
            count_decoding=self.count_decoding,
        )


def own_sigma(sigma: float, host_var: float) -> float:
    """What is left of a lognormal sigma once the host's variance is taken out."""
    return math.sqrt(max(sigma * sigma - host_var, 0.0))


TIMINGS = ("arrival_s", "ttft_ms", "prefill_ms", "prefill_queue_ms", "encode_ms")


def fit_trace(
    records: list[dict], reference: int | None = None, grid: np.ndarray | None = None
) -> TraceFit:
    """Fit a trace recorded on the live cluster (router/sim/trace_file.py has the format; records
    without the measured timings are left out). `reference`: the prefill worker whose services
    give the cost curve and the host's slowness, the others' speeds relative to it; by default
    the one that served most requests (a worker the router avoided has a few warm-up requests,
    too few to measure a host by). `grid`: the contentions to try (fit_service's default; [0.0]
    fits no contention). Where every record has decode_ms, requests decoding count as busy too
    (on a shared host a decode step takes CPU from the prefill beside it)."""
    timed = [r for r in records if all(k in r for k in TIMINGS)]
    if len(timed) < 3:
        raise ValueError(
            f"the trace has {len(timed)} records with measured timings; fitting needs 3 or more"
        )
    col = {k: np.array([r[k] for r in timed], dtype=float) for k in TIMINGS}
    # A request's service is its own device time where the trace has it: its prefill_ms (first
    # chunk to first token) also holds the chunks of requests sharing its worker's steps.
    service = np.array([r.get("prefill_compute_ms") or r["prefill_ms"] for r in timed], dtype=float)
    tokens = np.array([r["num_prompt_tokens"] for r in timed], dtype=float)
    worker = np.array([r["route"][1] for r in timed])
    media = np.array([bool(r["items"]) for r in timed])
    decode_ms = (
        np.array([r["decode_ms"] for r in timed], dtype=float)
        if all("decode_ms" in r for r in timed)
        else None
    )

    def others(
        at_s: np.ndarray,
    ) -> np.ndarray:  # other busy requests at each time (of one request's own)
        return (
            busy(
                col["arrival_s"],
                col["ttft_ms"],
                col["prefill_ms"],
                col["prefill_queue_ms"],
                at_s,
                decode_ms,
            )
            - 1
        )

    at_prefill = others(
        col["arrival_s"] + (col["ttft_ms"] - col["prefill_ms"]) / 1e3
    )  # it ends with the first token
    if reference is None:  # the busiest worker; ties to the lowest index
        served = np.bincount(worker)
        reference = int(served.argmax())
    ref = worker == reference
    fit = fit_service(tokens[ref], service[ref], at_prefill[ref], grid)
    speeds = {}
    for w in sorted(set(worker.tolist()) - {reference}):
        mine = worker == w
        if mine.sum() >= 3:
            expected = fit.base_ms(tokens[mine]) * (1 + fit.contention * at_prefill[mine])
            speeds[int(w)] = float(expected.sum() / service[mine].sum())
    overhead = col["ttft_ms"] - col["encode_ms"] - col["prefill_queue_ms"] - col["prefill_ms"]
    at_arrival = others(col["arrival_s"])
    ingress = fit_ingress(overhead, media, 1 + fit.contention * at_arrival)
    start = col["arrival_s"][ref] + (col["ttft_ms"][ref] - col["prefill_ms"][ref]) / 1e3
    resid = np.log(
        service[ref] / (fit.base_ms(tokens[ref]) * (1 + fit.contention * at_prefill[ref]))
    )
    share, tau = fit_host(start, resid) if fit.sigma > 0 else (0.0, 1.0)
    measured = fit_measured_host(tokens[ref], service[ref], at_prefill[ref], start)
    knots = [t for t, _ in measured.profile], [v for _, v in measured.profile]
    host = np.exp([interpolate(*knots, t) for t in col["arrival_s"]])
    measured = replace(
        measured,
        **dict(
            zip(
                ("ingress_ms", "ingress_media_ms", "ingress_sigma"),
                fit_ingress(overhead, media, (1 + measured.prefill.contention * at_arrival) * host),
            )
        ),
    )
    return TraceFit(
        fit,
        reference,
        speeds,
        *ingress,
        int(at_prefill.max()),
        share,
        tau,
        measured,
        decode_ms is not None,
    )


def fit_ingress(
    overhead_ms: np.ndarray, media: np.ndarray, factor: np.ndarray
) -> tuple[float, float, float]:
    """(text ms, what media adds, sigma) of the ingress overhead with the slowdown `factor` taken
    out."""
    free = overhead_ms / factor
    text = float(free[~media].mean()) if (~media).any() else 0.0
    extra = float(free[media].mean()) - text if media.any() else 0.0
    base = np.where(media, text + extra, text)
    return max(text, 0.0), max(extra, 0.0), lognormal_sigma(free / np.maximum(base, 1e-9))
