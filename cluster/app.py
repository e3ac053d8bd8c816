"""The Ray Serve application: an OpenAI-compatible HTTP ingress over the worker fleet.

Routes: POST /v1/chat/completions, GET /v1/models, GET /metrics, GET /health.
"""

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import TaskCancelledError

from actors.types import TokenChunk
from cluster import responses
from cluster.config import ClusterConfig
from cluster.fleet import Fleet
from cluster.metrics import Metrics
from cluster.prompt_plan import PromptPlanner
from cluster.admission import Admission, Overloaded, Ticket
from cluster.protocol import SSE_DONE, ModelCard, ModelList, error_body, sse_event
from cluster.request_path import RETRY_AFTER_S, RequestError, RequestPath
from cluster.supervisor import Supervisor
from cluster.routing import LiveRouting
from router.router import Router
from router.types import WorkerKind

log = logging.getLogger(__name__)
api = FastAPI(title="epd")
HEALTH_POLL_TIMEOUT_S = 2.0
ADMIT_THREADS = 32  # parse + plan + media decode; the decode slots (limits.max_concurrent_decodes) bound the heavy part
# A client that leaves cancels its request's task; an await on a worker call then raises
# Ray's own TaskCancelledError instead of asyncio's (epd never cancels Ray tasks itself).
CLIENT_GONE = (asyncio.CancelledError, TaskCancelledError)


