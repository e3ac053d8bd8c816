"""Routing policies: each picks (encoder, prefill, decode) for one request.

Every policy returns the cost model's TTFT estimate of the pair it chose, so estimate
error can be measured whatever the policy. `joint` minimises that estimate over all
(encoder, prefill) pairs without scanning them (O(E + P log P), the log at C speed); the
others are the baselines it is compared with.
"""

from __future__ import annotations

import abc
import math
import random
import time
from typing import ClassVar

from router.cost_model import CostModel, embedding_bytes
from router.holder_index import bits
from router.split import least_cost_encoder, split_decision
from router.types import MediaJob, RequestProfile, RouteDecision, WorkerKind
from router.view import ClusterView, unique_items

_E, _P, _D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


class Policy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._fallback: tuple[ClusterView, CostModel] | None = None

    def pick(
        self,
        profile: RequestProfile,
        view: ClusterView,
        cost: CostModel | None = None,
        now_s: float | None = None,
    ) -> RouteDecision:
        """`cost` and `now_s` may be left out by callers that predate the cost model (priors, wall
        clock)."""
        cost = cost or self._default_cost(view)
        view.refresh(time.monotonic() if now_s is None else now_s)
        return self.decision(profile, view, cost)

    def decision(
        self, profile: RequestProfile, view: ClusterView, cost: CostModel
    ) -> RouteDecision:
        """pick() at the view's clock as it stands (the caller refreshed it): choose the workers,
        then price the pair. Joint overrides this to reuse what it priced while choosing."""
        if (
            profile.items and not view.encoders_for(profile.items)[0]
        ):  # no encoder hosts all its modalities
            return split_decision(self, profile, view, cost)
        encoder, prefill, decode = self._choose(profile, view, cost)
        return decide(profile, view, cost, encoder, prefill, decode)

    def share_encoder(
        self,
        modality: str,
        items: tuple[MediaJob, ...],
        encoders: list[int],
        view: ClusterView,
        cost: CostModel,
    ) -> int:
        """The encoder, of `encoders` (those hosting `modality`), for the `items` (unique, all of
        `modality`) of a request split by modality that are not routed with the prefill worker."""
        return least_cost_encoder(items, encoders, view, cost)

    def _default_cost(self, view: ClusterView) -> CostModel:
        if self._fallback is None or self._fallback[0] is not view:
            self._fallback = (view, CostModel.for_view(None, view))
        return self._fallback[1]

    @abc.abstractmethod
    def _choose(
        self, profile: RequestProfile, view: ClusterView, cost: CostModel
    ) -> tuple[int | None, int, int]: ...


class StagewisePolicy(Policy):
    """A baseline: each stage chosen on its own."""

    def _choose(
        self, profile: RequestProfile, view: ClusterView, cost: CostModel
    ) -> tuple[int | None, int, int]:
        encoder = self._encoder(profile, view) if profile.items else None
        return encoder, self._prefill(profile, view), self._decode(view)

    @abc.abstractmethod
    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int: ...

    @abc.abstractmethod
    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int: ...

    def _decode(self, view: ClusterView) -> int:
        return least_decode(view)


def decide(
    profile: RequestProfile,
    view: ClusterView,
    cost: CostModel,
    encoder: int | None,
    prefill: int,
    decode: int,
) -> RouteDecision:
    estimate, misses, uncached = cost.evaluate(profile, view, encoder, prefill)
    return RouteDecision.of(encoder, prefill, decode, estimate, profile.items, misses, uncached)


def least_decode(view: ClusterView) -> int:
    """Fewest running sequences (lowest step time); ties to the lowest index."""
    return view.least_loaded_decode()


def argmin(workers: list[int], costs: list[float]) -> int:
    """The worker of least cost; ties to the first listed."""
    if len(workers) == len(costs):  # all are candidates: workers == [0, 1, ..., n-1]
        return costs.index(min(costs))
    return min(workers, key=costs.__getitem__)


def least_ms(view: ClusterView, kind: WorkerKind, workers: list[int]) -> int:
    ms, jobs = view.outstanding_ms[kind], view.outstanding[kind]
    return min(workers, key=lambda i: (ms[i], jobs[i]))


