"""The Ray Serve application: an OpenAI-compatible HTTP ingress over the worker fleet.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (and /v1/models/{id}),
POST /tokenize, POST /detokenize, GET /metrics, GET /health.

The epd config reaches the replicas as the deployment's `user_config`, under a version that
changes only with epd's code: a redeploy with a new config (a new key, new limits, even
another fleet) reconfigures the running replicas in place (`Ingress.reconfigure`) instead of
replacing them, so nothing re-imports and no stream in flight moves.
"""

import asyncio
import functools
import hashlib
import logging
import os
import random
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from actors.thread_priority import set_process_niceness, thread_niceness
from cluster import arrival_gate
from cluster.admitted import Endpoint
from cluster.api_key import ApiKeyMiddleware
from cluster.backpressure import Overloaded
from cluster.config import REPO_ROOT, ClusterConfig, load_config
from cluster.errors import RequestError, error_response
from cluster.front_door import replica_runtime_env, resync_cap
from cluster.metrics import PREFIX
from cluster.prepare import prepare
from cluster.request_path import RETRY_AFTER_S
from cluster.response_models import ModelCard, ModelList
from cluster.serve_replicas import serve_replicas
from cluster.serving import Serving, check_size, same_model
from cluster.stream_relay import RELAY
from router.types import WorkerKind

log = logging.getLogger(__name__)
api = FastAPI(title="epd")
api.add_middleware(ApiKeyMiddleware)
HEALTH_POLL_TIMEOUT_S = 2.0
CODE_PACKAGES = ("actors", "cluster", "router")


@functools.cache
def code_version() -> str:
    """A digest of epd's own source: the replicas' code version in Serve. A redeploy with the
    same code only reconfigures them; changed code replaces them."""
    digest = hashlib.sha1()
    for package in CODE_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_IDS = random.Random()  # seeded from os.urandom once: no syscall per request, as uuid4 makes


def _request_id() -> str:
    return f"{_IDS.getrandbits(128):032x}"


# Defined before the class: Serve pickles the deployment's class as it is decorated.
def _ingress_report(serving: Serving) -> dict:
    """/health?verbose=1's view of this replica: its config, admission and media budget."""
    model = {"model_name": serving.config.model.served_name}
    served = serving.metrics.registry.get_sample_value(
        f"{PREFIX}requests_total", {**model, "status": "ok"}
    )
    syncs = {  # this replica's own: /metrics sums every replica's
        outcome: int(
            serving.metrics.registry.get_sample_value(
                f"{PREFIX}route_syncs_total", {**model, "outcome": outcome}
            )
            or 0
        )
        for outcome in ("shared", "unanswered")
    }
    admission = serving.admission
    return {
        "pid": os.getpid(),
        "niceness": thread_niceness(),  # of the thread answering (server.ingress_niceness)
        "config_sha1": serving.config_sha1,
        "waiting_tokens": admission.waiting_tokens,
        "generating": admission.generating,
        "max_generating": admission.max_generating,  # its share of the budget
        "num_replicas": serving.fleet.num_replicas,  # the count that share is taken for
        "served_ok": int(served or 0),
        "media_bytes_in_flight": serving.media_budget.in_flight,
        "media_waiting": serving.media_budget.num_waiting,
        "body_bytes_in_flight": serving.bodies.in_flight,  # bodies being read and admitted
        "route_syncs": syncs,
        "refused_at_arrival": serving.gate.num_refused,  # by the HTTP server's gate
        **RELAY.stats(),  # relayed streams still open (zero when idle)
    }


