"""Routing policies: each picks (encoder, prefill, decode) for one request from the view."""
from __future__ import annotations

import abc

from router.types import RequestProfile, RouteDecision, WorkerKind
from router.view import ClusterView


class Policy(abc.ABC):
    name: str

    @abc.abstractmethod
    def pick(self, profile: RequestProfile, view: ClusterView) -> RouteDecision: ...


class LeastLoaded(Policy):
    """Each stage independently: the healthy worker with the fewest outstanding jobs
    (ties to the lowest index, so an idle cluster behaves predictably)."""

    name = "least_loaded"

    @staticmethod
    def _least(view: ClusterView, kind: WorkerKind) -> int:
        load = view.outstanding[kind]
        return min(view.candidates(kind), key=lambda i: load[i])

    def pick(self, profile: RequestProfile, view: ClusterView) -> RouteDecision:
        encoder = self._least(view, WorkerKind.ENCODER) if profile.num_items else None
        return RouteDecision(encoder, self._least(view, WorkerKind.PREFILL), self._least(view, WorkerKind.DECODE))


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (LeastLoaded,)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
