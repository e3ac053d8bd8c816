"""The Ray Serve application: an OpenAI-compatible HTTP ingress over the worker fleet.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (and /v1/models/{id}),
POST /tokenize, POST /detokenize, GET /metrics, GET /health.
"""

import asyncio
import dataclasses
import functools
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import TaskCancelledError

from actors.types import TokenChunk
from cluster import controller, leftovers, responses
from cluster.admit_lanes import AdmitLanes
from cluster.admitted import Admitted, Endpoint
from cluster.api_key import ApiKeyMiddleware
from cluster.backpressure import Admission, Overloaded, Ticket
from cluster.config import REPO_ROOT, ClusterConfig, load_config
from cluster.errors import RequestError
from cluster.fleet_client import FleetClient
from cluster.front_door import replica_runtime_env
from cluster.metrics import PREFIX, Metrics
from cluster.metrics_share import MetricsShare
from cluster.placement import check_placement
from cluster.prepare import prepare
from cluster.prompt_plan import PromptPlanner
from cluster.request_log import RequestLog, RequestRecord
from cluster.request_path import RETRY_AFTER_S, RequestPath
from cluster.response_models import SSE_DONE, ModelCard, ModelList, error_body, sse_event
from cluster.routing import LiveRouting
from cluster.serve_replicas import serve_replicas
from cluster.supervisor import Supervisor
from cluster.token_endpoints import TokenEndpoints
from router.router import Router
from router.types import WorkerKind

log = logging.getLogger(__name__)
api = FastAPI(title="epd")
api.add_middleware(ApiKeyMiddleware)
HEALTH_POLL_TIMEOUT_S = 2.0
# A client that leaves cancels its request's task; an await on a worker call then raises
# Ray's own TaskCancelledError instead of asyncio's (epd never cancels Ray tasks itself).
CLIENT_GONE = (asyncio.CancelledError, TaskCancelledError)