def _error(exc: RequestError, request_id: str) -> JSONResponse:
    headers = {"x-request-id": request_id}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    body = error_body(exc.message, type=exc.type, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=headers)


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, config: dict):
        self.config = ClusterConfig.model_validate(config)
        self.config_sha1 = self.config.fingerprint()  # which config this replica serves (rolling updates)
        self.metrics = Metrics()
        self.planner = PromptPlanner(self.config.model.checkpoint_path, self.config.model.dtype)
        self.config.encoder_modalities(self.planner.spec.modalities)  # every modality has an encoder: check before any actor starts
        self.fleet = Fleet(self.config)
        rc = self.config.router
        workers = self.fleet.worker_infos(self.planner.spec.modalities)
        self.router = Router(workers, rc.build_priors(), rc.policy, seed=rc.seed, staleness_s=rc.staleness_s, dead_after_s=rc.dead_after_s)
        prefix_block_tokens = self.config.prefill.prefix_block_tokens if self.config.prefill.prefix_cache_mb > 0 else 0
        routing = LiveRouting(self.router, self.metrics, self.planner.spec.embedding_bytes_per_token, prefix_block_tokens)
        self.supervisor = Supervisor(self.fleet, self.router)
        self.path = RequestPath(self.config, self.fleet, self.planner, routing, self.metrics, self.supervisor.handle_lost)
        limits = self.config.limits
        self._admit_pool = ThreadPoolExecutor(max_workers=ADMIT_THREADS, thread_name_prefix="admit")
        self.admission = Admission(limits.max_waiting_tokens_per_prefill_worker * self.config.prefill.num_workers,
                                   limits.max_generating_per_decode_worker * self.config.decode.num_workers)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        """Every outcome is an answer in OpenAI's shape and a count in /metrics: a request
        error (4xx), back-pressure (429), a failure of ours (500, logged with its traceback),
        or a client that left (counted as aborted)."""
        self.supervisor.ensure_running()
        request_id, arrived_s = f"chatcmpl-{uuid.uuid4().hex}", time.perf_counter()
        try:
            return await self._chat(request, request_id, arrived_s)
        except RequestError as exc:
            return self._fail(exc, request_id)
        except CLIENT_GONE:
            self.metrics.requests.labels("aborted").inc()
            raise
        except Exception:
            log.exception("request %s failed", request_id)
            return self._fail(RequestError(500, f"internal error while serving request {request_id}", type="server_error"), request_id)

    async def _chat(self, request: Request, request_id: str, arrived_s: float) -> Response:
        body = await request.body()
        if len(body) > self.config.limits.max_request_bytes:
            raise RequestError(413, f"request body is {len(body)} bytes; the limit is {self.config.limits.max_request_bytes}")
        # Media decoding must not stall the loop; admission has threads of its own, since
        # requests waiting for a decode slot must not hold up text-only ones.
        adm = await asyncio.get_running_loop().run_in_executor(self._admit_pool, self.path.admit, body, request_id, arrived_s)
        try:
            ticket = self.admission.admit(len(adm.plan.token_ids))
        except Overloaded as exc:
            raise RequestError(429, exc.message, type="rate_limit_error", code="server_overloaded",
                               retry_after_s=self.config.limits.retry_after_s) from None
        collector = responses.Collector(adm, self.planner.tokenizer, self.metrics)
        chunks = self._ticketed(ticket, self.path.run(adm, collector.trace))
        try:
            first = await self._first(chunks)
        except BaseException:
            ticket.release()  # also when `chunks` never started, so its own clean-up never runs
            responses.close_soon(chunks)
            raise
        stream = self._guarded(first, chunks)
        headers = {"x-request-id": request_id}
        if adm.request.stream:
            return StreamingResponse(self._sse(collector, stream), media_type="text/event-stream", headers=headers)
        completion = await responses.complete(collector, stream)
        return JSONResponse(completion.model_dump(), headers=headers)

    async def _first(self, chunks: AsyncIterator[TokenChunk]) -> TokenChunk:
        try:
            return await asyncio.wait_for(anext(chunks), timeout=self.config.limits.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(504, "the request timed out before its first token", type="server_error") from None

    @staticmethod
    async def _ticketed(ticket: Ticket, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """The request's tokens, holding its admission ticket until they end, however they
        end (also when a dropped response is only garbage-collected: asyncio closes it)."""
        try:
            async for chunk in chunks:
                ticket.first_token()
                yield chunk
        finally:
            ticket.release()
            responses.close_soon(chunks)

    @staticmethod
    async def _guarded(first: TokenChunk, rest: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """The whole token stream; however it ends, closing `rest` frees the request's workers."""
        try:
            yield first
            if not first.finished:
                async for chunk in rest:
                    yield chunk
        finally:
            responses.close_soon(rest)

    async def _sse(self, collector: responses.Collector, stream: AsyncIterator[TokenChunk]) -> AsyncIterator[bytes]:
        try:
            async for event in responses.stream(collector, stream):
                yield event
        except RequestError as exc:  # headers are gone: report in-band, as OpenAI does
            yield self._stream_error(exc)
        except (*CLIENT_GONE, GeneratorExit):
            self.metrics.requests.labels("aborted").inc()
            raise
        except Exception:
            log.exception("request %s failed while streaming", collector.adm.request_id)
            yield self._stream_error(RequestError(500, f"internal error while serving request {collector.adm.request_id}", type="server_error"))
        finally:
            responses.close_soon(stream)

    def _stream_error(self, exc: RequestError) -> bytes:
        self.metrics.requests.labels(str(exc.status)).inc()
        return sse_event(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code)) + SSE_DONE

    def _fail(self, exc: RequestError, request_id: str) -> JSONResponse:
        self.metrics.requests.labels(str(exc.status)).inc()
        if exc.status >= 500:
            log.warning("request %s: %d %s", request_id, exc.status, exc.message)
        return _error(exc, request_id)

    @api.get("/v1/models")
    async def models(self) -> dict:
        card = ModelCard(id=self.config.model.served_name, root=str(self.config.model.checkpoint_path))
        return ModelList(data=[card]).model_dump()

    @api.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @api.get("/health")
    async def health(self, verbose: bool = False) -> JSONResponse:
        """200 while every stage has a healthy worker ("ok", or "degraded" while one restarts),
        503 with Retry-After when a stage has none. `?verbose=1` adds each worker's own stats
        (or why it could not give them) and this ingress's process."""
        self.supervisor.ensure_running()
        stats = await self.supervisor.check(HEALTH_POLL_TIMEOUT_S)  # a death Ray knows of counts now
        healthy = {kind.value: sum(self.router.view.healthy[kind]) for kind in WorkerKind}
        serving = all(healthy.values())
        whole = serving and not self.supervisor.restarting
        body = {"status": "ok" if whole else ("degraded" if serving else "unavailable"), "healthy_workers": healthy}
        if verbose:
            body["workers"] = {kind.value: stats[kind] for kind in WorkerKind}
            body["ingress"] = {"pid": os.getpid(), "config_sha1": self.config_sha1, "waiting_tokens": self.admission.waiting_tokens, "generating": self.admission.generating}
        headers = {} if serving else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(body, status_code=200 if serving else 503, headers=headers)


def build_app(config: ClusterConfig):
    return Ingress.bind(config.model_dump(mode="json"))