# Far above what admission lets run: a request must reach our checks to get its 429 at once,
# not wait in the proxy for a replica slot (1,024 held a burst of 1,500 for seconds).
@serve.deployment(max_ongoing_requests=8192, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self):
        self.serving: Serving | None = None  # built by reconfigure, which Serve calls next
        self._retiring: set[asyncio.Task] = set()

    async def reconfigure(self, config: dict) -> None:
        """Serve calls this after __init__ and on every redeploy that changes the config
        alone. The new config's serving is built off the event loop (the model's processor
        loads, a new fleet may be waited for) while requests go on; then it takes over, and
        the old one retires once the requests it holds have ended."""
        new = ClusterConfig.model_validate(config)
        set_process_niceness(new.server.ingress_niceness)  # threads started later inherit it
        old = self.serving
        if old is not None and old.config_sha1 == new.fingerprint():
            return
        context = serve.get_replica_context()
        # Serve's replica count, whatever set it (a Serve config may override
        # server.num_replicas): checked against the transports before any actor starts.
        replicas = serve_replicas(new, context._deployment_config)
        planner = old.planner if old is not None and same_model(old.config, new) else None
        self.serving = await asyncio.to_thread(Serving, new, context.app_name, replicas, planner)
        arrival_gate.register(self.serving.gate)
        api.state.api_key = new.server.api_key
        if old is not None:
            log.info("reconfigured in place: %s -> %s", old.config_sha1, new.fingerprint())
            fleet_retired = old.config.fleet_fingerprint() != new.fleet_fingerprint()
            task = asyncio.get_running_loop().create_task(old.retire(fleet_retired))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def check_health(self) -> None:
        """Serve's periodic replica check: also starts supervision (and so the controller
        heartbeat) and the metrics pushes in a replica that has had no request yet, and sets
        HAProxy's cap again (off the loop: a socket round trip)."""
        self.serving.run_background()
        await asyncio.to_thread(resync_cap, self.serving.config)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self.serving.serve(request, Endpoint.CHAT, f"chatcmpl-{_request_id()}")

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.serving.serve(request, Endpoint.COMPLETIONS, f"cmpl-{_request_id()}")

    @api.get("/v1/models")
    async def models(self) -> dict:
        return ModelList(data=[self._card()]).model_dump()

    @api.get("/v1/models/{model_id:path}")  # a Hub repo id has a slash in it
    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.serving.config.model.served_name:
            missing = RequestError(
                404, f"The model {model_id!r} does not exist", "model", code="model_not_found"
            )
            return error_response(missing)
        return JSONResponse(self._card().model_dump())

    def _card(self) -> ModelCard:
        model = self.serving.config.model
        root = str(self.serving.checkpoint)
        return ModelCard(id=model.served_name, root=root, max_model_len=model.max_model_len)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        return await self._token_route(request, "tokenize")

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        return await self._token_route(request, "detokenize")

    async def _token_route(self, request: Request, route: str) -> JSONResponse:
        """In an admission lane (bounded, off the event loop: a chat template takes
        milliseconds); left out of the request metrics, which count generation."""
        serving = self.serving
        try:
            body = await request.body()
            serving = self.serving  # the newest: one retired meanwhile has closed its lanes
            check_size(body, serving.config.limits.max_request_bytes)
            return JSONResponse(await serving.lanes.run(body, getattr(serving.tokens, route)))
        except Overloaded as exc:
            return error_response(serving.overloaded(exc))
        except RequestError as exc:
            return error_response(exc)
        except Exception:
            log.exception("%s failed", request.url.path)
            failed = RequestError(500, f"internal error in {request.url.path}", type="server_error")
            return error_response(failed)

    @api.api_route(
        "/metrics", methods=["GET", "HEAD"]
    )  # AIPerf's server-metrics discovery probes with HEAD
    async def metrics_endpoint(self) -> Response:
        """The whole app's metrics, whichever replica answers (cluster/metrics_share.py)."""
        serving = self.serving
        serving.run_background()
        body = (
            await serving.shared_metrics.exposition() + serving.metrics.worker_exposition()
        )  # workers' series once, not per replica
        return Response(body, media_type="text/plain; version=0.0.4")

    @api.get("/health")
    async def health(self, verbose: bool = False) -> JSONResponse:
        """200 while every stage has a healthy worker ("ok", or "degraded" while one restarts),
        503 with Retry-After when a stage has none. `?verbose=1` adds each worker's own stats
        (or why it could not give them) and this ingress's process."""
        serving = self.serving
        serving.run_background()
        stats = await serving.supervisor.check(HEALTH_POLL_TIMEOUT_S)  # a known death counts now
        healthy = {kind.value: sum(serving.router.view.healthy[kind]) for kind in WorkerKind}
        up = all(healthy.values())
        whole = up and not serving.supervisor.restarting
        body = {
            "status": "ok" if whole else ("degraded" if up else "unavailable"),
            "healthy_workers": healthy,
        }
        if verbose:
            body["workers"] = {kind.value: stats[kind] for kind in WorkerKind}
            body["ingress"] = _ingress_report(serving)
            snapshot = serving.fleet.snapshot
            body["fleet"] = {
                "generation": snapshot.generation,
                "actor_ids": {kind.value: list(snapshot.actor_ids[kind]) for kind in WorkerKind},
                "pools": snapshot.pool_sizes(),
            }
        headers = {} if up else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(body, status_code=200 if up else 503, headers=headers)


def build_app(config: ClusterConfig):
    """The config travels as `user_config` under epd's code version: Serve's lightweight
    update, a reconfigure of the running replicas (Serve names a code version itself only in
    a declarative Serve config; `version` is internal API here, hence `_internal`). A change
    of replica count adds or removes replicas; a change of the front door's runtime env
    replaces them, and their requests may then run as long as a request may while they
    drain (Serve's 20 s default would cut long generations short)."""
    door = config.server.front_door
    return Ingress.options(
        num_replicas=config.server.num_replicas,
        ray_actor_options={**Ingress.ray_actor_options, "runtime_env": replica_runtime_env(door)},
        graceful_shutdown_timeout_s=config.limits.request_timeout_s + 5,
        user_config=config.model_dump(mode="json"),
        version=code_version(),
        logging_config={"enable_access_log": config.server.serve_access_log},
        _internal=True,
    ).bind()


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
