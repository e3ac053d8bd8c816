"""The Ray Serve application: an OpenAI-compatible HTTP ingress over the worker fleet.

Routes: POST /v1/chat/completions, GET /v1/models, GET /metrics, GET /health.
"""

import asyncio
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from actors.types import TokenChunk
from cluster import responses
from cluster.config import ClusterConfig
from cluster.fleet import Fleet
from cluster.metrics import Metrics
from cluster.prompt_plan import PromptPlanner
from cluster.protocol import ModelCard, ModelList, error_body, sse_event
from cluster.request_path import RequestError, RequestPath
from cluster.supervisor import Supervisor
from cluster.routing import LiveRouting
from router.router import Router
from router.types import WorkerKind

log = logging.getLogger(__name__)
api = FastAPI(title="epd")


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code), status_code=exc.status)


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, config: dict):
        self.config = ClusterConfig.model_validate(config)
        self.metrics = Metrics()
        self.planner = PromptPlanner(self.config.model.checkpoint_path, self.config.model.dtype)
        self.config.encoder_modalities(self.planner.spec.modalities)  # every modality has an encoder: check before any actor starts
        self.fleet = Fleet(self.config)
        rc = self.config.router
        workers = self.fleet.worker_infos(self.planner.spec.modalities)
        self.router = Router(workers, rc.build_priors(), rc.policy, seed=rc.seed, staleness_s=rc.staleness_s, dead_after_s=rc.dead_after_s)
        routing = LiveRouting(self.router, self.metrics, self.planner.spec.embedding_bytes_per_token)
        self.path = RequestPath(self.config, self.fleet, self.planner, routing, self.metrics)
        self.supervisor = Supervisor(self.fleet, self.router)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        self.supervisor.ensure_running()
        body = await request.body()
        if len(body) > self.config.limits.max_request_bytes:
            return self._fail(RequestError(413, f"request body is {len(body)} bytes; the limit is {self.config.limits.max_request_bytes}"))
        try:
            adm = await asyncio.to_thread(self.path.admit, body)  # media decoding must not stall the loop
            collector = responses.Collector(adm, self.planner.tokenizer, self.metrics)
            chunks = self.path.run(adm, collector.trace)
            first = await asyncio.wait_for(anext(chunks), timeout=self.config.limits.request_timeout_s)
        except RequestError as exc:
            return self._fail(exc)
        except asyncio.TimeoutError:
            return self._fail(RequestError(504, "the request timed out before its first token", type="server_error"))
        stream = self._guarded(first, chunks)
        if adm.request.stream:
            return StreamingResponse(self._sse(collector, stream), media_type="text/event-stream")
        try:
            completion = await responses.complete(collector, stream)
        except RequestError as exc:
            return self._fail(exc)
        return JSONResponse(completion.model_dump())

    async def _guarded(self, first: TokenChunk, rest: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        yield first
        if not first.finished:
            async for chunk in rest:
                yield chunk
        await rest.aclose()

    async def _sse(self, collector: responses.Collector, stream: AsyncIterator[TokenChunk]) -> AsyncIterator[bytes]:
        try:
            async for event in responses.stream(collector, stream):
                yield event
        except RequestError as exc:  # headers are gone: report in-band, as OpenAI does
            self.metrics.requests.labels(str(exc.status)).inc()
            yield sse_event(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
            yield b"data: [DONE]\n\n"

    def _fail(self, exc: RequestError) -> JSONResponse:
        self.metrics.requests.labels(str(exc.status)).inc()
        return _error(exc)

    @api.get("/v1/models")
    async def models(self) -> dict:
        card = ModelCard(id=self.config.model.served_name, root=str(self.config.model.checkpoint_path))
        return ModelList(data=[card]).model_dump()

    @api.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @api.get("/health")
    async def health(self, verbose: bool = False) -> JSONResponse:
        """Liveness of the fleet; `?verbose=1` adds each worker's own stats."""
        self.supervisor.ensure_running()
        healthy = {kind.value: sum(self.router.view.healthy[kind]) for kind in WorkerKind}
        ok = all(healthy.values())
        body = {"status": "ok" if ok else "degraded", "healthy_workers": healthy}
        if verbose:
            body["workers"] = {kind.value: await asyncio.gather(*[a.stats.remote() for a in self.fleet.pools[kind]]) for kind in WorkerKind}
        return JSONResponse(body, status_code=200 if ok else 503)


def build_app(config: ClusterConfig):
    return Ingress.bind(config.model_dump(mode="json"))
