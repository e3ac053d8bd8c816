"""Routing policies: each picks (encoder, prefill, decode) for one request.

Every policy returns the cost model's TTFT estimate of the pair it chose, so estimate
error can be measured whatever the policy. `joint` minimises that estimate over all
(encoder, prefill) pairs in O(E + P); the others are the baselines it is compared with.
"""
from __future__ import annotations

import abc
import math
import random
import time
from typing import ClassVar

from router.cost_model import CostModel
from router.types import RequestProfile, RouteDecision, WorkerKind
from router.view import ClusterView, bits, unique_items

_E, _P, _D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


class Policy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._fallback: tuple[ClusterView, CostModel] | None = None

    def pick(self, profile: RequestProfile, view: ClusterView, cost: CostModel | None = None, now_s: float | None = None) -> RouteDecision:
        """`cost` and `now_s` may be left out by callers that predate the cost model (priors, wall clock)."""
        cost = cost or self._default_cost(view)
        view.refresh(time.monotonic() if now_s is None else now_s)
        encoder, prefill, decode = self._choose(profile, view, cost)
        return decide(profile, view, cost, encoder, prefill, decode)

    def _default_cost(self, view: ClusterView) -> CostModel:
        if self._fallback is None or self._fallback[0] is not view:
            self._fallback = (view, CostModel.for_view(None, view))
        return self._fallback[1]

    @abc.abstractmethod
    def _choose(self, profile: RequestProfile, view: ClusterView, cost: CostModel) -> tuple[int | None, int, int]: ...


class StagewisePolicy(Policy):
    """A baseline: each stage chosen on its own."""

    def _choose(self, profile: RequestProfile, view: ClusterView, cost: CostModel) -> tuple[int | None, int, int]:
        encoder = self._encoder(profile, view) if profile.items else None
        return encoder, self._prefill(profile, view), self._decode(view)

    @abc.abstractmethod
    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int: ...

    @abc.abstractmethod
    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int: ...

    def _decode(self, view: ClusterView) -> int:
        return least_decode(view)


def decide(profile: RequestProfile, view: ClusterView, cost: CostModel, encoder: int | None, prefill: int, decode: int) -> RouteDecision:
    estimate, misses, uncached = cost.evaluate(profile, view, encoder, prefill)
    return RouteDecision(encoder, prefill, decode, estimate, profile.items, misses, uncached)


def least_decode(view: ClusterView) -> int:
    """Fewest running sequences (lowest step time); ties to the lowest index."""
    return min(view.candidates(_D), key=view.decode_loads().__getitem__)


def least_ms(view: ClusterView, kind: WorkerKind, workers: list[int]) -> int:
    ms, jobs = view.outstanding_ms[kind], view.outstanding[kind]
    return min(workers, key=lambda i: (ms[i], jobs[i]))


class Joint(Policy):
    """Minimum estimated TTFT over encoder x prefill pairs, without scanning the pairs: the
    transfer term depends only on placement, so each prefill worker needs just the best
    encoder on its node, the best anywhere, and any encoder sharing its process."""

    name = "joint"

    def _choose(self, profile: RequestProfile, view: ClusterView, cost: CostModel) -> tuple[int | None, int, int]:
        prefills = view.candidates(_P)
        prefill_costs = cost.prefill_costs(profile, view)
        if not profile.items:
            encoder, prefill = None, min(prefills, key=prefill_costs.__getitem__)
        else:
            encoder, prefill = self._pair(profile, view, cost, prefills, prefill_costs)
        return encoder, prefill, least_decode(view)

    @staticmethod
    def _pair(profile: RequestProfile, view: ClusterView, cost: CostModel, prefills: list[int], prefill_costs: list[float]) -> tuple[int, int]:
        encoders = view.candidates(_E, profile.modalities)
        enc_cost = cost.encoder_costs(profile, view)
        t_proc, t_node, t_cross = cost.transfer_tiers(sum(item.embedding_bytes for item in profile.items))
        best = min(encoders, key=enc_cost.__getitem__)
        cross = enc_cost[best] + t_cross  # any prefill worker can have the global best, cross-node
        # A node's own best beats that only if it is within (t_cross - t_node) of the global best;
        # transfers are monotone in distance, so this never undercuts a real pair.
        near = _best_per_node(view, encoders, enc_cost, cross - t_node)
        via = {n: enc_cost[e] + t_node for n, e in near.items()}.get
        pnode = view.node_ids[_P]
        totals = [via(pnode[p], cross) + prefill_costs[p] for p in prefills]
        i = min(range(len(prefills)), key=totals.__getitem__)
        prefill = prefills[i]
        encoder = near.get(pnode[prefill], best)
        if view.any_colocated:  # an encoder in the prefill worker's own process: cheaper still
            encoder, prefill = _colocated(view, t_proc, encoders, enc_cost, prefills, prefill_costs, totals[i], (encoder, prefill))
        return encoder, prefill


def _best_per_node(view: ClusterView, encoders: list[int], enc_cost: list[float], limit: float) -> dict[int, int]:
    """node -> its cheapest encoder (queue + encode), among encoders costing at most `limit`."""
    node_of, near = view.node_ids[_E], {}
    for e in [e for e in encoders if enc_cost[e] <= limit]:
        n = node_of[e]
        if n not in near or enc_cost[e] < enc_cost[near[n]]:
            near[n] = e
    return near


def _colocated(view: ClusterView, t_proc: float, encoders: list[int], enc_cost: list[float],
               prefills: list[int], prefill_costs: list[float], top: float, pair: tuple[int, int]) -> tuple[int, int]:
    allowed = set(encoders)
    for p in prefills:
        for e in view.colocated[p]:
            total = enc_cost[e] + t_proc + prefill_costs[p]
            if e in allowed and total < top:
                top, pair = total, (e, p)
    return pair


class Random(StagewisePolicy):
    """Uniform per stage, from a seeded generator (same seed, same choices)."""

    name = "random"

    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int:
        return self.rng.choice(view.candidates(_E, profile.modalities))

    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int:
        return self.rng.choice(view.candidates(_P))

    def _decode(self, view: ClusterView) -> int:
        return self.rng.choice(view.candidates(_D))


class RoundRobin(StagewisePolicy):
    """Each stage cycles through its candidates."""

    name = "round_robin"

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.turn = {kind: 0 for kind in WorkerKind}

    def _next(self, kind: WorkerKind, workers: list[int]) -> int:
        self.turn[kind] += 1
        return workers[(self.turn[kind] - 1) % len(workers)]

    def _encoder(self, profile: RequestProfile, view: ClusterView) -> int:
        return self._next(_E, view.candidates(_E, profile.modalities))

    def _prefill(self, profile: RequestProfile, view: ClusterView) -> int:
        return self._next(_P, view.candidates(_P))

    def _decode(self, view: ClusterView) -> int:
        return self._next(_D, view.candidates(_D))


class LeastLoaded(StagewisePolicy):
    """Power of two choices per stage: sample two candidates, take the one with less
    outstanding work (ms; decode: running sequences); ties to the lower index."""

    name = "least_loaded"

    def _two(self, workers: list[int]) -> tuple[int, int]:
        if len(workers) == 1:
            return workers[0], workers[0]
        i, j = self.rng.randrange(len(workers)), self.rng.randrange(len(workers) - 1)
        a, b = workers[i], workers[j + (j >= i)]
        return (a, b) if a < b else (b, a)

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


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Joint, Random, RoundRobin, LeastLoaded, Affinity)}


def make_policy(name: str, seed: int = 0) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](seed)
