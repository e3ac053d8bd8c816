"""One request's path through the cluster, top-down:

admit (parse, validate, decode media, identify, plan the prompt) -> route -> encode
-> prefill -> decode, yielding the request's tokens as TokenChunks. Tensors never come
here: embeddings and KV move worker-to-worker as refs this module only passes along.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import ray
from pydantic import ValidationError

from actors.media import MediaError, MediaOptions, PixelBudget, VideoSampling, load_media_item
from actors.types import DecodeRequest, EncodeJob, MediaItem, PrefillRequest, PrefillResult, SamplingParams, TokenChunk
from actors.decode_state import finish_reason, Sequence
from cluster.config import ClusterConfig, Transport
from cluster.fleet import Fleet
from cluster.metrics import Metrics
from cluster.prompt_plan import PromptError, PromptPlan, PromptPlanner
from cluster.protocol import ChatCompletionRequest, to_template_messages, validation_error_message
from cluster.routing import LiveRouting, RoutingUnavailable
from cluster.trace import TraceWriter
from router.types import RequestProfile, RouteDecision, WorkerKind


class RequestError(Exception):
    """Ends a request with an HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


@dataclass(frozen=True)
class Admitted:
    request_id: str
    request: ChatCompletionRequest
    items: tuple[MediaItem, ...]
    plan: PromptPlan
    sampling: SamplingParams
    arrived_s: float


@dataclass
class Trace:
    """Per-request timings, filled in as the request moves (ms since arrival unless noted)."""

    route: RouteDecision | None = None
    profile: RequestProfile | None = None
    ttft_ms: float | None = None
    encode_ms: float = 0.0
    prefill_ms: float = 0.0
    prefill_queue_ms: float = 0.0


