"""One request's path through the cluster, top-down:

admit (parse, validate, decode media, identify, plan the prompt) -> route -> encode
-> prefill -> decode, yielding the request's tokens as TokenChunks. Tensors never come
here: embeddings and KV move worker-to-worker as refs this module only passes along.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import ray

from actors.engine.decode_state import finish_reason_of
from actors.store_pages import StorePages
from actors.types import (
    DecodeRequest,
    EncodeJob,
    FinishReason,
    PrefillRequest,
    PrefillResult,
    TokenChunk,
    hop_ms,
)
from actors.worker_links import WorkerLinks
from cluster.admitted import AdmissionTimings, Admitted, Endpoint, Job
from cluster.config import ClusterConfig, Transport
from cluster.decode_feed import DecodeFeeds
from cluster.errors import RequestError
from cluster.fleet_client import FleetClient, with_options
from cluster.intake import Intake
from cluster.leftovers import close_soon, detached
from cluster.metrics import Metrics
from cluster.overlap import overlapped
from cluster.prompt_plan import PromptPlanner
from cluster.recovery import (
    RETRYABLE,
    WorkerLost,
    is_transport_failure,
    lost_worker,
    worker_code_failure,
)
from cluster.request_body import HeldBody
from cluster.routing import LiveRouting, RoutingUnavailable
from cluster.trace import TraceWriter
from router.types import RequestProfile, RouteDecision, WorkerKind

ROUTE_RETRY_S = 0.1  # how often a request waiting for a healthy worker tries again
RETRY_AFTER_S = 2  # what a 503 tells clients to wait: about one supervisor check


@dataclass
class RequestTimings:
    """Per-request timings, filled in as the request moves (ms since arrival unless noted)."""

    route: RouteDecision | None = None
    profile: RequestProfile | None = None
    ttft_ms: float | None = None
    admitted_ms: float = 0.0  # arrival to admitted: body read, lane wait, parse, media, plan
    route_ms: float = 0.0  # routing, and waiting for a healthy worker
    encode_ms: float = 0.0  # the slowest item's encode queue + compute
    encode_queue_ms: float = 0.0  # that item's wait for the encoder's batch
    encode_compute_ms: float = 0.0
    encode_hop_in_ms: float = 0.0  # that item's encode call, ingress to encoder
    pixels_fetch_ms: float = 0.0  # and its pixels' fetch from the object store
    item_wait_ms: float = 0.0  # the prefill's wait for embeddings (encode/prefill overlap)
    transfer_ms: float = 0.0  # embeddings from the encoder to the prefill worker
    prefill_call_ms: float = 0.0  # the prefill call as the ingress saw it (hops included)
    prefill_hop_in_ms: float = 0.0  # of prefill_call_ms: the call's way to the worker
    prefill_hop_out_ms: float = 0.0  # and the result's way back
    prefill_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0  # its own device time within prefill_ms
    prefill_publish_ms: float = 0.0  # the forward's end to the answer: the worker's hand-back
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache gave its first prefill

    def phases_ms(self, admission: AdmissionTimings) -> dict[str, float]:
        """The time to first token phase by phase, in the order a request meets them (ms):
        what the response's `timings`, the request log and the trace show. admit_ms holds
        admission's parts and its lane wait; the prefill call goes out as the encoders start,
        so its hop in and queue overlap the encode. `first_token_ms` is what is left: the
        first token's way out through the ingress."""
        ttft_ms = self.ttft_ms or 0.0
        return {
            "handover_ms": admission.handover_ms,
            "body_ms": admission.body_ms,
            "parse_ms": admission.parse_ms,
            "media_ms": admission.media_ms,
            "plan_ms": admission.plan_ms,
            "admit_ms": self.admitted_ms,
            "route_ms": self.route_ms,
            "encode_hop_in_ms": self.encode_hop_in_ms,
            "pixels_fetch_ms": self.pixels_fetch_ms,
            "encode_queue_ms": self.encode_queue_ms,
            "encode_compute_ms": self.encode_compute_ms,
            "transfer_ms": self.transfer_ms,
            "prefill_hop_in_ms": self.prefill_hop_in_ms,
            "prefill_queue_ms": self.prefill_queue_ms,
            "item_wait_ms": self.item_wait_ms,
            "prefill_compute_ms": self.prefill_compute_ms,
            "prefill_publish_ms": self.prefill_publish_ms,
            "prefill_hop_out_ms": self.prefill_hop_out_ms,
            "first_token_ms": max(
                0.0, ttft_ms - self.admitted_ms - self.route_ms - self.prefill_call_ms
            ),
        }


