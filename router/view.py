"""The router's view of the fleet: which workers are healthy and how much work each has.

The router counts what it dispatched itself (incremented on route, decremented when the
stage finishes), so its view is never staler than its own decisions.
"""
from __future__ import annotations

from router.types import RouteDecision, WorkerKind


class ClusterView:
    def __init__(self, num_workers: dict[WorkerKind, int]):
        self.outstanding = {kind: [0] * n for kind, n in num_workers.items()}
        self.healthy = {kind: [True] * n for kind, n in num_workers.items()}

    def candidates(self, kind: WorkerKind) -> list[int]:
        up = [i for i, ok in enumerate(self.healthy[kind]) if ok]
        if not up:
            raise NoWorkerError(f"no healthy {kind.value} worker")
        return up

    def begin(self, kind: WorkerKind, index: int | None, amount: int = 1) -> None:
        if index is not None:
            self.outstanding[kind][index] += amount

    def end(self, kind: WorkerKind, index: int | None, amount: int = 1) -> None:
        if index is not None:
            self.outstanding[kind][index] = max(0, self.outstanding[kind][index] - amount)

    def begin_route(self, decision: RouteDecision, num_items: int) -> None:
        self.begin(WorkerKind.ENCODER, decision.encoder, num_items)
        self.begin(WorkerKind.PREFILL, decision.prefill)
        self.begin(WorkerKind.DECODE, decision.decode)

    def set_healthy(self, kind: WorkerKind, index: int, healthy: bool) -> None:
        self.healthy[kind][index] = healthy

    def queue_depth(self, kind: WorkerKind) -> int:
        return sum(self.outstanding[kind])


class NoWorkerError(RuntimeError):
    pass