def _error(exc: RequestError, request_id: str) -> JSONResponse:
    # Serve adds the x-request-id; the request log line pairs it with `request_id`
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    body = error_body(exc.message, type=exc.type, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _check_size(body: bytes, limit: int) -> None:
    if len(body) > limit:
        raise RequestError(413, f"request body is {len(body)} bytes; the limit is {limit}")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends. Starlette leaves it suspended
    when a client's disconnect cancels a send, and then only the garbage collector would
    close it and free the request's KV (seconds later, or at the next collection)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            leftovers.close_soon(self.body_iterator)


# Far above what admission lets run: a request must reach our checks to get its 429 at once,
# not wait in the proxy for a replica slot (1,024 held a burst of 1,500 for seconds).
@serve.deployment(max_ongoing_requests=8192, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, config: dict):
        self.config = ClusterConfig.model_validate(config)
        # Serve's replica count, whatever set it (a Serve config may override
        # server.num_replicas): checked against the transports before any actor starts.
        replicas = serve_replicas(self.config, serve.get_replica_context()._deployment_config)
        self.config_sha1 = (
            self.config.fingerprint()
        )  # which config this replica serves (rolling updates)
        self.metrics = Metrics(self.config.model.served_name, self.config.limits.request_timeout_s)
        api.state.api_key = self.config.server.api_key
        self.request_log = RequestLog(
            self.config.server.log_requests, self.config.server.log_prompts
        )
        self.checkpoint = self.config.model.checkpoint_path  # resolved on this replica's node
        self.planner = PromptPlanner(
            self.checkpoint, self.config.model.resolved_dtype, self.config.model.chat_template_file
        )
        self.tokens = TokenEndpoints(
            self.planner, self.config.model.served_name, self.config.model.max_model_len
        )
        self.config.encoder_modalities(
            self.planner.spec.modalities
        )  # every modality has an encoder: check before any actor starts
        check_placement(self.config)  # and every pool has a node type that can hold it
        app_name = serve.get_replica_context().app_name
        self.fleet = FleetClient(
            functools.partial(
                controller.attach, app_name, self.config, self.planner.spec.modalities
            ),
            self.config,
        )
        rc = self.config.router
        self.router = Router(
            self.fleet.snapshot.infos,
            rc.build_priors(),
            rc.policy,
            seed=rc.seed,
            staleness_s=rc.staleness_s,
            dead_after_s=rc.dead_after_s,
            calibration=rc.build_calibration(),
        )
        prefix_block_tokens = (
            self.config.prefill.prefix_block_tokens
            if self.config.prefill.prefix_cache_mb > 0
            else 0
        )
        routing = LiveRouting(
            self.router,
            self.metrics,
            self.planner.spec.embedding_bytes_per_token,
            prefix_block_tokens,
        )
        self.supervisor = Supervisor(self.fleet, self.router)
        self.supervisor.follow(self.fleet.snapshot.changed_since(None))  # empty slots: unrouted
        self.shared_metrics = MetricsShare(
            self.fleet, self.metrics.exposition, self.router.booked_ms_totals
        )
        self.metrics.track_workers(lambda: self.supervisor.latest_stats)
        self.path = RequestPath(
            self.config,
            self.fleet,
            self.planner,
            routing,
            self.metrics,
            self.supervisor.handle_lost,
        )
        limits = self.config.limits
        self.lanes = AdmitLanes(limits.max_admitting_text, limits.max_admitting_media)
        self.admission = Admission(*self._budget_share(replicas))
        self.fleet.on_replicas = lambda n: self.admission.resize(*self._budget_share(n))
        self.metrics.track_load(lambda: self.admission.waiting, lambda: self.admission.generating)
        self.media_budget = self.path.intake.media_budget
        self.metrics.track_media(lambda: self.media_budget.in_flight)

    def _budget_share(self, num_replicas: int) -> tuple[int, int]:
        """This replica's share of the cluster's back-pressure budgets (waiting prompt tokens,
        generating requests) when `num_replicas` share them."""
        limits, share = self.config.limits, max(num_replicas, 1)
        # An autoscaled pool admits for the workers it may grow to: its load is what grows it.
        tokens = limits.max_waiting_tokens_per_prefill_worker * self.config.prefill.num_slots
        generating = limits.max_generating_per_decode_worker * self.config.decode.num_slots
        return math.ceil(tokens / share), math.ceil(generating / share)

    async def check_health(self) -> None:
        """Serve's periodic replica check: also starts supervision (and so the controller
        heartbeat) and the metrics pushes in a replica that has had no request yet."""
        self._run_background()

    def _run_background(self) -> None:
        self.supervisor.ensure_running()
        self.shared_metrics.ensure_running()

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, Endpoint.CHAT, f"chatcmpl-{uuid.uuid4().hex}")

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, Endpoint.COMPLETIONS, f"cmpl-{uuid.uuid4().hex}")

    async def _serve(self, request: Request, endpoint: Endpoint, request_id: str) -> Response:
        """Every outcome is an answer in OpenAI's shape and a count in /metrics: a request
        error (4xx), back-pressure (429), a failure of ours (500, logged with its traceback),
        or a client that left (counted as aborted)."""
        self._run_background()
        arrived_s = time.perf_counter()
        try:
            return await self._respond(request, endpoint, request_id, arrived_s)
        except RequestError as exc:
            return self._fail(exc, request_id)
        except CLIENT_GONE:
            self.metrics.requests.labels("aborted").inc()
            self.request_log.write(RequestRecord(request_id, "aborted"))
            raise
        except Exception:
            log.exception("request %s failed", request_id)
            return self._fail(
                RequestError(
                    500, f"internal error while serving request {request_id}", type="server_error"
                ),
                request_id,
            )

    async def _respond(
        self, request: Request, endpoint: Endpoint, request_id: str, arrived_s: float
    ) -> Response:
        try:  # before the body is even read: refusals of a burst come in microseconds
            self.admission.check_room()
            with self.lanes.arriving():
                adm = await self._admit(request, endpoint, request_id, arrived_s)
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        choices = adm.choices()
        tickets = self._tickets(adm, len(choices))
        collectors = [
            responses.Collector(choice, self.planner.tokenizer, self.metrics) for choice in choices
        ]
        for collector in collectors:
            collector.trace.admitted_ms = (time.perf_counter() - arrived_s) * 1e3
        chunks = [
            self._ticketed(t, self.path.run(choice, c.trace))
            for t, choice, c in zip(tickets, choices, collectors)
        ]
        try:
            firsts = await self._firsts(chunks)
        except BaseException:
            for ticket, stream in zip(tickets, chunks):
                ticket.release()  # also when `chunks` never started, so its own clean-up never runs
                leftovers.close_soon(stream)
            raise
        streams = [self._guarded(first, rest) for first, rest in zip(firsts, chunks)]
        shape = responses.Shape(adm, self.planner.tokenizer)
        if adm.request.stream:
            return ClosingStreamingResponse(
                self._sse(collectors, responses.stream(shape, collectors, streams, self.metrics)),
                media_type="text/event-stream",
            )
        answer = await responses.complete(shape, collectors, streams, self.metrics)
        self._log_done(collectors, "ok")
        return JSONResponse(answer.model_dump())

    async def _admit(
        self, request: Request, endpoint: Endpoint, request_id: str, arrived_s: float
    ) -> Admitted:
        body = await request.body()
        body_ms = (time.perf_counter() - arrived_s) * 1e3  # Serve pulls it from the proxy
        _check_size(body, self.config.limits.max_request_bytes)
        # Off the event loop, in a lane of its own: text never waits behind media decoding.
        adm = await self.lanes.run(body, self.path.admit, request_id, arrived_s, endpoint)
        return dataclasses.replace(adm, timings=dataclasses.replace(adm.timings, body_ms=body_ms))

    def _tickets(self, adm: Admitted, num_choices: int) -> list[Ticket]:
        """One admission ticket per choice (each is a sequence on the workers), all or none."""
        tickets: list[Ticket] = []
        try:
            for _ in range(num_choices):
                tickets.append(self.admission.admit(len(adm.plan.token_ids)))
        except Overloaded as exc:
            for ticket in tickets:
                ticket.release()
            raise self._overloaded(exc) from None
        return tickets

    def _overloaded(self, exc: Overloaded) -> RequestError:
        return RequestError(
            429,
            exc.message,
            type="rate_limit_error",
            code="server_overloaded",
            retry_after_s=self.config.limits.retry_after_s,
        )

    async def _firsts(self, chunks: list[AsyncIterator[TokenChunk]]) -> list[TokenChunk]:
        """Each choice's first token, all prefilled at once; a failure is raised once every
        choice has settled, so none is still running when the caller closes them."""
        if len(chunks) == 1:
            return [await self._first(chunks[0])]
        firsts = await asyncio.gather(*(self._first(c) for c in chunks), return_exceptions=True)
        if failed := next((f for f in firsts if isinstance(f, BaseException)), None):
            raise failed
        return firsts

    async def _first(self, chunks: AsyncIterator[TokenChunk]) -> TokenChunk:
        try:
            return await asyncio.wait_for(
                anext(chunks), timeout=self.config.limits.request_timeout_s
            )
        except asyncio.TimeoutError:
            raise RequestError(
                504, "the request timed out before its first token", type="server_error"
            ) from None

    @staticmethod
    async def _ticketed(
        ticket: Ticket, chunks: AsyncIterator[TokenChunk]
    ) -> AsyncIterator[TokenChunk]:
        """The request's tokens, holding its admission ticket until they end, however they
        end (also when a dropped response is only garbage-collected: asyncio closes it)."""
        try:
            async for chunk in chunks:
                ticket.first_token()
                yield chunk
        finally:
            ticket.release()
            leftovers.close_soon(chunks)

    @staticmethod
    async def _guarded(
        first: TokenChunk, rest: AsyncIterator[TokenChunk]
    ) -> AsyncIterator[TokenChunk]:
        """The whole token stream; however it ends, closing `rest` frees the request's workers."""
        try:
            yield first
            if not first.finished:
                async for chunk in rest:
                    yield chunk
        finally:
            leftovers.close_soon(rest)

    async def _sse(
        self, collectors: list[responses.Collector], events: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        status, request_id = "ok", collectors[0].adm.request_id
        try:
            async for event in events:
                yield event
        except RequestError as exc:  # headers are gone: report in-band, as OpenAI does
            status = str(exc.status)
            yield self._stream_error(exc)
        except (*CLIENT_GONE, GeneratorExit):
            status = "aborted"
            self.metrics.requests.labels("aborted").inc()
            raise
        except Exception:
            status = "500"
            log.exception("request %s failed while streaming", request_id)
            yield self._stream_error(
                RequestError(
                    500, f"internal error while serving request {request_id}", type="server_error"
                )
            )
        finally:
            self._log_done(collectors, status)
            leftovers.close_soon(events)

    def _log_done(self, collectors: list[responses.Collector], status: str) -> None:
        """One line per request: all choices' tokens, the first choice's TTFT and finish reason."""
        first = collectors[0]
        adm, trace = first.adm, first.trace
        prompt = (
            self.planner.tokenizer.decode(adm.plan.token_ids)
            if self.request_log.with_prompts
            else None
        )
        self.request_log.write(
            RequestRecord(
                adm.request_id,
                status,
                len(adm.plan.token_ids),
                sum(c.num_tokens for c in collectors),
                trace.ttft_ms,
                (time.perf_counter() - adm.arrived_s) * 1e3,
                first.finish_reason,
                prompt,
            )
        )

    def _stream_error(self, exc: RequestError) -> bytes:
        self.metrics.requests.labels(str(exc.status)).inc()
        return (
            sse_event(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
            + SSE_DONE
        )

    def _fail(self, exc: RequestError, request_id: str) -> JSONResponse:
        self.metrics.requests.labels(str(exc.status)).inc()
        self.request_log.write(RequestRecord(request_id, str(exc.status)))
        if exc.status >= 500:
            log.warning("request %s: %d %s", request_id, exc.status, exc.message)
        return _error(exc, request_id)

    def _card(self) -> ModelCard:
        return ModelCard(
            id=self.config.model.served_name,
            root=str(self.checkpoint),
            max_model_len=self.config.model.max_model_len,
        )

    @api.get("/v1/models")
    async def models(self) -> dict:
        return ModelList(data=[self._card()]).model_dump()

    @api.get("/v1/models/{model_id:path}")  # a Hub repo id has a slash in it
    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.config.model.served_name:
            missing = RequestError(
                404, f"The model {model_id!r} does not exist", "model", code="model_not_found"
            )
            return _error(missing, "")
        return JSONResponse(self._card().model_dump())

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        return await self._token_route(request, self.tokens.tokenize)

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        return await self._token_route(request, self.tokens.detokenize)

    async def _token_route(self, request: Request, answer) -> JSONResponse:
        """In an admission lane (bounded, off the event loop: a chat template takes
        milliseconds); left out of the request metrics, which count generation."""
        try:
            body = await request.body()
            _check_size(body, self.config.limits.max_request_bytes)
            return JSONResponse(await self.lanes.run(body, answer))
        except Overloaded as exc:
            return _error(self._overloaded(exc), "")
        except RequestError as exc:
            return _error(exc, "")
        except Exception:
            log.exception("%s failed", request.url.path)
            failed = RequestError(500, f"internal error in {request.url.path}", type="server_error")
            return _error(failed, "")

    @api.api_route(
        "/metrics", methods=["GET", "HEAD"]
    )  # AIPerf's server-metrics discovery probes with HEAD
    async def metrics_endpoint(self) -> Response:
        """The whole app's metrics, whichever replica answers (cluster/metrics_share.py)."""
        self._run_background()
        body = (
            await self.shared_metrics.exposition() + self.metrics.worker_exposition()
        )  # workers' series once, not per replica
        return Response(body, media_type="text/plain; version=0.0.4")

    @api.get("/health")
    async def health(self, verbose: bool = False) -> JSONResponse:
        """200 while every stage has a healthy worker ("ok", or "degraded" while one restarts),
        503 with Retry-After when a stage has none. `?verbose=1` adds each worker's own stats
        (or why it could not give them) and this ingress's process."""
        self._run_background()
        stats = await self.supervisor.check(
            HEALTH_POLL_TIMEOUT_S
        )  # a death Ray knows of counts now
        healthy = {kind.value: sum(self.router.view.healthy[kind]) for kind in WorkerKind}
        serving = all(healthy.values())
        whole = serving and not self.supervisor.restarting
        body = {
            "status": "ok" if whole else ("degraded" if serving else "unavailable"),
            "healthy_workers": healthy,
        }
        if verbose:
            body["workers"] = {kind.value: stats[kind] for kind in WorkerKind}
            served = (
                self.metrics.registry.get_sample_value(
                    f"{PREFIX}requests_total",
                    {"model_name": self.config.model.served_name, "status": "ok"},
                )
                or 0
            )
            body["ingress"] = {
                "pid": os.getpid(),
                "config_sha1": self.config_sha1,
                "waiting_tokens": self.admission.waiting_tokens,
                "generating": self.admission.generating,
                "max_generating": self.admission.max_generating,  # its share of the budget
                "served_ok": int(served),
                "media_bytes_in_flight": self.media_budget.in_flight,
                "media_waiting": self.media_budget.num_waiting,
            }
            snapshot = self.fleet.snapshot
            body["fleet"] = {
                "generation": snapshot.generation,
                "actor_ids": {kind.value: list(snapshot.actor_ids[kind]) for kind in WorkerKind},
                "pools": snapshot.pool_sizes(),
            }
        headers = {} if serving else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(body, status_code=200 if serving else 503, headers=headers)


def build_app(config: ClusterConfig):
    # A redeploy (a new key, new limits) drains the old replicas: their requests may run as
    # long as a request may (Serve's 20 s default would cut long generations short).
    door = config.server.front_door
    return Ingress.options(
        num_replicas=config.server.num_replicas,
        ray_actor_options={**Ingress.ray_actor_options, "runtime_env": replica_runtime_env(door)},
        graceful_shutdown_timeout_s=config.limits.request_timeout_s + 5,
    ).bind(config.model_dump(mode="json"))


class AppArgs(BaseModel):
    """The `args` of the Serve application in configs/serve.yaml (serve run, serve deploy,
    KubeRay)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    config: str = Field(
        "configs/local_cpu.yaml",
        description="epd config file; a relative path is taken from the working directory if it "
        "is there, else from the epd checkout (serve deploy builds elsewhere).",
    )
    overrides: dict = Field(
        default_factory=dict,
        description="Sections or fields replaced in that config, e.g. "
        "{decode: {num_workers: 2}} (ClusterConfig.replace).",
    )


def app_builder(args: dict):
    """Serve's application builder (`import_path: cluster.app:app_builder`). The HTTP host and
    port come from the Serve config's http_options; server.host/port apply to `epd serve` only.
    Builds the config's built-in checkpoint here if it is missing (nodes build their own copy
    in cluster.yaml's setup) and pins a repo id to a commit, as `epd serve` does."""
    parsed = AppArgs.model_validate(args)
    path = Path(parsed.config).expanduser()
    config = load_config(path if path.is_absolute() or path.exists() else REPO_ROOT / path)
    config = config.replace(**parsed.overrides) if parsed.overrides else config
    return build_app(prepare(config))
