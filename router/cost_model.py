"""TTFT cost model: priors from config, calibrated online per worker from observed timings.

Estimated TTFT of a request on (encoder e, prefill p) =
    queue of e (only if some item misses e's cache: hits skip the encoder's queue)
  + encode time on e of the items e does not hold
  + transfer of all embeddings over the e->p placement
  + queue of p (its booked work, less what the job it is serving has done: prefill_queue_ms)
  + prefill of the prompt tokens p's prefix cache does not cover.

Every linear term is `fixed_ms + per_unit_ms * x` with an `OnlineLinear` fit per worker
(per modality for encoders, per placement for transfers): O(1) to observe, O(1) to read.
The routing fast path reads the fits' coefficients from flat per-worker lists (prefill_a,
encode lists per modality, ...), brought up to date by _sync() before each read.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from router.types import MediaJob, Placement, RequestProfile, TTFTEstimate, WorkerKind
from router.view import ClusterView, bits, unique_items

_E, _P = WorkerKind.ENCODER, WorkerKind.PREFILL
_INF = math.inf
_TIERS = (Placement.SAME_PROCESS, Placement.SAME_NODE, Placement.CROSS_NODE)  # closest first
_TIER_INDEX = {placement: i for i, placement in enumerate(_TIERS)}


@dataclass(frozen=True)
class LinearCost:
    fixed_ms: float = 0.0
    per_unit_ms: float = 0.0


# Seed table (ViT-L/14, Whisper-small): a 0.113 MP image ~5 ms, 30 video frames ~48 ms, 30 s audio ~85 ms.
DEFAULT_ENCODE = {"image": LinearCost(1.0, 35.0), "video": LinearCost(3.0, 1.5), "audio": LinearCost(1.0, 2.8)}
DEFAULT_BANDWIDTH_GBPS = {Placement.SAME_PROCESS: 2000.0, Placement.SAME_NODE: 600.0, Placement.CROSS_NODE: 50.0}


@dataclass(frozen=True)
class CostPriors:
    """Starting estimates before any observation; sizes in megapixels / frames / seconds."""

    encode: Mapping[str, LinearCost] = field(default_factory=lambda: dict(DEFAULT_ENCODE))
    unknown_modality: LinearCost = LinearCost(5.0, 0.0)
    prefill_tokens_per_ms: float = 20.0
    prefill_fixed_ms: float = 2.0
    bandwidth_gbps: Mapping[Placement, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH_GBPS))
    decode_step_ms: float = 8.0  # one decode step with an empty batch
    decode_per_seq_ms: float = 0.05  # what each running sequence adds to a step

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostPriors:
        """From config: any subset of the fields; `encode` and `bandwidth_gbps` merge over the defaults."""
        known = {"encode", "prefill_tokens_per_ms", "prefill_fixed_ms", "bandwidth_gbps", "decode_step_ms", "decode_per_seq_ms"}
        if unknown := set(data) - known:
            raise ValueError(f"unknown cost prior(s) {sorted(unknown)}; known: {sorted(known)}")
        encode = dict(DEFAULT_ENCODE)
        for modality, spec in dict(data.get("encode", {})).items():
            encode[modality] = LinearCost(_non_negative(f"encode.{modality}.fixed_ms", spec.get("fixed_ms", 0.0)),
                                          _non_negative(f"encode.{modality}.per_unit_ms", spec.get("per_unit_ms", 0.0)))
        bandwidth = dict(DEFAULT_BANDWIDTH_GBPS)
        for name, gbps in dict(data.get("bandwidth_gbps", {})).items():
            bandwidth[Placement(name)] = _positive(f"bandwidth_gbps.{name}", gbps)
        scalars = {k: _non_negative(k, data[k]) for k in ("prefill_fixed_ms", "decode_step_ms", "decode_per_seq_ms") if k in data}
        if "prefill_tokens_per_ms" in data:
            scalars["prefill_tokens_per_ms"] = _positive("prefill_tokens_per_ms", data["prefill_tokens_per_ms"])
        return cls(encode=encode, bandwidth_gbps=bandwidth, **scalars)


def _non_negative(name: str, value: Any) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost prior {name} must be a finite number >= 0, got {value}")
    return value


def _positive(name: str, value: Any) -> float:
    if _non_negative(name, value) == 0:
        raise ValueError(f"cost prior {name} must be > 0")
    return float(value)


class OnlineLinear:
    """y ~ a + b*x, exponentially weighted least squares; until the sizes seen vary enough to
    fit a slope, the prior scaled by an EWMA of observed/predicted. a, b stay finite and >= 0.

    `observe` only updates the sufficient statistics (a few multiply-adds); the fit is redone
    lazily, the next time the coefficients are read, so a burst of observations between two
    routing decisions costs one fit. The fit is a pure function of the statistics, so the
    coefficients are exactly those an eager refit after every observation would give."""

    DECAY, RATIO_ALPHA, MIN_WEIGHT, MIN_CV = 0.9, 0.2, 3.0, 0.1

    __slots__ = ("prior", "_p0", "_p1", "ratio", "sw", "sx", "sy", "sxx", "sxy", "_coefficients", "stale")

    def __init__(self, prior: LinearCost):
        self.prior, self.ratio = prior, 1.0
        self._p0, self._p1 = prior.fixed_ms, prior.per_unit_ms  # the prior's coefficients, for observe()
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
        d = self.DECAY
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self.stale = True

    def _fit(self) -> tuple[float, float]:
        sw = self.sw
        if sw >= self.MIN_WEIGHT:
            mx, my = self.sx / sw, self.sy / sw
            var = self.sxx / sw - mx * mx
            if var > (self.MIN_CV * mx) ** 2 and var > 1e-12:  # else (nearly) one size seen: a slope would be noise
                b = (self.sxy / sw - mx * my) / var
                if b >= 0:
                    a = my - b * mx
                    if a < 0:  # through the origin instead
                        a, b = 0.0, self.sxy / self.sxx
                    if -_INF < a < _INF and -_INF < b < _INF:  # both finite (NaN fails too)
                        return a, b
        return self.ratio * self.prior.fixed_ms, self.ratio * self.prior.per_unit_ms  # the prior, scaled


class CostModel:
    def __init__(self, priors: CostPriors | None = None, *, num_encoders: int = 0, num_prefill: int = 0):
        self.priors = priors or CostPriors()
        self.num_encoders = num_encoders
        # per modality: the fits per encoder, and their coefficients as flat lists for the fast path
        self._encode: dict[str, tuple[list[OnlineLinear], list[float], list[float]]] = {}
        for modality in self.priors.encode:
            self._modality(modality)
        prefill_prior = LinearCost(self.priors.prefill_fixed_ms, 1.0 / self.priors.prefill_tokens_per_ms)
        self._prefill = [OnlineLinear(prefill_prior) for _ in range(num_prefill)]
        self.prefill_a = [f.a for f in self._prefill]
        self.prefill_b = [f.b for f in self._prefill]
        self._transfer = {pl: OnlineLinear(LinearCost(0.0, 1.0 / (gbps * 1e6))) for pl, gbps in self.priors.bandwidth_gbps.items()}
        if missing := [pl.value for pl in _TIERS if pl not in self._transfer]:
            raise ValueError(f"cost priors lack bandwidth_gbps for {missing}")
        # the three transfer fits' coefficients, in _TIERS order, for transfer_tiers()
        self._transfer_a = [self._transfer[pl].a for pl in _TIERS]
        self._transfer_b = [self._transfer[pl].b for pl in _TIERS]
        # Fits observed since their flat coefficients were last copied: (fit, a list, b list, index).
        # Copied (refitting each once) before the next read, so observing stays a few multiply-adds.
        self._pending: list[tuple[OnlineLinear, list[float], list[float], int]] = []

    @classmethod
    def for_view(cls, priors: CostPriors | None, view: ClusterView) -> CostModel:
        return cls(priors, num_encoders=len(view.workers[_E]), num_prefill=len(view.workers[_P]))

    def _modality(self, modality: str) -> tuple[list[OnlineLinear], list[float], list[float]]:
        found = self._encode.get(modality)
        if found is None:
            prior = self.priors.encode.get(modality, self.priors.unknown_modality)
            fits = [OnlineLinear(prior) for _ in range(self.num_encoders)]
            found = self._encode[modality] = (fits, [f.a for f in fits], [f.b for f in fits])
        return found

    def _sync(self) -> None:
        """Bring the flat coefficient lists up to date with the fits observed since the last read."""
        for fit, a, b, index in self._pending:
            if fit.stale:  # fit.coefficients(), inlined
                fit._coefficients, fit.stale = fit._fit(), False
            a[index], b[index] = fit._coefficients
        self._pending.clear()

    # -- single terms --------------------------------------------------------------------------
    def encode_ms(self, encoder: int, modality: str, size: float) -> float:
        if self._pending:
            self._sync()
        _, a, b = self._modality(modality)
        return a[encoder] + b[encoder] * size

    def encode_sum_ms(self, encoder: int, items: tuple[MediaJob, ...] | list[MediaJob]) -> float:
        """Encode ms of `items` on `encoder`, one at a time (what the pair estimate counts)."""
        if self._pending:
            self._sync()
        return self._encode_sum(encoder, items)

    def cheapest_encode_ms(self, items: tuple[MediaJob, ...], encoders: list[int]) -> float:
        """Least encode ms of `items` over `encoders`, one at a time, queues and caches aside."""
        if self._pending:
            self._sync()
        totals: dict[str, list[float]] = {}  # modality -> [count, total size]
        for item in items:
            entry = totals.setdefault(item.modality, [0, 0.0])
            entry[0] += 1
            entry[1] += item.size
        costs = [0.0] * len(encoders)
        for modality, (count, size) in totals.items():
            _, a, b = self._modality(modality)
            costs = [c + count * a[e] + size * b[e] for c, e in zip(costs, encoders)]
        return min(costs)

    def _encode_sum(self, encoder: int, items: tuple[MediaJob, ...] | list[MediaJob]) -> float:
        """Encode ms of `items` on `encoder`, one at a time, summed in order (coefficients synced).
        The pair estimate and the joint policy's per-encoder costs both use this, so they agree."""
        total = 0.0
        for item in items:
            _, a, b = self._modality(item.modality)
            total += a[encoder] + b[encoder] * item.size
        return total

    def prefill_ms(self, prefill: int, uncached_tokens: int) -> float:
        if self._pending:
            self._sync()
        return self.prefill_a[prefill] + self.prefill_b[prefill] * uncached_tokens

    def transfers(self, num_bytes: int) -> dict[Placement, float]:
        """Transfer ms per placement, made monotone (closer is never slower) so the joint
        policy may price a pair by its best-case placement."""
        proc, node, cross = self.transfer_tiers(num_bytes)
        return {Placement.SAME_PROCESS: proc, Placement.SAME_NODE: node, Placement.CROSS_NODE: cross}

    def transfer_tiers(self, num_bytes: int) -> tuple[float, float, float]:
        """(same process, same node, cross node) transfer ms, non-decreasing."""
        if self._pending:
            self._sync()
        a, b = self._transfer_a, self._transfer_b
        cross = a[2] + b[2] * num_bytes
        node = a[1] + b[1] * num_bytes
        node = cross if cross < node else node  # min(node, cross)
        proc = a[0] + b[0] * num_bytes
        return (node if node < proc else proc), node, cross  # min(proc, node)

    def transfer_ms(self, placement: Placement, num_bytes: int) -> float:
        proc, node, cross = self.transfer_tiers(num_bytes)
        return cross if placement is Placement.CROSS_NODE else node if placement is Placement.SAME_NODE else proc

    def decode_step_ms(self, running: int) -> float:
        return self.priors.decode_step_ms + self.priors.decode_per_seq_ms * running

    # -- calibration -----------------------------------------------------------------------------
    # Each queues its fit for _sync() unless it is queued already (stale); a rejected observation
    # leaves the fit as it was, and syncing it then copies what was there.
    def observe_encode(self, encoder: int, modality: str, size: float, duration_ms: float) -> None:
        fits, a, b = self._modality(modality)
        fit = fits[encoder]
        if not fit.stale:
            self._pending.append((fit, a, b, encoder))
        fit.observe(size, duration_ms)

    def observe_prefill(self, prefill: int, uncached_tokens: int, duration_ms: float) -> None:
        fit = self._prefill[prefill]
        if not fit.stale:
            self._pending.append((fit, self.prefill_a, self.prefill_b, prefill))
        fit.observe(uncached_tokens, duration_ms)

    def observe_transfer(self, placement: Placement, num_bytes: int, duration_ms: float) -> None:
        fit = self._transfer[placement]
        if not fit.stale:
            self._pending.append((fit, self._transfer_a, self._transfer_b, _TIER_INDEX[placement]))
        fit.observe(num_bytes, duration_ms)

    # -- one (encoder, prefill) pair: what every policy reports ---------------------------------------
    def evaluate(self, profile: RequestProfile, view: ClusterView, encoder: int | None, prefill: int) -> tuple[TTFTEstimate, tuple[MediaJob, ...], int]:
        """The estimate for one pair, the items expected to miss the encoder cache, the uncached tokens."""
        if encoder is None:
            return self.pair_estimate(profile, view, None, prefill, (), [], (0.0, 0.0, 0.0))
        items = unique_items(profile.items)
        tiers = self.transfer_tiers(embedding_bytes(profile.items))
        return self.pair_estimate(profile, view, encoder, prefill, items, view.item_holders(items), tiers)

    def pair_estimate(self, profile: RequestProfile, view: ClusterView, encoder: int | None, prefill: int,
                      items: tuple[MediaJob, ...], holders: list[int], tiers: tuple[float, float, float]) -> tuple[TTFTEstimate, tuple[MediaJob, ...], int]:
        """evaluate(), given what depends on the request only and the joint policy has already worked
        out: the unique items, their holder bitmasks (view.item_holders) and the transfer tiers."""
        if self._pending:
            self._sync()
        uncached = profile.num_prompt_tokens  # what uncached_tokens() gives, without the call
        if profile.prefix_hashes:
            uncached -= view.prefix_blocks(prefill, profile.prefix_hashes) * profile.block_size
        if uncached < 0:
            uncached = 0
        prefill_queue = self.prefill_queue_ms(view, prefill)
        prefill_ms = self.prefill_a[prefill] + self.prefill_b[prefill] * uncached
        if encoder is None:
            return TTFTEstimate.of(0.0, 0.0, 0.0, prefill_queue, prefill_ms), (), uncached
        if len(items) == 1:  # the usual case, without the comprehension and the loop
            if holders[0] >> encoder & 1:
                misses, encode = (), 0.0
            else:
                item = items[0]
                _, a, b = self._modality(item.modality)
                misses, encode = items, 0.0 + (a[encoder] + b[encoder] * item.size)  # _encode_sum(encoder, items)
        else:
            misses = tuple([item for item, held in zip(items, holders) if not held >> encoder & 1])
            encode = self._encode_sum(encoder, misses)
        queue = view.outstanding_ms[_E][encoder] if misses else 0.0
        t_proc, t_node, t_cross = tiers
        if encoder in view.colocated[prefill]:
            transfer = t_proc
        else:
            transfer = t_node if view.node_ids[_E][encoder] == view.node_ids[_P][prefill] else t_cross
        return TTFTEstimate.of(queue, encode, transfer, prefill_queue, prefill_ms), misses, uncached

    # A prefill worker's booked ms include the whole of the job it is serving, which has on average
    # done half its work when the next request looks: counting all of it made the estimates ~15 ms
    # high at 80% load. So the time since that job started (at most its booked ms) comes off.
    @staticmethod
    def prefill_queue_ms(view: ClusterView, prefill: int) -> float:
        """Estimated ms of booked work ahead of a request reaching `prefill` now."""
        queued, elapsed = view.outstanding_ms[_P][prefill], view.now_s * 1e3 - view.service_started_ms[prefill]
        if elapsed > 0.0:
            done = view.service_ms[prefill]
            queued -= done if done < elapsed else elapsed
        return queued if queued > 0.0 else 0.0  # never below 0 while service_ms <= outstanding_ms (see ClusterView)

    @staticmethod
    def uncached_tokens(profile: RequestProfile, cached_blocks: int) -> int:
        return max(0, profile.num_prompt_tokens - cached_blocks * profile.block_size)

    # -- all workers at once: the joint policy's fast path ------------------------------------------
    def encoder_costs(self, profile: RequestProfile, view: ClusterView) -> list[float]:
        """queue + encode per encoder index (meaningful for the request's candidates only)."""
        items = unique_items(profile.items)
        return self.encoder_costs_of(items, view.item_holders(items), view)

    def encoder_costs_of(self, items: tuple[MediaJob, ...], holders: list[int], view: ClusterView) -> list[float]:
        """encoder_costs() of the unique `items` and their holder bitmasks: O(E x modalities) for
        the all-miss case, then exact sums for the few cache holders."""
        if self._pending:
            self._sync()
        queue = view.outstanding_ms[_E]
        if len(items) == 1:  # the usual case: the loop below with one modality and count 1
            item = items[0]
            _, a, b = self._modality(item.modality)
            size = item.size
            costs = [c + ai + size * bi for c, ai, bi in zip(queue, a, b)]
        else:
            totals: dict[str, list[float]] = {}  # modality -> [count, total size]
            for item in items:
                entry = totals.setdefault(item.modality, [0, 0.0])
                entry[0] += 1
                entry[1] += item.size
            costs = queue
            for modality, (count, size) in totals.items():
                _, a, b = self._modality(modality)
                costs = [c + count * ai + size * bi for c, ai, bi in zip(costs, a, b)]
            if costs is queue:  # no items: a copy, never the view's own list
                costs = list(queue)
        if view.num_foreign[_E]:  # other replicas' items queued there, each priced as this request's mean item
            n, foreign = len(items) or 1, view.foreign[_E]
            costs = [c + (c - q) * f / n if f else c for c, q, f in zip(costs, queue, foreign)]
        held_any = 0
        for held in holders:
            held_any |= held
        if held_any:
            for e in bits(held_any & view.candidate_mask(_E)):
                misses = [item for item, held in zip(items, holders) if not held >> e & 1]
                costs[e] = queue[e] + self._encode_sum(e, misses) if misses else 0.0
        return costs

    def prefill_costs(self, profile: RequestProfile, view: ClusterView) -> list[float]:
        """queue + prefill per prefill index (the prefix holders' cached blocks taken off their tokens)."""
        if self._pending:
            self._sync()
        now_ms, n = view.now_s * 1e3, profile.num_prompt_tokens
        tokens: list[int] | repeat[int] = repeat(n)  # uncached tokens per prefill worker
        if profile.prefix_hashes:
            tokens, bs = [n] * len(self.prefill_a), profile.block_size
            for p, blocks in view.prefix_matches(profile.prefix_hashes).items():
                uncached = n - blocks * bs
                tokens[p] = uncached if uncached > 0 else 0
        # prefill_queue_ms() of each worker, inlined (this runs for every worker on every decision)
        # and without its clamp at 0, which the view's invariant service_ms <= outstanding_ms makes moot
        costs = [(queued - (done if done < now_ms - started else now_ms - started) if now_ms > started else queued) + a + b * t
                 for queued, started, done, a, b, t in zip(view.outstanding_ms[_P], view.service_started_ms, view.service_ms,
                                                           self.prefill_a, self.prefill_b, tokens)]
        if view.num_foreign[_P]:  # other replicas' jobs queued there, each priced as this request
            costs = [c + (a + b * t) * f if f else c for c, a, b, t, f in zip(costs, self.prefill_a, self.prefill_b, tokens, view.foreign[_P])]
        return costs


def embedding_bytes(items: tuple[MediaJob, ...]) -> int:
    """Bytes of all the request's embeddings (cache hits travel too)."""
    return items[0].embedding_bytes if len(items) == 1 else sum(item.embedding_bytes for item in items)
