"""The live cluster's side of the router: builds request profiles, books and releases
each request's stages in the Router, and feeds it the timings the workers report.

The Router itself (router/) is the same object the simulator drives.
"""

from __future__ import annotations

import time
from typing import Protocol

from actors.engine.prefix_cache import MediaKey, block_hashes
from actors.types import PrefillResult
from cluster.metrics import Metrics
from cluster.prompt_plan import PromptPlan
from router.router import Router
from router.types import MediaJob, RequestProfile, RouteDecision, WorkerKind
from router.view import NoWorkerError

# A large request waits at most this for the controller's answer, then routes on the last share.
SHARE_TIMEOUT_S = 0.05


class RoutingUnavailable(RuntimeError):
    pass


class BookingShares(Protocol):
    """Where the ingress replicas share their bookings (cluster/fleet_client.py FleetClient)."""

    num_replicas: int
    others_booked: dict | None

    async def share_now(self, booked: dict, timeout_s: float) -> bool: ...

    def publish(self, booked: dict) -> None: ...


class LiveRouting:
    def __init__(
        self,
        router: Router,
        metrics: Metrics,
        embedding_bytes_per_token: int,
        prefix_block_tokens: int = 0,
        *,
        shares: BookingShares | None = None,
        sync_above_ms: float = 0.0,
    ):
        self.router, self.metrics = router, metrics
        self.embedding_bytes_per_token = embedding_bytes_per_token
        self.prefix_block_tokens = (
            prefix_block_tokens  # 0: the prefill workers keep no prefix cache
        )
        self.shares = shares  # None: this replica routes alone
        self.sync_above_ms = sync_above_ms  # router.sync_above_ms

    def profile(
        self, plan: PromptPlan, token_ids: tuple[int, ...], max_tokens: int
    ) -> RequestProfile:
        """What the router weighs; `token_ids` are the plan's prompt plus any tokens a
        resumed request prefills again."""
        jobs = tuple(
            MediaJob(
                item.identifier,
                item.modality.value,
                item.size / 1e6,
                n,
                n * self.embedding_bytes_per_token,
            )
            for item, n in zip(plan.items, plan.num_embeddings)
        )
        if not self.prefix_block_tokens:
            return RequestProfile(len(token_ids), jobs, max_tokens=max_tokens)
        # The very hashes the prefill workers file their blocks under (actors/engine/prefill.py).
        media = tuple(
            MediaKey(r.offset, r.length, item.identifier)
            for r, item in zip(plan.placeholders, plan.items)
        )
        hashes = tuple(block_hashes(token_ids, self.prefix_block_tokens, media))
        return RequestProfile(len(token_ids), jobs, hashes, self.prefix_block_tokens, max_tokens)

    async def route_shared(self, profile: RequestProfile) -> RouteDecision:
        """route(), but a large request among other replicas routes on their bookings as of now
        and publishes its own at once: on the periodic shares alone, two replicas would send
        large requests to the same idle-looking worker (router/sim/routers.py measures it)."""
        shares = self.shares
        if shares is None or shares.num_replicas < 2 or not self._is_large(profile):
            return self.route(profile)
        answered = await shares.share_now(self.router.outstanding_ms(), SHARE_TIMEOUT_S)
        if answered:
            self.router.share_foreign(shares.others_booked, shares.num_replicas - 1)
        self.metrics.route_syncs.labels("shared" if answered else "unanswered").inc()
        decision = self.route(profile)
        shares.publish(self.router.outstanding_ms())
        return decision

    def _is_large(self, profile: RequestProfile) -> bool:
        return 0 < self.sync_above_ms < self.router.prefill_floor_ms(profile)

    def route(self, profile: RequestProfile) -> RouteDecision:
        try:
            decision = self.router.route(profile, time.monotonic())
        except NoWorkerError as exc:
            raise RoutingUnavailable(str(exc)) from None
        self._publish_queues()
        return decision

    def prefill_finished(
        self, decision: RouteDecision, result: PrefillResult, transfer_ms: float | None
    ) -> None:
        """Release the encode and prefill bookings and calibrate from what the workers measured."""
        now = time.monotonic()
        by_id = {item.identifier: item for item in decision.items}
        encoded = [
            (by_id[s.identifier], s)
            for s in result.encode_stats
            if not s.cache_hit and s.identifier in by_id
        ]
        for (
            item,
            stats,
        ) in encoded:  # a batch's time is shared by the items in it; each item on its own encoder
            self.router.observe_encode(
                decision.encoder_for(item.modality),
                item.modality,
                item.size,
                stats.encode_ms / max(stats.batch_size, 1),
            )
        self.router.encode_done(decision, now)  # releases every encoder a split request used
        # Its own device time, not first chunk to done: the worker shares steps among its requests
        # (shortest remaining first), and what they took is their queueing, not this prompt's cost.
        uncached = result.num_prompt_tokens - result.num_cached_tokens
        self.router.prefill_done(
            decision,
            now,
            duration_ms=result.compute_ms or result.prefill_ms,
            uncached_tokens=uncached,
        )
        # A request split across encoders measures parallel transfers from several places as one
        # interval: no single placement's fit should learn from it.
        if (
            transfer_ms is not None
            and decision.encoder is not None
            and decision.items
            and not decision.shares
        ):
            num_bytes = sum(item.embedding_bytes for item in decision.items)
            self.router.observe_transfer(
                self.router.placement(decision.encoder, decision.prefill), num_bytes, transfer_ms
            )
        self._publish_queues()

    def release(self, decision: RouteDecision, *, before_prefill: bool) -> None:
        """Free what is still booked when a request ends (normally only its decode slot)."""
        now = time.monotonic()
        if before_prefill:
            self.router.encode_done(decision, now)
            self.router.prefill_done(decision, now)
        self.router.decode_done(decision, now)
        self._publish_queues()

    def record_ttft(self, decision: RouteDecision, measured_ms: float) -> None:
        estimated_s = decision.estimated_ttft_ms / 1e3
        self.metrics.estimated_ttft.observe(estimated_s)
        self.metrics.ttft_estimate_error.observe(abs(measured_ms / 1e3 - estimated_s))

    def _publish_queues(self) -> None:
        view = self.router.view
        for kind in WorkerKind:
            self.metrics.queue_depth.labels(kind.value).set(view.queue_depth(kind))
