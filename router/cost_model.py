"""TTFT cost model: priors from config, calibrated online per worker from observed timings.

Estimated TTFT of a request on (encoder e, prefill p) =
    queue of e (only if some item misses e's cache: hits skip the encoder's queue)
  + encode time on e of the items e does not hold
  + transfer of all embeddings over the e->p placement
  + queue of p + prefill of the prompt tokens p's prefix cache does not cover.

Every linear term is `fixed_ms + per_unit_ms * x` with an `OnlineLinear` fit per worker
(per modality for encoders, per placement for transfers): O(1) to observe, O(1) to read.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.types import MediaJob, Placement, RequestProfile, TTFTEstimate, WorkerKind
from router.view import ClusterView, bits, unique_items

_E, _P = WorkerKind.ENCODER, WorkerKind.PREFILL


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
    fit a slope, the prior scaled by an EWMA of observed/predicted. a, b stay finite and >= 0."""

    DECAY, RATIO_ALPHA, MIN_WEIGHT, MIN_CV = 0.9, 0.2, 3.0, 0.1

    __slots__ = ("prior", "ratio", "sw", "sx", "sy", "sxx", "sxy", "a", "b")

    def __init__(self, prior: LinearCost):
        self.prior, self.ratio = prior, 1.0
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.a, self.b = prior.fixed_ms, prior.per_unit_ms

    def predict(self, x: float) -> float:
        return self.a + self.b * x

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return  # a broken timing must not poison the fit
        expected = self.prior.fixed_ms + self.prior.per_unit_ms * x
        if expected > 0:
            ratio = min(max(y / expected, 1e-3), 1e3)
            self.ratio += self.RATIO_ALPHA * (ratio - self.ratio)
        d = self.DECAY
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self.a, self.b = self._fit()

    def _fit(self) -> tuple[float, float]:
        scaled = (self.ratio * self.prior.fixed_ms, self.ratio * self.prior.per_unit_ms)
        if self.sw < self.MIN_WEIGHT:
            return scaled
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        if var <= (self.MIN_CV * mx) ** 2 or var <= 1e-12:
            return scaled  # (nearly) one size seen: a slope would be noise
        b = (self.sxy / self.sw - mx * my) / var
        a = my - b * mx
        if b < 0:
            return scaled
        if a < 0:  # through the origin instead
            a, b = 0.0, self.sxy / self.sxx
        return (a, b) if math.isfinite(a) and math.isfinite(b) else scaled


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

    # -- single terms --------------------------------------------------------------------------
    def encode_ms(self, encoder: int, modality: str, size: float) -> float:
        _, a, b = self._modality(modality)
        return a[encoder] + b[encoder] * size

    def prefill_ms(self, prefill: int, uncached_tokens: int) -> float:
        return self.prefill_a[prefill] + self.prefill_b[prefill] * uncached_tokens

    def transfers(self, num_bytes: int) -> dict[Placement, float]:
        """Transfer ms per placement, made monotone (closer is never slower) so the joint
        policy may price a pair by its best-case placement."""
        proc, node, cross = self.transfer_tiers(num_bytes)
        return {Placement.SAME_PROCESS: proc, Placement.SAME_NODE: node, Placement.CROSS_NODE: cross}

    def transfer_tiers(self, num_bytes: int) -> tuple[float, float, float]:
        """(same process, same node, cross node) transfer ms, non-decreasing."""
        fits = self._transfer
        cross = fits[Placement.CROSS_NODE].predict(num_bytes)
        node = min(fits[Placement.SAME_NODE].predict(num_bytes), cross)
        return min(fits[Placement.SAME_PROCESS].predict(num_bytes), node), node, cross

    def transfer_ms(self, placement: Placement, num_bytes: int) -> float:
        proc, node, cross = self.transfer_tiers(num_bytes)
        return cross if placement is Placement.CROSS_NODE else node if placement is Placement.SAME_NODE else proc

    def decode_step_ms(self, running: int) -> float:
        return self.priors.decode_step_ms + self.priors.decode_per_seq_ms * running

    # -- calibration -----------------------------------------------------------------------------
    def observe_encode(self, encoder: int, modality: str, size: float, duration_ms: float) -> None:
        fits, a, b = self._modality(modality)
        fits[encoder].observe(size, duration_ms)
        a[encoder], b[encoder] = fits[encoder].a, fits[encoder].b

    def observe_prefill(self, prefill: int, uncached_tokens: int, duration_ms: float) -> None:
        fit = self._prefill[prefill]
        fit.observe(uncached_tokens, duration_ms)
        self.prefill_a[prefill], self.prefill_b[prefill] = fit.a, fit.b

    def observe_transfer(self, placement: Placement, num_bytes: int, duration_ms: float) -> None:
        self._transfer[placement].observe(num_bytes, duration_ms)

    # -- one (encoder, prefill) pair: what every policy reports ---------------------------------------
    def evaluate(self, profile: RequestProfile, view: ClusterView, encoder: int | None, prefill: int) -> tuple[TTFTEstimate, tuple[MediaJob, ...], int]:
        """The estimate for one pair, the items expected to miss the encoder cache, the uncached tokens."""
        uncached = self.uncached_tokens(profile, view.prefix_blocks(prefill, profile.prefix_hashes) if profile.prefix_hashes else 0)
        prefill_queue, prefill_ms = view.outstanding_ms[_P][prefill], self.prefill_ms(prefill, uncached)
        if encoder is None:
            return TTFTEstimate(prefill_queue_ms=prefill_queue, prefill_ms=prefill_ms), (), uncached
        misses = tuple(item for item in unique_items(profile.items) if not view.holds_item(encoder, item.identifier))
        encode = sum((self.encode_ms(encoder, item.modality, item.size) for item in misses), 0.0)
        queue = view.outstanding_ms[_E][encoder] if misses else 0.0
        transfer = self.transfer_ms(view.placement(encoder, prefill), sum(item.embedding_bytes for item in profile.items))
        return TTFTEstimate(queue, encode, transfer, prefill_queue, prefill_ms), misses, uncached

    @staticmethod
    def uncached_tokens(profile: RequestProfile, cached_blocks: int) -> int:
        return max(0, profile.num_prompt_tokens - cached_blocks * profile.block_size)

    # -- all workers at once: the joint policy's fast path ------------------------------------------
    def encoder_costs(self, profile: RequestProfile, view: ClusterView) -> list[float]:
        """queue + encode per encoder index (meaningful for the request's candidates only):
        O(E x modalities) for the all-miss case, then exact sums for the few cache holders."""
        items = unique_items(profile.items)
        totals: dict[str, list[float]] = {}  # modality -> [count, total size]
        for item in items:
            entry = totals.setdefault(item.modality, [0, 0.0])
            entry[0] += 1
            entry[1] += item.size
        costs = list(view.outstanding_ms[_E])
        for modality, (count, size) in totals.items():
            _, a, b = self._modality(modality)
            costs = [c + count * ai + size * bi for c, ai, bi in zip(costs, a, b)]
        holders = 0
        for item in items:
            holders |= view.encoder_cache.holders(item.identifier)
        for e in bits(holders & view.candidate_mask(_E)):
            misses = [item for item in items if not view.holds_item(e, item.identifier)]
            encode = sum((self.encode_ms(e, item.modality, item.size) for item in misses), 0.0)
            costs[e] = view.outstanding_ms[_E][e] + encode if misses else 0.0
        return costs

    def prefill_costs(self, profile: RequestProfile, view: ClusterView) -> list[float]:
        """queue + prefill per prefill index: everything uncached, then the few prefix holders fixed up."""
        q, a, b, n = view.outstanding_ms[_P], self.prefill_a, self.prefill_b, profile.num_prompt_tokens
        costs = [qi + ai + bi * n for qi, ai, bi in zip(q, a, b)]
        bs = profile.block_size
        for p, blocks in view.prefix_matches(profile.prefix_hashes).items():
            uncached = n - blocks * bs
            costs[p] = q[p] + a[p] + b[p] * (uncached if uncached > 0 else 0)
        return costs
