"""The router facade: one object the ingress and the simulator both drive.

    router = Router(workers, CostPriors(), "joint")
    decision = router.route(profile, now_s)            # picks, and books the work in the view
    router.encode_done(decision, now_s, duration_ms)   # releases it, calibrates the cost model
    router.prefill_done(decision, now_s, duration_ms)
    router.decode_done(decision, now_s)

Durations are the stage's own compute time (no queueing): the queue is modelled from the
work the router booked, the compute time is what calibration learns. Of the completions only
prefill_done advances the view's clock (the next prefill job starts then); route() does before
deciding, so encode_done and decode_done, which need no clock, leave it alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.calibration import CalibrationConfig
from router.cost_model import CostModel, CostPriors
from router.policies import Policy, make_policy
from router.types import MediaJob, Placement, RequestProfile, RouteDecision, WorkerInfo, WorkerKind
from router.view import ClusterView

_E, _P, _D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
# With several ingress replicas, a request whose prefill is estimated above this many ms routes
# on a fresh share of the others' bookings and shares its own at once (router.sync_above_ms).
SYNC_ABOVE_MS = 50.0


class Router:
    def __init__(
        self,
        workers: Iterable[WorkerInfo],
        priors: CostPriors | None = None,
        policy: str | Policy = "joint",
        *,
        seed: int = 0,
        staleness_s: float = 5.0,
        dead_after_s: float = 10.0,
        calibration: CalibrationConfig | None = None,
        prefill_chunk_tokens: int = 0,  # the prefill workers' chunk (0: a prompt in one go)
        prefill_preempts: bool = False,  # they run short prompts between a chunk's layers
    ):
        self.view = ClusterView(workers, staleness_s=staleness_s, dead_after_s=dead_after_s)
        self.cost = CostModel.for_view(
            priors, self.view, calibration, prefill_chunk_tokens, prefill_preempts
        )
        self.policy = make_policy(policy, seed) if isinstance(policy, str) else policy

    def route(self, profile: RequestProfile, now_s: float) -> RouteDecision:
        """Pick the workers (NoWorkerError if a stage has none) and book the request's work."""
        self.view.refresh(now_s)
        decision = self.policy.decision(profile, self.view, self.cost)  # pick(), the clock just set
        self.view.dispatch(decision, profile)
        self.cost.busy.book(decision.prefill, decision.estimate.prefill_ms, now_s)
        return decision

    def encode_done(
        self,
        decision: RouteDecision,
        now_s: float,
        duration_ms: float | None = None,
        items: tuple[MediaJob, ...] | None = None,
    ) -> None:
        """The request's items are encoded; `duration_ms` is the compute time of `items`
        (default: the items the router expected to miss the cache), split by their estimates.
        A request split by modality is released on each of its encoders."""
        if decision.encoder is None:
            return
        if decision.shares:
            for share in decision.shares:
                self.view.end(_E, share.encoder, share.num_items, share.encode_ms)
        else:
            self.view.end(_E, decision.encoder, len(decision.items), decision.estimate.encode_ms)
        encoded = decision.encode_items if items is None else items
        if duration_ms is not None and encoded:
            self._calibrate_encode(decision, encoded, duration_ms)

    def _calibrate_encode(
        self, decision: RouteDecision, items: tuple[MediaJob, ...], duration_ms: float
    ) -> None:
        split = decision.shares
        if len(items) == 1:  # the usual case: all of it is that item's (what the split below gives)
            item = items[0]
            encoder = decision.encoder_for(item.modality) if split else decision.encoder
            self.cost.observe_encode(encoder, item.modality, item.size, duration_ms)
            return
        encoders = (
            [decision.encoder_for(item.modality) for item in items]
            if split
            else [decision.encoder] * len(items)
        )
        expected = [
            self.cost.encode_ms(e, item.modality, item.size) for e, item in zip(encoders, items)
        ]
        total = sum(expected)
        for e, item, part in zip(encoders, items, expected):
            share = part / total if total > 0 else 1 / len(items)
            self.cost.observe_encode(e, item.modality, item.size, duration_ms * share)

    def prefill_done(
        self,
        decision: RouteDecision,
        now_s: float,
        duration_ms: float | None = None,
        uncached_tokens: int | None = None,
    ) -> None:
        """The first token is out; `uncached_tokens` defaults to the router's expectation."""
        self.view.refresh(now_s)
        self.view.end(_P, decision.prefill, 1, decision.estimate.prefill_ms)
        if duration_ms is not None:
            tokens = decision.uncached_tokens if uncached_tokens is None else uncached_tokens
            self.cost.observe_prefill(decision.prefill, tokens, duration_ms)

    def decode_done(self, decision: RouteDecision, now_s: float) -> None:
        self.view.end(_D, decision.decode, 1)

    def observe_encode(self, encoder: int, modality: str, size: float, duration_ms: float) -> None:
        """Per-item timing straight from the encoder (its EncodeStats), not encode_done's split."""
        self.cost.observe_encode(encoder, modality, size, duration_ms)

    def observe_transfer(self, placement: Placement, num_bytes: int, duration_ms: float) -> None:
        self.cost.observe_transfer(placement, num_bytes, duration_ms)

    def placement(self, encoder: int, prefill: int) -> Placement:
        return self.view.placement(encoder, prefill)

    def publish(
        self,
        kind: WorkerKind,
        index: int,
        *,
        now_s: float,
        queued: int | None = None,
        running: int | None = None,
        cached_identifiers: frozenset[str] | None = None,
        prefix_hashes: frozenset[str] | None = None,
    ) -> None:
        self.view.publish(
            kind,
            index,
            now_s=now_s,
            queued=queued,
            running=running,
            cached_identifiers=cached_identifiers,
            prefix_hashes=prefix_hashes,
        )

    def set_healthy(self, kind: WorkerKind, index: int, healthy: bool) -> None:
        self.view.set_healthy(kind, index, healthy)

    def set_infos(self, workers: Iterable[WorkerInfo]) -> None:
        """The same slots, placed anew (an autoscaled worker started on some node)."""
        self.view.set_infos(workers)

    def forget(self, kind: WorkerKind, index: int, now_s: float) -> None:
        """A worker stopped and its slot is empty: out of routing, its caches out of view."""
        self.view.forget(kind, index, now_s)

    def outstanding_ms(self) -> dict[str, list[float]]:
        """Estimated ms this router has booked and not yet seen finish, per encoder and
        prefill worker: what it shares with other ingress replicas."""
        return {kind.value: list(self.view.outstanding_ms[kind]) for kind in (_E, _P)}

    def prefill_floor_ms(self, profile: RequestProfile) -> float:
        """The request's estimated prefill on the fastest prefill worker, nothing cached: how
        large it is, before any choice (a large one routes on fresh shares)."""
        num_workers = len(self.view.outstanding_ms[_P])
        n = profile.num_prompt_tokens
        return min((self.cost.prefill_ms(i, n) for i in range(num_workers)), default=0.0)

    def share_foreign(self, others: dict[str, list[float]] | None, num_others: int) -> None:
        """The other replicas' outstanding_ms(), summed: priced as queued work from now on;
        None once no other replica shares (their last share must not linger)."""
        for kind in (_E, _P):
            if others is None:
                self.view.share_foreign(kind, None, 0)
            elif kind.value in others:
                self.view.share_foreign(kind, others[kind.value], num_others)

    def booked_ms_totals(self) -> dict[str, list[float]]:
        """Estimated ms ever booked per encoder and prefill worker (autoscaling's load)."""
        return {kind.value: list(self.view.booked_ms_total[kind]) for kind in (_E, _P)}