class RequestPath:
    def __init__(
        self,
        config: ClusterConfig,
        fleet: FleetClient,
        planner: PromptPlanner,
        routing: LiveRouting,
        metrics: Metrics,
        on_worker_lost: Callable[[WorkerLost], Awaitable[None]],
    ):
        self.config, self.fleet, self.planner = config, fleet, planner
        self.routing, self.metrics = routing, metrics
        self.on_worker_lost = (
            on_worker_lost  # the supervisor confirms the death and restarts the worker
        )
        self.trace = TraceWriter(config.server.trace_path) if config.server.trace_path else None
        # Decoded media goes into the object store in the admission thread: the encode call
        # then sends a reference, and the event loop never serializes pixels; the store's
        # pages written are then unmapped here, so they are not counted as the ingress's RSS.
        self.intake = Intake(config, planner, store=StorePages().putter(ray.put))
        self._decode_step = metrics.stage.labels("decode_step")  # observed once per step
        self.feeds = DecodeFeeds(
            fleet.owner, self._record_step, direct=config.transport.direct_links
        )
        self.links = WorkerLinks(  # prefill calls
            direct=config.transport.direct_links, ring=config.transport.shared_memory
        )
        self.fleet_retired: str | None = None  # why, once a redeploy retired this fleet

    # -- 1. admit -------------------------------------------------------------------------
    def admit(
        self,
        body: bytes | HeldBody,
        request_id: str,
        arrived_s: float,
        endpoint: Endpoint = Endpoint.CHAT,
    ) -> Admitted:
        """Parse, validate, decode media and plan the prompt (cluster/intake.py)."""
        return self.intake.admit(body, request_id, arrived_s, endpoint)

    # -- 2. route ---------------------------------------------------------------------------
    async def route(self, job: Job, trace: RequestTimings) -> RouteDecision:
        """Pick the workers; while a stage has no healthy worker (one is restarting), wait for
        one until the request's deadline rather than failing at once."""
        trace.profile = self.routing.profile(job.adm.plan, job.token_ids, job.sampling.max_tokens)
        while True:
            if self.fleet_retired:  # no worker of this fleet will come back: say so at once
                raise RequestError(
                    503, self.fleet_retired, type="server_error", retry_after_s=RETRY_AFTER_S
                )
            try:
                trace.route = await self.routing.route_shared(trace.profile)
                return trace.route
            except RoutingUnavailable as exc:
                if time.perf_counter() + ROUTE_RETRY_S > job.deadline_s:
                    raise RequestError(
                        503, str(exc), type="server_error", retry_after_s=RETRY_AFTER_S
                    ) from None
            await asyncio.sleep(ROUTE_RETRY_S)

    # -- 3..5. encode, prefill, decode --------------------------------------------------------
    async def run(self, adm: Admitted, trace: RequestTimings) -> AsyncIterator[TokenChunk]:
        """The request's tokens. When a worker dies under it, the request goes on on healthy
        workers from the tokens it already has: the prompt plus those tokens are prefilled
        again, and sampling (keyed by seed and position) continues as if nothing happened."""
        produced: list[int] = []
        deadline_s = adm.arrived_s + self.config.limits.request_timeout_s
        try:
            for attempt in range(self.config.limits.max_attempts):
                if adm.media_released:  # the prefill worker that had its embeddings is gone
                    adm = await asyncio.to_thread(self.intake.reload_media, adm)
                job = Job.of(adm, tuple(produced), attempt, deadline_s, self.fleet.owner)
                attempt_stream = self._attempt(job, trace)
                try:
                    async for chunk in attempt_stream:
                        produced.extend(chunk.token_ids)
                        yield chunk
                    return
                except WorkerLost as lost:
                    if not self.fleet_retired:  # else nobody would replace it
                        await self.on_worker_lost(lost)
                    self.metrics.retries.labels(lost.kind).inc()
                    failure = lost
                finally:
                    # closed now, not whenever the garbage collector gets to it: its clean-up
                    # frees KV
                    close_soon(attempt_stream)
                if done := self._finished_already(
                    adm, produced
                ):  # the worker died after the last token
                    yield done
                    return
        finally:
            adm.release_media()  # however it ended; at once if it never reached a prefill
        raise RequestError(
            503,
            f"workers failed {self.config.limits.max_attempts} times under this request; "
            f"last: {failure}",
            type="server_error",
            retry_after_s=RETRY_AFTER_S,
        )

    def _finished_already(self, adm: Admitted, produced: list[int]) -> TokenChunk | None:
        """The closing chunk if the tokens produced so far already end the request."""
        if not produced:
            return None
        reason = finish_reason_of(
            len(adm.plan.token_ids), adm.sampling, produced, self.config.model.max_model_len
        )
        return TokenChunk((), reason) if reason is not None else None

    async def _attempt(self, job: Job, trace: RequestTimings) -> AsyncIterator[TokenChunk]:
        routing_s = time.perf_counter()
        decision = await self.route(job, trace)
        prefilled, decoded, routed_s = False, False, time.perf_counter()
        trace.route_ms = (routed_s - routing_s) * 1e3
        try:
            encoded = self.encode(job, decision)
            result, transfer_ms = await self.prefill(job, decision, encoded)
            trace.prefill_hop_in_ms = result.call_in_ms
            trace.prefill_hop_out_ms = hop_ms(result.returned_at_s, time.time())
            prefilled = True
            job.adm.release_media()  # the embeddings are in: the pixels leave the object store
            trace.prefill_call_ms = (time.perf_counter() - routed_s) * 1e3
            trace.transfer_ms = transfer_ms or 0.0
            self.routing.prefill_finished(decision, result, transfer_ms)
            self._record_prefill(result, trace)
            first = self._first_chunk(job, result)
            if trace.ttft_ms is None:  # a resumed request keeps its first TTFT
                self._record_ttft(job, decision, trace)
            yield first
            if not first.finished:
                decoding = self.decode(job, decision, result)
                try:
                    async for chunk in decoding:
                        decoded = chunk.finished
                        yield chunk
                finally:
                    close_soon(decoding)
        except RETRYABLE as exc:
            raise lost_worker(exc, self.fleet, decision) from exc
        except (ValueError, ray.exceptions.RayTaskError) as exc:
            if is_transport_failure(exc):
                raise lost_worker(exc, self.fleet, decision) from exc
            if not isinstance(exc, ray.exceptions.RayTaskError):
                raise
            raise worker_code_failure(exc) from None
        finally:
            # Whatever the prefill worker still holds for this attempt (embeddings, KV that
            # decode never pulled) is freed, and late arrivals are refused. A request decoded
            # to its end holds nothing there (every item arrived before its prefill ended and
            # decode pulled the KV): no call, one Ray call less per request.
            if not decoded:
                detached(
                    self.fleet.pools[WorkerKind.PREFILL][decision.prefill].drop.remote, job.job_id
                )
            self.routing.release(decision, before_prefill=not prefilled)

    def _record_ttft(self, job: Job, decision: RouteDecision, trace: RequestTimings) -> None:
        trace.ttft_ms = (time.perf_counter() - job.adm.arrived_s) * 1e3
        self.routing.record_ttft(decision, trace.ttft_ms)
        if self.trace is not None:
            self.trace.record(
                job.adm.arrived_s,
                trace.profile,
                decision,
                trace.ttft_ms,
                timings=trace,
                phases_ms=trace.phases_ms(job.adm.timings),
            )

    def encode(self, job: Job, decision: RouteDecision) -> list:
        """One encode call per item, on the encoder of its modality (pools may be split by
        modality); each encoder batches them with other requests' items. Over the object store
        the encoder hands the embeddings to the prefill worker itself (`_pushes`)."""
        encoders = self.fleet.pools[WorkerKind.ENCODER]
        option = self.fleet.transport_option(self.config.transport.embeddings)
        push = self.fleet.pools[WorkerKind.PREFILL][decision.prefill] if self._pushes else None
        inline_bytes, plan, calls = self.config.transport.inline_bytes, job.adm.plan, []
        for slot, (item, n) in enumerate(zip(plan.items, plan.num_embeddings)):
            encoder = encoders[decision.encoder_for(item.modality.value)]
            encode = EncodeJob(
                job.job_id,
                item,
                n,
                push,
                slot,
                sent_at_s=time.time(),
                inline_max_bytes=inline_bytes,
            )
            if self._linked(item):  # its pixels ride in the call
                calls.append(asyncio.ensure_future(self.links.call(encoder, "encode", encode)))
            else:
                calls.append(with_options(encoder.encode, option).remote(encode))
        return calls

    def _linked(self, item) -> bool:
        """Whether the item's encode call goes over the encoder's link: its pixels are inline
        (Intake kept them), and the encoder pushes the embeddings on (over the object store)."""
        return self._pushes and item.data_ref is None

    @property
    def _pushes(self) -> bool:
        """Whether encoders deliver embeddings themselves: over the object store, where nothing
        orders transfers. Over gloo/nccl the ingress orders them; over CUDA IPC the receive
        must take the encoder's returned reference."""
        return self.config.transport.embeddings == Transport.OBJECT_STORE

    def _release_encoded(self, job: Job, decision: RouteDecision) -> None:
        """Let the encoders that served this attempt's items evict them again, the way each
        call went (a link or Ray): a release never overtakes the call it releases."""
        encoders = self.fleet.pools[WorkerKind.ENCODER]
        items = job.adm.plan.items
        for index, linked in {
            (decision.encoder_for(i.modality.value), self._linked(i)) for i in items
        }:
            if linked:
                self.links.send(encoders[index], "drop", job.job_id)
            else:
                detached(encoders[index].drop.remote, job.job_id)

    async def deliver(
        self, kind: WorkerKind, index: int, request_id: str, refs: list, transport
    ) -> list:
        """Hand tensors (as refs) to a worker's inbox, one receive call per item; they move
        worker-to-worker, never here. Returns each receive's answer."""
        worker = self.fleet.pools[kind][index]
        calls = lambda: [
            detached(worker.receive.remote, request_id, slot, ref) for slot, ref in enumerate(refs)
        ]
        if not transport.collective:
            return await asyncio.gather(*calls())
        async with self.fleet.receiving(
            transport
        ):  # one RDT transfer at a time (FleetClient.receiving)
            return [
                await detached(worker.receive.remote, request_id, slot, ref)
                for slot, ref in enumerate(refs)
            ]

    async def prefill(
        self, job: Job, decision: RouteDecision, encoded: list
    ) -> tuple[PrefillResult, float | None]:
        """The prefill result, and how long the embeddings took from encoder to prefill worker.

        With `prefill.overlap_encode` the prefill call goes at once and each item's embeddings
        follow as the encoder finishes them, so the text before the first item is prefilled
        while the encoder runs; otherwise all embeddings are delivered first."""
        plan = job.adm.plan
        request = PrefillRequest(
            job.job_id,
            job.token_ids,
            plan.placeholders,
            job.sampling,
            job.num_output_tokens,
            media_identifiers=tuple(item.identifier for item in plan.items),
        )
        result, received = await self._prefill_call(job, decision, request, encoded)
        received_at = max(received) if received else None
        ready_at = max(
            (s.finished_at_s for s in result.encode_stats if not s.cache_hit), default=None
        )
        transfer_ms = (received_at - ready_at) * 1e3 if received_at and ready_at else None
        return result, (max(transfer_ms, 0.0) if transfer_ms is not None else None)

    async def _prefill_call(
        self, job: Job, decision: RouteDecision, request: PrefillRequest, encoded: list
    ) -> tuple[PrefillResult, list | None]:
        """The prefill call with its embeddings delivered (overlapped or first); the result and
        the receive answers. The encoders' references go once the embeddings are delivered."""
        prefill = self.fleet.pools[WorkerKind.PREFILL][decision.prefill]
        if not encoded:
            return await self._sent(prefill, request), None
        released = False

        def release() -> (
            None
        ):  # the embeddings reached the prefill worker (or never will): the encoders may evict them
            nonlocal released
            if not released:
                released = True
                self._release_encoded(job, decision)

        async def deliver() -> list:
            try:
                if self._pushes:  # the encode calls end once their embeddings arrived there
                    delivered = await asyncio.gather(*encoded)
                    # here, not from the result: it may come before an item its cached prefix
                    # made needless, whose encode still took place
                    self._record_encodes([done.stats for done in delivered])
                    return [done.received_at_s for done in delivered]
                return await self.deliver(
                    WorkerKind.PREFILL,
                    decision.prefill,
                    job.job_id,
                    encoded,
                    self.config.transport.embeddings,
                )
            finally:
                release()

        try:
            if self.config.prefill.overlap_encode:
                # pushed items the worker did not wait for finish on their own (overlapped)
                return await overlapped(
                    self._sent(prefill, request), deliver(), await_delivery=not self._pushes
                )
            received = await deliver()
            return await self._sent(prefill, request), received
        except BaseException:
            for call in encoded:  # a link's encode call nobody awaits any more (the prefill
                if isinstance(call, asyncio.Future):  # call failed first): cancelled there too
                    call.cancel()
            raise
        finally:
            release()  # a delivery cancelled before it ever started released nothing

    def _first_chunk(self, job: Job, result: PrefillResult) -> TokenChunk:
        reason = finish_reason_of(
            result.num_prompt_tokens,
            job.sampling,
            [result.first_token_id],
            self.config.model.max_model_len,
        )
        logprobs = (result.first_logprob,) if result.first_logprob is not None else ()
        return TokenChunk((result.first_token_id,), reason, logprobs=logprobs)

    async def decode(
        self, job: Job, decision: RouteDecision, result: PrefillResult
    ) -> AsyncIterator[TokenChunk]:
        prefill = self.fleet.pools[WorkerKind.PREFILL][decision.prefill]
        decoder = self.fleet.pools[WorkerKind.DECODE][decision.decode]
        kv_ref = (
            None  # popped over the prefill worker's link in _submit_decode
            if self._kv_inline(result)
            else with_options(
                prefill.pop_kv, self.fleet.transport_option(self.config.transport.kv)
            ).remote(job.job_id)
        )
        request = DecodeRequest(
            job.job_id,
            result.num_prompt_tokens,
            result.first_token_id,
            job.sampling,
            result.rope_delta,
            job.history,
        )
        feed = self.feeds.of(decoder)
        feed.listen(job.job_id)  # before the submit: its first chunk may come right after
        finished = False
        try:
            if not await self._submit_decode(prefill, decoder, decision, request, kv_ref):
                return  # aborted before it reached the worker: nobody is listening
            async for chunk in feed.chunks(job.job_id, self.config.decode.stream_interval):
                if chunk.finish_reason == FinishReason.ERROR:
                    raise RequestError(
                        500,
                        "decoding failed for this request (its next token could not be sampled)",
                        type="server_error",
                    )
                finished = chunk.finished
                yield chunk
        finally:
            feed.forget(job.job_id)
            if not finished:  # the client left, a stop string matched or a worker failed
                detached(decoder.abort.remote, job.job_id)  # frees the row and the KV

    async def _submit_decode(
        self, prefill, decoder, decision: RouteDecision, request: DecodeRequest, kv_ref
    ) -> bool:
        """Over the object store (and CUDA IPC) the KV rides on the submit call itself: no
        copy waits in the decode worker for a call that may never come. A small one
        (`_kv_inline`, no `kv_ref`) rides inside the workers' link calls, popped and submitted:
        two link hops instead of two Ray calls and the store's put and fetch. Collective
        transfers into one actor must be ordered, so there the KV is delivered first."""
        owner = self.fleet.owner
        if kv_ref is None:
            kv = await self.links.call(prefill, "pop_kv", request.request_id)
            # in a task of its own, as a Ray submit is detached (cluster/leftovers.py)
            submit = self.links.call(decoder, "submit", request, kv, owner)
            return await detached(asyncio.ensure_future, submit)
        if not self.config.transport.kv.collective:
            return await detached(decoder.submit.remote, request, kv_ref, owner)
        await self.deliver(
            WorkerKind.DECODE,
            decision.decode,
            request.request_id,
            [kv_ref],
            self.config.transport.kv,
        )
        return await detached(decoder.submit.remote, request, None, owner)

    def _kv_inline(self, result: PrefillResult) -> bool:
        """Whether the request's KV goes prefill -> ingress -> decode inside link calls: over
        the object store, with links, and at most transport.inline_max_bytes (as small pixels
        and embeddings do). Judged from the prompt's length: no larger than it may be."""
        t = self.config.transport
        if not (t.direct_links and t.kv == Transport.OBJECT_STORE):
            return False
        kv_bytes = result.num_prompt_tokens * self.planner.spec.kv_bytes_per_token
        return kv_bytes <= t.inline_max_bytes

    def _record_step(self, step_ms: float) -> None:
        self._decode_step.observe(step_ms / 1e3)

    def _record_prefill(self, result: PrefillResult, trace: RequestTimings) -> None:
        stage = self.metrics.stage
        stage.labels("prefill").observe(result.prefill_ms / 1e3)
        stage.labels("prefill_queue").observe(result.queue_ms / 1e3)
        stage.labels("prefill_item_wait").observe(
            result.item_wait_ms / 1e3
        )  # overlap: the prefill waited for embeddings
        self.metrics.prefill_time.observe(result.prefill_ms / 1e3)
        self.metrics.queue_time.observe(result.queue_ms / 1e3)
        if not self._pushes:  # pushed ones are recorded as their encode calls end (deliver)
            self._record_encodes(result.encode_stats)
        slowest = max(result.encode_stats, key=lambda s: s.queue_ms + s.encode_ms, default=None)
        if slowest is not None:
            trace.encode_queue_ms, trace.encode_compute_ms = slowest.queue_ms, slowest.encode_ms
            trace.encode_ms = slowest.queue_ms + slowest.encode_ms
            trace.encode_hop_in_ms, trace.pixels_fetch_ms = slowest.hop_in_ms, slowest.fetch_ms
        trace.item_wait_ms = result.item_wait_ms
        trace.prefill_ms, trace.prefill_queue_ms = result.prefill_ms, result.queue_ms
        trace.prefill_compute_ms = result.compute_ms
        trace.prefill_publish_ms = result.publish_ms
        if trace.num_cached_tokens is None:  # a resumed attempt also finds its own output cached
            trace.num_cached_tokens = result.num_cached_tokens
        self.metrics.prompt_tokens.inc(result.num_prompt_tokens)
        self.metrics.prefix_cache_queries.inc(result.num_prompt_tokens)
        self.metrics.prefix_cache_hits.inc(result.num_cached_tokens)

    def _record_encodes(self, encode_stats) -> None:
        stage = self.metrics.stage
        for stats in encode_stats:
            self.metrics.record_encoder_lookup(stats.cache_hit)
            if stats.cache_hit:
                continue
            stage.labels("encode").observe(stats.encode_ms / 1e3)
            stage.labels("encode_queue").observe(stats.queue_ms / 1e3)
            self.metrics.encoder_batch.observe(stats.batch_size)

    def _sent(self, prefill, request: PrefillRequest) -> Awaitable[PrefillResult]:
        """The prefill call, stamped with when it left: the worker times the hop in."""
        return self.links.call(prefill, "prefill", replace(request, sent_at_s=time.time()))