class Joint(Policy):
    """Minimum estimated TTFT over encoder x prefill pairs, without scanning the pairs: the
    transfer term depends only on placement, so each prefill worker needs just the best
    encoder on its node, the best anywhere, and any encoder sharing its process.

    Near-ties spread the load: an estimate is only as good as its fit, so with the prefill fit's
    own relative error s (CostModel.prefill_error) and z = CalibrationConfig.spread_z, every
    prefill worker whose best pair is estimated within z * s * T of the best pair's T is as good
    a choice, and of those the one with the fewest requests booked wins (ties: the lower
    estimate, then the lower index). z = 0, or an exact fit, is the plain argmin."""

    name = "joint"

    def _choose(
        self, profile: RequestProfile, view: ClusterView, cost: CostModel
    ) -> tuple[int | None, int, int]:
        decision = self.decision(profile, view, cost)
        return decision.encoder, decision.prefill, decision.decode

    def decision(
        self, profile: RequestProfile, view: ClusterView, cost: CostModel
    ) -> RouteDecision:
        # The per-request parts of the estimate (unique items, who holds them, transfer tiers) are
        # worked out once, used to rank every pair, and reused to price the chosen one.
        if profile.items:
            encoders, encoders_on = view.encoders_for(profile.items)
            if not encoders:  # no encoder hosts all its modalities
                return split_decision(self, profile, view, cost)
        prefills = view.candidates(_P)
        prefill_costs = cost.prefill_costs(profile, view)
        spread = (
            cost.calibration.spread_z * cost.prefill_error
        )  # the slack per ms of the best estimate
        if not profile.items:
            encoder, prefill = None, argmin(prefills, prefill_costs)
            if spread > 0.0 and len(prefills) > 1:
                prefill = _least_booked(
                    view,
                    [(prefill_costs[p], None, p) for p in prefills],
                    prefill_costs[prefill],
                    spread,
                )[1]
            items, holders, tiers = (), [], (0.0, 0.0, 0.0)
        else:
            items = profile.items if len(profile.items) == 1 else unique_items(profile.items)
            holders = view.item_holders(items)
            enc_cost = cost.encoder_costs_of(items, holders, view)
            tiers = cost.transfer_tiers(embedding_bytes(profile.items))
            encoder, prefill = _pair(
                view, encoders, encoders_on, enc_cost, tiers, prefills, prefill_costs, spread
            )
        decode = view.least_loaded_decode()  # least_decode()
        estimate, misses, uncached = cost.pair_estimate(
            profile, view, encoder, prefill, items, holders, tiers
        )
        return RouteDecision.of(encoder, prefill, decode, estimate, profile.items, misses, uncached)


def _least_booked(
    view: ClusterView, pairs: list[tuple[float, int | None, int]], top: float, spread: float
) -> tuple[int | None, int]:
    """Of the (total, encoder, prefill) `pairs` within spread * top of the best `top`: the
    (encoder, prefill) whose prefill worker has the fewest requests booked (see Joint)."""
    limit, jobs = top * (1.0 + spread), view.outstanding[_P]
    _, _, p, e = min(
        [(jobs[p], total, p, e) for total, e, p in pairs if total <= limit]
    )  # p unique: e never compared
    return e, p


def _pair(
    view: ClusterView,
    encoders: list[int],
    encoders_on: dict[int, list[int]],
    enc_cost: list[float],
    tiers: tuple[float, float, float],
    prefills: list[int],
    prefill_costs: list[float],
    spread: float = 0.0,
) -> tuple[int, int]:
    """The (encoder, prefill) pair of least enc_cost + transfer + prefill_cost; ties to the lowest
    prefill index; with `spread` > 0, the near-tie of least booked work (see Joint and
    _least_booked). `encoders_on`: the candidate encoders per node id.

    Any prefill worker can have the cheapest encoder `best` cross-node; being on a node whose own
    cheapest encoder is within (t_cross - t_node) of it saves at most that much (transfers are
    monotone in distance). So only prefill workers costing at most the cheapest one plus that
    saving can win, and only their nodes' encoders need a look: a min over E and a sort of P at
    C speed, plus a loop over those few workers (usually one to three)."""
    t_proc, t_node, t_cross = tiers
    cost_of = enc_cost.__getitem__
    best = argmin(encoders, enc_cost)
    cross = enc_cost[best] + t_cross
    limit = cross - t_node  # a node's own best encoder helps only if it costs at most this
    # The most that can save, loosened by far more than float rounding so no tied minimum is missed.
    saving = (t_cross - t_node) * (1 + 1e-9) + 1e-9
    pnode = view.node_ids[_P]
    via: dict[
        int, tuple[float, int]
    ] = {}  # node -> (encoder-side cost for a prefill worker there, its encoder)
    order = sorted(prefills, key=prefill_costs.__getitem__)  # cheapest first, ties in index order
    bound = prefill_costs[order[0]] + saving
    if spread > 0.0:  # a pair estimated within the slack of the best may win too
        bound += spread * (cross + prefill_costs[order[0]])
    top, pair, seen = math.inf, (best, order[0]), []
    for p in order:
        if prefill_costs[p] > bound:
            break
        n = pnode[p]
        found = via.get(n)
        if found is None:
            group = encoders_on.get(n)
            e = min(group, key=cost_of) if group else best
            found = via[n] = (
                (enc_cost[e] + t_node, e) if group and enc_cost[e] <= limit else (cross, best)
            )
        total = found[0] + prefill_costs[p]
        if spread > 0.0:
            seen.append((total, found[1], p))
        if total < top or (total == top and p < pair[1]):
            top, pair = total, (found[1], p)
    if view.any_colocated:  # an encoder in the prefill worker's own process: cheaper still
        top, pair = _colocated(
            view,
            t_proc,
            encoders,
            enc_cost,
            prefills,
            prefill_costs,
            top,
            pair,
            seen if spread > 0.0 else None,
        )
    if spread > 0.0 and len(seen) > 1:
        pair = _least_booked(view, seen, top, spread)
    return pair


