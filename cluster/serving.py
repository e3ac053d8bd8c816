"""One config's serving inside an ingress replica: everything built from that config (the
prompt planner, the fleet client, router, supervisor, admission, metrics) and the request
flow that runs on it, from a request's body to its last token.

A replica holds one at a time. A redeploy that keeps the replica (cluster/app.py
`Ingress.reconfigure`) builds a new one and retires the old: requests already running finish
on the objects they started with, then the old one's loops stop and its owner tag is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import RayActorError, TaskCancelledError

from actors.types import TokenChunk
from cluster import arrival_gate, controller, front_door, leftovers, responses
from cluster.admit_lanes import AdmitLanes
from cluster.admitted import Admitted, Endpoint
from cluster.backpressure import Admission, Overloaded, Ticket, cluster_budgets
from cluster.body_budget import MB, BodyBudget, content_length
from cluster.config import ClusterConfig
from cluster.errors import RequestError, error_response, overloaded
from cluster.fleet_client import FleetClient
from cluster.metrics import Metrics
from cluster.metrics_share import MetricsShare
from cluster.placement import check_placement
from cluster.prompt_plan import PromptPlanner
from cluster.request_body import HeldBody
from cluster.request_log import RequestLog, RequestRecord
from cluster.request_path import RequestPath
from cluster.response_models import SSE_DONE, error_body, sse_event
from cluster.routing import LiveRouting
from cluster.stream_relay import MARKER, RELAY
from cluster.supervisor import Supervisor
from cluster.token_endpoints import TokenEndpoints
from router.router import Router

log = logging.getLogger(__name__)
# A client that leaves cancels its request's task; an await on a worker call then raises
# Ray's own TaskCancelledError instead of asyncio's (epd never cancels Ray tasks itself).
CLIENT_GONE = (asyncio.CancelledError, TaskCancelledError)
RETIRE_POLL_S = 0.2


async def _read_body(request: Request) -> bytes:
    """The body, not kept on `request`: Starlette's `body()` keeps it there until the response
    ends, a whole stream later (its media's text stays with the request, for a retry)."""
    return b"".join([chunk async for chunk in request.stream()])


def check_size(body: bytes, limit: int) -> None:
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


def same_model(a: ClusterConfig, b: ClusterConfig) -> bool:
    """Whether `b`'s prompts plan as `a`'s do: its planner may be reused."""
    return a.model.model_dump() == b.model.model_dump()


class Serving:
    def __init__(
        self,
        config: ClusterConfig,
        app_name: str,
        num_replicas: int,
        planner: PromptPlanner | None = None,
    ):
        """`num_replicas`: Serve's count of ingress replicas (each admits its share of the
        budgets); `planner`: the previous config's, when it plans the same model."""
        self.config = config
        self.config_sha1 = config.fingerprint()  # which config this replica serves
        self.metrics = Metrics(config.model.served_name, config.limits.request_timeout_s)
        self.request_log = RequestLog(config.server.log_requests, config.server.log_prompts)
        self.checkpoint = config.model.checkpoint_path  # resolved on this replica's node
        self.planner = planner or PromptPlanner(
            self.checkpoint, config.model.resolved_dtype, config.model.chat_template_file
        )
        self.tokens = TokenEndpoints(
            self.planner, config.model.served_name, config.model.max_model_len
        )
        # every modality has an encoder, and every pool a node type that can hold it: checked
        # before any actor starts
        config.encoder_modalities(self.planner.spec.modalities)
        check_placement(config)
        self.fleet = FleetClient(
            functools.partial(controller.attach, app_name, config, self.planner.spec.modalities),
            config,
        )
        self.router = self._router()
        self.supervisor = Supervisor(self.fleet, self.router)
        self.supervisor.follow(self.fleet.snapshot.changed_since(None))  # empty slots: unrouted
        self.shared_metrics = MetricsShare(
            self.fleet, self.metrics.exposition, self.router.booked_ms_totals
        )
        self.metrics.track_workers(lambda: self.supervisor.latest_stats)
        self.path = RequestPath(
            config,
            self.fleet,
            self.planner,
            self._routing(),
            self.metrics,
            self.supervisor.handle_lost,
        )
        limits = config.limits
        self.lanes = AdmitLanes(
            limits.max_admitting_text, limits.max_admitting_media, arrival_gate.num_unreached
        )
        # Serve's count lags a redeploy that changed it on a replica reconfigured in place (it
        # still says 1 where 2 now run), so this replica would route its first requests alone,
        # with the whole budget, until its first heartbeat: the controller's count as well.
        num_replicas = max(num_replicas, self.fleet.registered_replicas())
        self.admission = Admission(*self._budget_share(num_replicas))
        # the count the budgets are shared by: the controller's count, once it differs, resizes
        # them
        self.fleet.num_replicas = num_replicas
        self.fleet.on_replicas = lambda n: self.admission.resize(*self._budget_share(n))
        self.metrics.track_load(lambda: self.admission.waiting, lambda: self.admission.generating)
        self.bodies = BodyBudget(limits.max_request_bodies_mb * MB, limits.max_request_bytes)
        self.gate = arrival_gate.GateView(
            self.admission,
            self.lanes,
            config.server.api_key,
            limits.retry_after_s,
            limits.max_request_bytes,
            self.bodies,
        )
        self.gate.on_refused = self._refused_at_arrival
        front_door.publish_cap(config)  # HAProxy refuses past the requests budget itself
        self.media_budget = self.path.intake.media_budget
        self.metrics.track_media(lambda: self.media_budget.in_flight)

    def _router(self) -> Router:
        rc = self.config.router
        return Router(
            self.fleet.snapshot.infos,
            rc.build_priors(),
            rc.policy,
            seed=rc.seed,
            staleness_s=rc.staleness_s,
            dead_after_s=rc.dead_after_s,
            calibration=rc.build_calibration(),
            prefill_chunk_tokens=self.config.prefill.max_chunk_tokens,
            prefill_preempts=self.config.prefill.preempt_at_layers,
        )

    def _routing(self) -> LiveRouting:
        prefill = self.config.prefill
        prefix_block_tokens = prefill.prefix_block_tokens if prefill.prefix_cache_mb > 0 else 0
        return LiveRouting(
            self.router,
            self.metrics,
            self.planner.spec.embedding_bytes_per_token,
            prefix_block_tokens,
            shares=self.fleet,
            sync_above_ms=self.config.router.sync_above_ms,
        )

    def _budget_share(self, num_replicas: int) -> tuple[int, int]:
        """This replica's share of the cluster's back-pressure budgets (waiting prompt tokens,
        requests) when `num_replicas` share them."""
        share = max(num_replicas, 1)
        tokens, requests = cluster_budgets(self.config)
        return math.ceil(tokens / share), math.ceil(requests / share)

    def run_background(self) -> None:
        """Supervision (and so the controller heartbeat) and the metrics pushes."""
        self.supervisor.ensure_running()
        self.shared_metrics.ensure_running()

    @property
    def in_flight(self) -> bool:
        """Whether a request is still being admitted, waiting or generating here."""
        admission = self.admission
        return self.lanes.busy or admission.generating > 0 or admission.waiting_tokens > 0

    async def retire(self, fleet_retired: bool) -> None:
        """Once this config's requests have ended (or after the longest a request may run),
        stop its loops and free its owner tag, as if its replica had died: what its requests
        left on the workers goes, its counts join the app's retired sum.

        `fleet_retired`: the new config has a fleet of its own and retired this one's
        workers; a request that loses its worker then fails at once with a 503 that says so
        (retried, it runs on the new fleet) instead of waiting for a replacement until its
        deadline."""
        if fleet_retired:
            self.supervisor.stop()
            self.path.fleet_retired = (
                "a redeploy replaced the workers this request ran on (a new fleet config); retry"
            )
        deadline = time.monotonic() + self.config.limits.request_timeout_s + 5
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
        self.supervisor.stop()
        self.shared_metrics.stop()
        self.lanes.close()
        self.path.links.close()
        self.fleet.close()
        try:
            await self.fleet.controller.unregister.remote(self.fleet.owner)
        except RayActorError:
            pass  # its fleet was retired with its controller (the new config has another)

    async def serve(self, request: Request, endpoint: Endpoint, request_id: str) -> Response:
        """Every outcome is an answer in OpenAI's shape and a count in /metrics: a request
        error (4xx), back-pressure (429), a failure of ours (500, logged with its traceback),
        or a client that left (counted as aborted)."""
        self.run_background()
        # The server's clock starts where the HTTP server had the request (the gate's own
        # time, which includes its body's upload and Serve's hand-over to this thread).
        now_s, at_gate = time.perf_counter(), arrival_gate.reached(request.scope)
        arrived_s = at_gate.received_s if at_gate else now_s
        request.state.handover_ms = (now_s - at_gate.handed_s) * 1e3 if at_gate else 0.0
        request.state.relay = at_gate is not None  # the gate can stream a relayed answer
        request.state.body_charge = at_gate.body if at_gate else None
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
            self.admission.check_room(self.lanes.num_arriving)
            with self.lanes.arriving():
                adm = await self._admit(request, endpoint, request_id, arrived_s)
        except Overloaded as exc:
            raise self.overloaded(exc) from None
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
            events = sse = self._sse(
                collectors, responses.stream(shape, collectors, streams, self.metrics)
            )
            headers = None
            if request.state.relay:  # written by the HTTP server's loop (cluster/stream_relay.py)
                events = RELAY.pump(adm.request_id, sse, lambda: leftovers.close_soon(sse))
                headers = {MARKER.decode(): adm.request_id}
            return ClosingStreamingResponse(events, media_type="text/event-stream", headers=headers)
        answer = await responses.complete(shape, collectors, streams, self.metrics)
        self._log_done(collectors, "ok")
        return JSONResponse(answer.model_dump())

    async def _admit(
        self, request: Request, endpoint: Endpoint, request_id: str, arrived_s: float
    ) -> Admitted:
        # charged at the gate, or here when no gate saw it (Serve's own proxy)
        charge = request.state.body_charge or self.bodies.take(content_length(request.headers))
        try:
            body = await _read_body(request)
            # from arrival, less Serve's hand-over (a phase of its own in the timings)
            body_ms = (time.perf_counter() - arrived_s) * 1e3 - request.state.handover_ms
            check_size(body, self.config.limits.max_request_bytes)
            held, body = HeldBody(body), b""  # its parse lets it go: one copy of the media
            # Off the event loop, in a lane of its own: text never waits behind media decoding.
            adm = await self.lanes.run(held, self.path.admit, request_id, arrived_s, endpoint)
        finally:
            charge.release()  # the body is gone; its media are decoded (or refused)
        timings = dataclasses.replace(
            adm.timings, handover_ms=request.state.handover_ms, body_ms=body_ms
        )
        return dataclasses.replace(adm, timings=timings)

    def _tickets(self, adm: Admitted, num_choices: int) -> list[Ticket]:
        """One admission ticket per choice (each is a sequence on the workers), all or none."""
        tickets: list[Ticket] = []
        try:
            for _ in range(num_choices):
                tickets.append(self.admission.admit(len(adm.plan.token_ids)))
        except Overloaded as exc:
            for ticket in tickets:
                ticket.release()
            raise self.overloaded(exc) from None
        return tickets

    def _refused_at_arrival(self, request_id: str, x_request_id: str) -> None:
        """Counted and logged as `_fail` counts a 429 (called from the HTTP server's thread)."""
        self.metrics.requests.labels("429").inc()
        self.request_log.write(RequestRecord(request_id, "429", x_request_id=x_request_id))

    def overloaded(self, exc: Overloaded) -> RequestError:
        return overloaded(exc, self.config.limits.retry_after_s)

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
                trace.phases_ms(adm.timings) if trace.ttft_ms is not None else None,
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
        return error_response(exc)
