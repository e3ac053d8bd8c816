"""What a worker failure under a request means: which worker is gone, and that the request
may go on elsewhere.

A system failure (the actor died or cannot be reached, an object it held is lost) is the
worker's, not the request's: the request path reports the worker and resumes the request
on healthy workers. An exception raised by the worker's own code (`RayTaskError`) belongs
to the request and is not retried.
"""

from __future__ import annotations

import asyncio

import ray.exceptions as rx

from cluster.errors import RequestError
from router.types import RouteDecision, WorkerKind

# Failures that say a worker (or what it held) is gone, whatever the request was.
RETRYABLE = (rx.RayActorError, rx.ActorUnavailableError, rx.ObjectLostError, rx.OwnerDiedError)


# What Ray 2.60 raises for a call that moves tensors over a group destroyed after a hung transfer:
# naming the receiving actor, or (a transfer from an actor of the old group) both.
_GROUP_GONE = ("does not have tensor transport", "No communicators found for actors")
# Gloo's TCP transport names its own source file in every error it raises (a peer that closed
# its end as Ray destroyed the group under a hung transfer, a reset, a timeout).
_GLOO_TRANSPORT = "gloo/transport/"


def is_transport_failure(exc: BaseException) -> bool:
    """A tensor transfer between workers failed (Ray RDT over gloo/nccl): Ray aborts a hung
    transfer, kills both actors and destroys the collective group, so calls that move tensors
    raise until the group is formed again. The worker is gone, not the request."""
    if isinstance(exc, ValueError):  # a call made after the group was destroyed
        return any(words in str(exc) for words in _GROUP_GONE)
    cause = getattr(exc, "cause", None) if isinstance(exc, rx.RayTaskError) else None
    if isinstance(cause, RuntimeError) and _GLOO_TRANSPORT in str(cause):
        return True  # a transfer cut off under the call
    if isinstance(cause, RETRYABLE):
        return True  # a worker's own hand-over found the next one gone (an encoder's push)
    return isinstance(cause, TimeoutError) and "RDT object store" in str(
        cause
    )  # a receive whose transfer was aborted


def worker_code_failure(exc: rx.RayTaskError) -> BaseException:
    """What an exception from a worker's own code means for the request. A cancelled call
    means its client left: epd never cancels a worker call itself, Ray does when the client of
    the request that made the call disconnects. Anything else is a 500 that names it."""
    if isinstance(exc.cause, (rx.TaskCancelledError, asyncio.CancelledError)):
        return asyncio.CancelledError()
    return RequestError(500, f"a worker failed on this request: {exc.cause!r}", type="server_error")


class WorkerLost(Exception):
    """A worker died under a request. `suspects` are the workers it may be: the one Ray
    named, or else every worker the request used (the supervisor pings them)."""

    def __init__(self, suspects: list[tuple[WorkerKind, int]], cause: BaseException):
        self.suspects, self.cause = suspects, cause
        named = len(suspects) == 1
        self.kind = suspects[0][0].value if named else "unknown"  # the retries metric's label
        where = f"{self.kind} worker {suspects[0][1]}" if named else "a worker"
        super().__init__(f"{where} failed ({type(cause).__name__})")


def _decision_workers(decision: RouteDecision) -> list[tuple[WorkerKind, int]]:
    encoders = {decision.encoder_for(item.modality) for item in decision.items}
    return [(WorkerKind.ENCODER, e) for e in sorted(encoders)] + [
        (WorkerKind.PREFILL, decision.prefill),
        (WorkerKind.DECODE, decision.decode),
    ]


def lost_worker(exc: BaseException, fleet, decision: RouteDecision) -> WorkerLost:
    """Name the worker behind `exc`, by the dead actor's id where Ray gives it."""
    used = _decision_workers(decision)
    actor_id = getattr(exc, "actor_id", None)
    named = [
        (kind, index)
        for kind, index in used
        if actor_id is not None and fleet.actor_id(kind, index) == actor_id
    ]
    return WorkerLost(named or used, exc)