def _colocated(
    view: ClusterView,
    t_proc: float,
    encoders: list[int],
    enc_cost: list[float],
    prefills: list[int],
    prefill_costs: list[float],
    top: float,
    pair: tuple[int, int],
    seen: list[tuple[float, int, int]] | None,
) -> tuple[float, tuple[int, int]]:
    """(top, pair) with the same-process pairs considered too (added to `seen` when given)."""
    allowed = set(encoders)
    for p in prefills:
        for e in view.colocated[p]:
            total = enc_cost[e] + t_proc + prefill_costs[p]
            if e in allowed:
                if seen is not None:
                    seen.append((total, e, p))
                if total < top:
                    top, pair = total, (e, p)
    return top, pair


class Random(StagewisePolicy):
    """Uniform per stage, from a seeded generator (same seed, same choices)."""

    name = "random"

    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int:
        return self.rng.choice(view.candidates(_E, profile.modalities))

    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int:
        return self.rng.choice(view.candidates(_P))

    def _decode(self, view: ClusterView) -> int:
        return self.rng.choice(view.candidates(_D))

    def share_encoder(
        self,
        modality: str,
        items: tuple[MediaJob, ...],
        encoders: list[int],
        view: ClusterView,
        cost: CostModel,
    ) -> int:
        return self.rng.choice(encoders)


class RoundRobin(StagewisePolicy):
    """Each stage cycles through its candidates."""

    name = "round_robin"

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.turn: dict[WorkerKind | str, int] = {
            kind: 0 for kind in WorkerKind
        }  # a modality: split requests' other groups

    def _next(self, key: WorkerKind | str, workers: list[int]) -> int:
        turn = self.turn[key] = self.turn.get(key, 0) + 1
        return workers[(turn - 1) % len(workers)]

    def share_encoder(
        self,
        modality: str,
        items: tuple[MediaJob, ...],
        encoders: list[int],
        view: ClusterView,
        cost: CostModel,
    ) -> int:
        return self._next(modality, encoders)

    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int:
        return self._next(_E, view.candidates(_E, profile.modalities))

    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int:
        return self._next(_P, view.candidates(_P))

    def _decode(self, view: ClusterView) -> int:
        return self._next(_D, view.candidates(_D))


class LeastLoaded(StagewisePolicy):
    """Power of two choices per stage: sample two candidates, take the one with less
    outstanding work (ms; decode: running sequences); ties to either of the two at random,
    so the baseline does not depend on how workers are numbered (ties to the lower index
    favoured whichever worker a config lists first, e.g. every idle-time pick)."""

    name = "least_loaded"

    def _two(self, workers: list[int]) -> tuple[int, int]:
        """Two distinct candidates in random order (the first wins ties)."""
        if len(workers) == 1:
            return workers[0], workers[0]
        i, j = self.rng.randrange(len(workers)), self.rng.randrange(len(workers) - 1)
        return workers[i], workers[j + (j >= i)]

    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int:
        return least_ms(view, _E, list(self._two(view.candidates(_E, profile.modalities))))

    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int:
        return least_ms(view, _P, list(self._two(view.candidates(_P))))

    def _decode(self, view: ClusterView) -> int:
        return min(self._two(view.candidates(_D)), key=view.decode_loads().__getitem__)


class Affinity(StagewisePolicy):
    """Cache affinity: the encoder holding most of the request's items, the prefill worker
    holding the longest prefix (ties and no holder: least outstanding ms)."""

    name = "affinity"

    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int:
        encoders = view.candidates(_E, profile.modalities)
        allowed = sum(1 << e for e in encoders)
        hits: dict[int, int] = {}
        for item in unique_items(profile.items):
            for e in bits(view.encoder_cache.holders(item.identifier) & allowed):
                hits[e] = hits.get(e, 0) + 1
        return self._most(view, _E, hits, encoders)

    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int:
        return self._most(view, _P, view.prefix_matches(profile.prefix_hashes), view.candidates(_P))

    @staticmethod
    def _most(view: ClusterView, kind: WorkerKind, held: dict[int, int], workers: list[int]) -> int:
        if not held:
            return least_ms(view, kind, workers)
        top = max(held.values())
        return least_ms(view, kind, sorted(w for w, n in held.items() if n == top))


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Joint, Random, RoundRobin, LeastLoaded, Affinity)
}


def make_policy(name: str, seed: int = 0) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](seed)
