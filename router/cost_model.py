"""TTFT cost model: priors from config, calibrated online per worker from observed timings.

Estimated TTFT of a request on (encoder e, prefill p) =
    queue of e (only if some item misses e's cache: hits skip the encoder's queue)
  + encode time on e of the items e does not hold
  + transfer of all embeddings over the e->p placement
  + queue of p (its booked work, less what the job it is serving has done: prefill_queue_ms;
    with chunked prefill at most what goes first by shortest remaining: router/prefill_wait.py)
  + prefill of the prompt tokens p's prefix cache does not cover.

With CalibrationConfig.max_busy > 0 (off by default), ranking prefill workers (prefill_costs)
grows each one's queue by its utilisation, 1 / (1 - rho): shorter prompts that arrive while a
request waits go first, so at a busy worker a long prompt waits for more than the work booked now
(router/busy.py). The estimate a decision carries (pair_estimate) keeps the booked work: growing it
overstated the wait of the short prompts that overtake.

Every linear term is `fixed_ms + per_unit_ms * x`. Encode (per modality) and prefill are
calibrated as a pool-wide curve times per-worker relative times (router/calibration.py: a
burst moves the pool's curve, not one worker's fit, and a stale worker heals); transfers
have one `OnlineLinear` fit per placement. Observing is O(1); the routing fast path reads
the per-worker coefficients from flat lists (prefill_a, encode lists per modality, ...),
brought up to date before each read (_sync, _modality).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from router.busy import BusyRates
from router.calibration import CalibrationConfig, LinearCost, OnlineLinear, PoolFit, RelativeTimes
from router.holder_index import bits
from router.prefill_wait import shortest_first_wait_ms
from router.types import MediaJob, Modality, Placement, RequestProfile, TTFTEstimate, WorkerKind
from router.view import ClusterView, unique_items

_E, _P = WorkerKind.ENCODER, WorkerKind.PREFILL
_TIERS = (Placement.SAME_PROCESS, Placement.SAME_NODE, Placement.CROSS_NODE)  # closest first
_TIER_INDEX = {placement: i for i, placement in enumerate(_TIERS)}


# Seed table (ViT-L/14, Whisper-small): a 0.113 MP image ~5 ms, 30 video frames ~48 ms,
# 30 s audio ~85 ms.
DEFAULT_ENCODE = {
    Modality.IMAGE.value: LinearCost(1.0, 35.0),
    Modality.VIDEO.value: LinearCost(3.0, 1.5),
    Modality.AUDIO.value: LinearCost(1.0, 2.8),
}
DEFAULT_BANDWIDTH_GBPS = {
    Placement.SAME_PROCESS: 2000.0,
    Placement.SAME_NODE: 600.0,
    Placement.CROSS_NODE: 50.0,
}


@dataclass(frozen=True)
class CostPriors:
    """Starting estimates before any observation; sizes in megapixels / frames / seconds."""

    encode: Mapping[str, LinearCost] = field(default_factory=lambda: dict(DEFAULT_ENCODE))
    unknown_modality: LinearCost = LinearCost(5.0, 0.0)
    prefill_tokens_per_ms: float = 20.0
    prefill_fixed_ms: float = 2.0
    bandwidth_gbps: Mapping[Placement, float] = field(
        default_factory=lambda: dict(DEFAULT_BANDWIDTH_GBPS)
    )
    decode_step_ms: float = 8.0  # one decode step with an empty batch
    decode_per_seq_ms: float = 0.05  # what each running sequence adds to a step

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostPriors:
        """From config: any subset of the fields; `encode` and `bandwidth_gbps` merge over the
        defaults."""
        known = {
            "encode",
            "prefill_tokens_per_ms",
            "prefill_fixed_ms",
            "bandwidth_gbps",
            "decode_step_ms",
            "decode_per_seq_ms",
        }
        if unknown := set(data) - known:
            raise ValueError(f"unknown cost prior(s) {sorted(unknown)}; known: {sorted(known)}")
        encode = dict(DEFAULT_ENCODE)
        for modality, spec in dict(data.get("encode", {})).items():
            encode[modality] = LinearCost(
                _non_negative(f"encode.{modality}.fixed_ms", spec.get("fixed_ms", 0.0)),
                _non_negative(f"encode.{modality}.per_unit_ms", spec.get("per_unit_ms", 0.0)),
            )
        bandwidth = dict(DEFAULT_BANDWIDTH_GBPS)
        for name, gbps in dict(data.get("bandwidth_gbps", {})).items():
            bandwidth[Placement(name)] = _positive(f"bandwidth_gbps.{name}", gbps)
        scalars = {
            k: _non_negative(k, data[k])
            for k in ("prefill_fixed_ms", "decode_step_ms", "decode_per_seq_ms")
            if k in data
        }
        if "prefill_tokens_per_ms" in data:
            scalars["prefill_tokens_per_ms"] = _positive(
                "prefill_tokens_per_ms", data["prefill_tokens_per_ms"]
            )
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


class CostModel:
    def __init__(
        self,
        priors: CostPriors | None = None,
        *,
        num_encoders: int = 0,
        num_prefill: int = 0,
        calibration: CalibrationConfig | None = None,
        prefill_chunk_tokens: int = 0,
        prefill_preempts: bool = False,
    ):
        self.priors = priors or CostPriors()
        # The workers' prefill chunk (0: a prompt in one go): with chunks, a prompt waits only
        # for shorter ones and one chunk of a longer one (router/prefill_wait.py); where the
        # workers preempt at layer boundaries, a prompt that fits one chunk not even for that.
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_preempts = prefill_preempts
        self.calibration = calibration or CalibrationConfig()
        self.num_encoders = num_encoders
        # per modality: a pool fit over the encoders, all sharing the encoders' relative times
        self.encoder_times = RelativeTimes(num_encoders, self.calibration)
        self._encode: dict[str, PoolFit] = {}
        for modality in self.priors.encode:
            self._modality(modality)
        prefill_prior = LinearCost(
            self.priors.prefill_fixed_ms, 1.0 / self.priors.prefill_tokens_per_ms
        )
        self.prefill_fit = PoolFit(
            prefill_prior, RelativeTimes(num_prefill, self.calibration), self.calibration
        )
        self.prefill_a, self.prefill_b = self.prefill_fit.a, self.prefill_fit.b  # updated in place
        self.busy = BusyRates(
            num_prefill, self.calibration.busy_memory_s, self.calibration.max_busy
        )
        self._transfer = {
            pl: OnlineLinear(LinearCost(0.0, 1.0 / (gbps * 1e6)))
            for pl, gbps in self.priors.bandwidth_gbps.items()
        }
        if missing := [pl.value for pl in _TIERS if pl not in self._transfer]:
            raise ValueError(f"cost priors lack bandwidth_gbps for {missing}")
        # the three transfer fits' coefficients, in _TIERS order, for transfer_tiers()
        self._transfer_a = [self._transfer[pl].a for pl in _TIERS]
        self._transfer_b = [self._transfer[pl].b for pl in _TIERS]
        # Prefill or transfers observed since their flat coefficients were last copied: brought up
        # to date before the next read, so observing stays a few multiply-adds (encode fits:
        # _modality()).
        self._pending = False

    @classmethod
    def for_view(
        cls,
        priors: CostPriors | None,
        view: ClusterView,
        calibration: CalibrationConfig | None = None,
        prefill_chunk_tokens: int = 0,
        prefill_preempts: bool = False,
    ) -> CostModel:
        return cls(
            priors,
            num_encoders=len(view.workers[_E]),
            num_prefill=len(view.workers[_P]),
            calibration=calibration,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefill_preempts=prefill_preempts,
        )

    def _modality(self, modality: str) -> tuple[PoolFit, list[float], list[float]]:
        """The modality's fit and its per-encoder coefficient lists, up to date."""
        fit = self._encode.get(modality)
        if fit is None:
            prior = self.priors.encode.get(modality, self.priors.unknown_modality)
            fit = self._encode[modality] = PoolFit(prior, self.encoder_times, self.calibration)
        elif fit.curve.stale or fit._synced != self.encoder_times.version:  # fit.stale, inlined
            fit.sync()
        return fit, fit.a, fit.b

    def _sync(self) -> None:
        """Bring the prefill and transfer coefficient lists up to date with what was observed."""
        if self.prefill_fit.stale:
            self.prefill_fit.sync()
        for i, placement in enumerate(_TIERS):
            fit = self._transfer[placement]
            if fit.stale:
                self._transfer_a[i], self._transfer_b[i] = fit.coefficients()
        self._pending = False

    def encode_error(self, modality: str) -> float:
        """The encode fit's own relative error for `modality` (see router/calibration.py)."""
        return self._modality(modality)[0].error

    @property
    def prefill_error(self) -> float:
        """The prefill fit's own relative error."""
        return self.prefill_fit.error

    def relative_times(self, kind: WorkerKind) -> list[float]:
        """Each worker's learned time relative to its pool's typical worker (geometric mean 1)."""
        return list((self.encoder_times if kind is _E else self.prefill_fit.times).factors())

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
        return {
            Placement.SAME_PROCESS: proc,
            Placement.SAME_NODE: node,
            Placement.CROSS_NODE: cross,
        }

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
        return (
            cross
            if placement is Placement.CROSS_NODE
            else node
            if placement is Placement.SAME_NODE
            else proc
        )

    def decode_step_ms(self, running: int) -> float:
        return self.priors.decode_step_ms + self.priors.decode_per_seq_ms * running

    # -- calibration -----------------------------------------------------------------------------
    def observe_encode(self, encoder: int, modality: str, size: float, duration_ms: float) -> None:
        fit = self._encode.get(modality) or self._modality(modality)[0]
        fit.observe(encoder, size, duration_ms)

    def observe_prefill(self, prefill: int, uncached_tokens: int, duration_ms: float) -> None:
        self.prefill_fit.observe(prefill, uncached_tokens, duration_ms)
        self._pending = True

    def observe_transfer(self, placement: Placement, num_bytes: int, duration_ms: float) -> None:
        self._transfer[placement].observe(num_bytes, duration_ms)
        self._pending = True

    # -- one (encoder, prefill) pair: what every policy reports ------------------------------
    def evaluate(
        self, profile: RequestProfile, view: ClusterView, encoder: int | None, prefill: int
    ) -> tuple[TTFTEstimate, tuple[MediaJob, ...], int]:
        """The estimate for one pair, the items expected to miss the encoder cache, the uncached
        tokens."""
        if encoder is None:
            return self.pair_estimate(profile, view, None, prefill, (), [], (0.0, 0.0, 0.0))
        items = unique_items(profile.items)
        tiers = self.transfer_tiers(embedding_bytes(profile.items))
        return self.pair_estimate(
            profile, view, encoder, prefill, items, view.item_holders(items), tiers
        )

    def pair_estimate(
        self,
        profile: RequestProfile,
        view: ClusterView,
        encoder: int | None,
        prefill: int,
        items: tuple[MediaJob, ...],
        holders: list[int],
        tiers: tuple[float, float, float],
    ) -> tuple[TTFTEstimate, tuple[MediaJob, ...], int]:
        """evaluate(), given what depends on the request only and the joint policy has already
        worked out: the unique items, their holder bitmasks (view.item_holders) and the transfer
        tiers."""
        if self._pending:
            self._sync()
        uncached = profile.num_prompt_tokens  # what uncached_tokens() gives, without the call
        if profile.prefix_hashes:
            uncached -= view.prefix_blocks(prefill, profile.prefix_hashes) * profile.block_size
        if uncached < 0:
            uncached = 0
        prefill_queue = self.prefill_queue_ms(view, prefill)
        prefill_ms = self.prefill_a[prefill] + self.prefill_b[prefill] * uncached
        if self.prefill_chunk_tokens and (jobs := view.prefill_jobs_ms[prefill]):
            chunk_ms = self._chunk_in_service_ms(view, prefill, prefill_ms)
            prefill_queue = min(prefill_queue, shortest_first_wait_ms(jobs, prefill_ms, chunk_ms))
        if encoder is None:
            return TTFTEstimate.of(0.0, 0.0, 0.0, prefill_queue, prefill_ms), (), uncached
        if len(items) == 1:  # the usual case, without the comprehension and the loop
            if holders[0] >> encoder & 1:
                misses, encode = (), 0.0
            else:
                item = items[0]
                _, a, b = self._modality(item.modality)
                misses, encode = (
                    items,
                    0.0 + (a[encoder] + b[encoder] * item.size),
                )  # _encode_sum(encoder, items)
        else:
            misses = tuple([item for item, held in zip(items, holders) if not held >> encoder & 1])
            encode = self._encode_sum(encoder, misses)
        queue = view.outstanding_ms[_E][encoder] if misses else 0.0
        t_proc, t_node, t_cross = tiers
        if encoder in view.colocated[prefill]:
            transfer = t_proc
        else:
            transfer = (
                t_node if view.node_ids[_E][encoder] == view.node_ids[_P][prefill] else t_cross
            )
        return TTFTEstimate.of(queue, encode, transfer, prefill_queue, prefill_ms), misses, uncached

    # A prefill worker's booked ms include the whole of the job it is serving, which has on average
    # done half its work when the next request looks: counting all of it made the estimates ~15 ms
    # high at 80% load. So the time since that job started (at most its booked ms) comes off.
    @staticmethod
    def prefill_queue_ms(view: ClusterView, prefill: int) -> float:
        """Estimated ms of booked work ahead of a request reaching `prefill` now."""
        queued, elapsed = (
            view.outstanding_ms[_P][prefill],
            view.now_s * 1e3 - view.service_started_ms[prefill],
        )
        if elapsed > 0.0:
            done = view.service_ms[prefill]
            queued -= done if done < elapsed else elapsed
        return (
            queued if queued > 0.0 else 0.0
        )  # never below 0 while service_ms <= outstanding_ms (see ClusterView)

    def _shortest_first(self, view: ClusterView, queues: list[float], owns: list[float]) -> None:
        """Each worker's queue, at most the wait by shortest first of a prompt costing `owns`
        there: shortest_first_wait_ms (router/prefill_wait.py) inlined, as this runs for every
        worker on every decision. Only a booked prompt longer than this one can make the wait
        shorter than the booked work: without one, every prompt there goes first anyway."""
        booked = view.prefill_jobs_ms
        for p in [p for p, (jobs, own) in enumerate(zip(booked, owns)) if jobs and jobs[-1] > own]:
            wait = sum(booked[p][: bisect_right(booked[p], owns[p])])
            wait += self._chunk_in_service_ms(view, p, owns[p])  # a longer one is there
            if wait < queues[p]:
                queues[p] = wait

    def _chunk_in_service_ms(self, view: ClusterView, prefill: int, own_ms: float) -> float:
        """What a prompt of `own_ms` waits of the chunk in service at `prefill`: all of it if
        its job has started; 0 while it waits for its embeddings (no chunk runs yet: what comes
        now goes first), or where the prompt fits one chunk and the worker preempts."""
        if view.service_started_ms[prefill] > view.now_s * 1e3:
            return 0.0
        chunk_ms = self.prefill_a[prefill] + self.prefill_b[prefill] * self.prefill_chunk_tokens
        return 0.0 if self.prefill_preempts and own_ms <= chunk_ms else chunk_ms

    @staticmethod
    def uncached_tokens(profile: RequestProfile, cached_blocks: int) -> int:
        return max(0, profile.num_prompt_tokens - cached_blocks * profile.block_size)

    # -- all workers at once: the joint policy's fast path -----------------------------------
    def encoder_costs(self, profile: RequestProfile, view: ClusterView) -> list[float]:
        """queue + encode per encoder index (meaningful for the request's candidates only)."""
        items = unique_items(profile.items)
        return self.encoder_costs_of(items, view.item_holders(items), view)

    def encoder_costs_of(
        self, items: tuple[MediaJob, ...], holders: list[int], view: ClusterView
    ) -> list[float]:
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
        if (shared := view.foreign_queue_ms(_E)) is not None:  # other replicas' booked ms there
            costs = [c + f for c, f in zip(costs, shared)]
        elif view.num_foreign[
            _E
        ]:  # other replicas' items queued there, each priced as this request's mean item
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
        """queue + prefill per prefill index (the prefix holders' cached blocks taken off their
        tokens)."""
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
        # and without its clamp at 0, which the view's invariant service_ms <= outstanding_ms makes
        # moot; times what shorter arrivals add to the wait (router/busy.py)
        queues = [
            queued - (done if done < now_ms - started else now_ms - started)
            if now_ms > started
            else queued
            for queued, started, done in zip(
                view.outstanding_ms[_P], view.service_started_ms, view.service_ms
            )
        ]
        owns = [a + b * t for a, b, t in zip(self.prefill_a, self.prefill_b, tokens)]
        if self.prefill_chunk_tokens:
            self._shortest_first(view, queues, owns)
        costs = [q * g + own for q, g, own in zip(queues, self.busy.factors(view.now_s), owns)]
        if (shared := view.foreign_queue_ms(_P)) is not None:  # other replicas' booked ms there
            costs = [c + f for c, f in zip(costs, shared)]
        elif view.num_foreign[_P]:  # other replicas' jobs queued there, priced as this request
            costs = [
                c + (a + b * t) * f if f else c
                for c, a, b, t, f in zip(
                    costs, self.prefill_a, self.prefill_b, tokens, view.foreign[_P]
                )
            ]
        return costs


def embedding_bytes(items: tuple[MediaJob, ...]) -> int:
    """Bytes of all the request's embeddings (cache hits travel too)."""
    return (
        items[0].embedding_bytes if len(items) == 1 else sum(item.embedding_bytes for item in items)
    )