class RequestPath:
    def __init__(self, config: ClusterConfig, fleet: Fleet, planner: PromptPlanner, routing: LiveRouting, metrics: Metrics):
        self.config, self.fleet, self.planner = config, fleet, planner
        self.routing, self.metrics = routing, metrics
        self.trace = TraceWriter(config.server.trace_path) if config.server.trace_path else None

    # -- 1. admit -------------------------------------------------------------------------
    def admit(self, body: bytes) -> Admitted:
        arrived = time.perf_counter()
        request = self._parse(body)
        if request.model != self.config.model.served_name:
            raise RequestError(404, f"model {request.model!r} does not exist; this server serves {self.config.model.served_name!r}", "model", code="model_not_found")
        hf_messages, media = to_template_messages(request.messages)
        plan = self._plan(hf_messages, tuple(self._decode_media(media)))
        sampling = request.to_sampling_params(
            default_max_tokens=self.config.limits.default_max_tokens, stop_token_ids=self.planner.eos_token_ids
        )
        return Admitted(f"chatcmpl-{uuid.uuid4().hex}", request, plan.items, plan, sampling, arrived)

    @staticmethod
    def _parse(body: bytes) -> ChatCompletionRequest:
        try:
            raw = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"request body is not valid JSON: {exc}") from None
        try:
            return ChatCompletionRequest.model_validate(raw)
        except ValidationError as exc:
            message, param = validation_error_message(exc)
            raise RequestError(400, message, param) from None

    def _media_options(self) -> MediaOptions:
        """The served model's input shape: its audio rate and the configured video sampling."""
        media = self.config.media
        return MediaOptions(audio_sample_rate_hz=self.planner.spec.audio_sample_rate_hz,
                            video_sampling=VideoSampling(fps=media.video_fps, max_frames=media.video_max_frames))

    def _decode_media(self, media) -> list[MediaItem]:
        limits, options = self.config.limits, self._media_options()
        if len(media) > limits.max_items_per_request:
            raise RequestError(400, f"request has {len(media)} media items; the limit is {limits.max_items_per_request}", "messages")
        items, budget = [], PixelBudget(limits.max_request_pixels)  # shared by the request's items
        for part in media:
            if part.modality not in self.planner.spec.modalities:
                raise RequestError(400, f"model {self.config.model.served_name!r} does not take {part.modality.value} input", part.param)
            try:
                items.append(load_media_item(part.modality, part.payload, namespace=self.config.model.served_name,
                                             limits=limits, param=part.param, format=part.format, options=options, budget=budget))
            except MediaError as exc:
                raise RequestError(400, exc.message, exc.param) from None
        return items

    def _plan(self, hf_messages: list[dict], items: tuple[MediaItem, ...]) -> PromptPlan:
        try:
            plan = self.planner.plan(hf_messages, list(items))
        except PromptError as exc:
            raise RequestError(400, str(exc), "messages") from None
        limit = self.config.model.max_model_len
        if len(plan.token_ids) >= limit:
            raise RequestError(400, f"prompt is {len(plan.token_ids)} tokens; this model's context is {limit} tokens", "messages", code="context_length_exceeded")
        return plan

    # -- 2. route ---------------------------------------------------------------------------
    def route(self, adm: Admitted, trace: Trace) -> RouteDecision:
        trace.profile = self.routing.profile(adm.items, adm.plan, adm.sampling.max_tokens)
        try:
            trace.route = self.routing.route(trace.profile)
        except RoutingUnavailable as exc:
            raise RequestError(503, str(exc), type="server_error") from None
        return trace.route

    # -- 3..5. encode, prefill, decode --------------------------------------------------------
    async def run(self, adm: Admitted, trace: Trace) -> AsyncIterator[TokenChunk]:
        decision = self.route(adm, trace)
        prefilled = False
        try:
            encoded = self.encode(adm, decision)
            result, transfer_ms = await self.prefill(adm, decision, encoded)
            prefilled = True
            self.routing.prefill_finished(decision, result, transfer_ms)
            self._record_prefill(result, trace)
            first = self._first_chunk(adm, result)
            trace.ttft_ms = (time.perf_counter() - adm.arrived_s) * 1e3
            self.routing.record_ttft(decision, trace.ttft_ms)
            if self.trace is not None:
                self.trace.record(adm.arrived_s, trace.profile, decision, trace.ttft_ms, timings=trace)
            yield first
            if first.finished:
                self.fleet.pools[WorkerKind.PREFILL][decision.prefill].drop.remote(adm.request_id)
            else:
                async for chunk in self.decode(adm, decision, result):
                    yield chunk
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise RequestError(503, f"a worker failed while serving this request: {type(exc).__name__}", type="server_error") from None
        finally:
            self.routing.release(decision, before_prefill=not prefilled)

    def encode(self, adm: Admitted, decision: RouteDecision) -> list:
        """One encode call per item, on the encoder of its modality (pools may be split by
        modality); each encoder batches them with other requests' items."""
        encoders = self.fleet.pools[WorkerKind.ENCODER]
        option = self.fleet.transport_option(self.config.transport.embeddings)
        return [encoders[decision.encoder_for(item.modality.value)].encode.options(**option).remote(EncodeJob(adm.request_id, item, n))
                for item, n in zip(adm.items, adm.plan.num_embeddings)]

    async def deliver(self, kind: WorkerKind, index: int, request_id: str, refs: list, transport) -> list:
        """Hand tensors (as refs) to a worker's inbox, one receive call per item; they move
        worker-to-worker, never here. Returns each receive's answer."""
        worker = self.fleet.pools[kind][index]
        calls = lambda: [worker.receive.remote(request_id, slot, ref) for slot, ref in enumerate(refs)]
        if transport == Transport.OBJECT_STORE:
            return await asyncio.gather(*calls())
        async with self.fleet.receiving(kind, index, transport):
            # One transfer at a time into an actor: gloo pairs sends and receives by order
            # alone, and Ray issues concurrent ones in no fixed order (equal sizes swap silently).
            return [await worker.receive.remote(request_id, slot, ref) for slot, ref in enumerate(refs)]

    async def prefill(self, adm: Admitted, decision: RouteDecision, encoded: list) -> tuple[PrefillResult, float | None]:
        """The prefill result, and how long the embeddings took from encoder to prefill worker."""
        prefill = self.fleet.pools[WorkerKind.PREFILL][decision.prefill]
        received_at = None
        if encoded:
            received_at = max(await self.deliver(WorkerKind.PREFILL, decision.prefill, adm.request_id, encoded, self.config.transport.embeddings))
        request = PrefillRequest(adm.request_id, adm.plan.token_ids, adm.plan.placeholders, adm.sampling)
        try:
            result = await prefill.prefill.remote(request)
        except BaseException:
            prefill.drop.remote(adm.request_id)
            raise
        ready_at = max((s.finished_at_s for s in result.encode_stats if not s.cache_hit), default=None)
        transfer_ms = (received_at - ready_at) * 1e3 if received_at and ready_at else None
        return result, (max(transfer_ms, 0.0) if transfer_ms is not None else None)

    def _first_chunk(self, adm: Admitted, result: PrefillResult) -> TokenChunk:
        seq = Sequence(DecodeRequest(adm.request_id, result.num_prompt_tokens, result.first_token_id, adm.sampling), None, [result.first_token_id])
        return TokenChunk((result.first_token_id,), finish_reason(seq, self.config.model.max_model_len))

    async def decode(self, adm: Admitted, decision: RouteDecision, result: PrefillResult) -> AsyncIterator[TokenChunk]:
        prefill = self.fleet.pools[WorkerKind.PREFILL][decision.prefill]
        decoder = self.fleet.pools[WorkerKind.DECODE][decision.decode]
        kv_ref = prefill.pop_kv.options(**self.fleet.transport_option(self.config.transport.kv)).remote(adm.request_id)
        request = DecodeRequest(adm.request_id, result.num_prompt_tokens, result.first_token_id, adm.sampling, result.rope_delta)
        finished = False
        try:
            await self.deliver(WorkerKind.DECODE, decision.decode, adm.request_id, [kv_ref], self.config.transport.kv)
            stream = decoder.generate.options(num_returns="streaming").remote(request)
            async for ref in stream:
                chunk: TokenChunk = await ref
                if chunk.step_ms:
                    self.metrics.stage.labels("decode_step").observe(chunk.step_ms / 1e3)
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:  # the client left or a stop string matched: free the batch row
                decoder.abort.remote(adm.request_id)

    def _record_prefill(self, result: PrefillResult, trace: Trace) -> None:
        stage = self.metrics.stage
        stage.labels("prefill").observe(result.prefill_ms / 1e3)
        stage.labels("prefill_queue").observe(result.queue_ms / 1e3)
        for stats in result.encode_stats:
            self.metrics.encoder_cache.labels("hit" if stats.cache_hit else "miss").inc()
            if stats.cache_hit:
                continue
            stage.labels("encode").observe(stats.encode_ms / 1e3)
            stage.labels("encode_queue").observe(stats.queue_ms / 1e3)
            self.metrics.encoder_batch.observe(stats.batch_size)
        trace.encode_ms = max((s.queue_ms + s.encode_ms for s in result.encode_stats), default=0.0)
        trace.prefill_ms, trace.prefill_queue_ms = result.prefill_ms, result.queue_ms
        self.metrics.prompt_tokens.inc(result.num_prompt_tokens)
