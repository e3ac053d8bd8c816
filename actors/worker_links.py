"""Call links to workers (actors/wire.py), from an ingress replica or from an encoder pushing
embeddings to a prefill worker: one per live actor, opened on first use, reopened for a
restarted worker (a new actor). What comes back looks as it would over a
Ray call: the worker's own exception as a `RayTaskError` (the request's failure), a broken
link as `ActorUnavailableError` naming the actor (the worker's, retried elsewhere). A worker
whose link cannot connect is called over Ray, with a warning, from then on."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import ray.exceptions as rx

from actors import wire

log = logging.getLogger(__name__)
T = TypeVar("T")


def detached(submit: Callable[..., T], *args) -> T:
    """`submit(*args)` (an actor method's `.remote`, or a task's creation), as a call the
    request's cancellation does not cancel: Ray finds a call's parent task in a context variable,
    and in an empty context it has none (why that matters: cluster/leftovers.py). Only the
    request path's own clean-up ends such a call: an abort the worker honours."""
    return contextvars.Context().run(submit, *args)


class WorkerLinks:
    def __init__(self, direct: bool = True, ring: bool = True):
        self.direct = direct
        self.ring = ring  # large call buffers through a shared-memory ring where it can
        self._links: dict[str, asyncio.Future] = {}  # actor id -> its CallLink, or None: Ray

    async def call(self, worker, method: str, *args):
        """`worker.method(*args)`, over the worker's link where there is one."""
        link = await self._link(worker) if self.direct else None
        if link is None:
            return await getattr(worker, method).remote(*args)
        try:
            return await link.call(method, *args)
        except wire.LinkClosed as exc:
            raise link_lost(worker, exc) from None
        except Exception as exc:  # noqa: BLE001 - raised by the worker's code
            # As ray.get raises it: also an instance of the worker's exception's class, so a
            # worker that lost a peer (ActorUnavailableError) reads as that here too.
            failure = rx.RayTaskError(method, f"{type(exc).__name__}: {exc}", exc)
            raise failure.as_instanceof_cause() from None

    def send(self, worker, method: str, *args) -> None:
        """`worker.method(*args)` with nobody waiting for it (a release): in a context of its
        own, so the request's cancellation does not cancel it; a failure is only logged."""
        sending = detached(asyncio.ensure_future, self.call(worker, method, *args))
        sending.add_done_callback(_log_failure)

    async def _link(self, worker) -> wire.CallLink | None:
        key = worker._actor_id.hex()
        opening = self._links.get(key)
        if opening is not None and opening.done() and _broken(opening):
            opening = None  # its worker restarted or its connection was cut: a new link
        if opening is None:  # shared: calls that come while it opens wait for the same one
            opening = self._links[key] = asyncio.ensure_future(_open(worker, self.ring))
        return await asyncio.shield(opening)

    def close(self) -> None:
        for opening in self._links.values():
            if opening.done() and not opening.cancelled() and opening.result() is not None:
                opening.result().close()
        self._links.clear()


def _log_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and (exc := sent.exception()) is not None:
        log.debug("a call nobody waited for failed: %r", exc)  # its worker's loss is seen elsewhere


def link_lost(worker, exc: wire.LinkClosed) -> rx.ActorUnavailableError:
    """A broken link as Ray reports an actor it cannot reach: naming it, so it is retried."""
    return rx.ActorUnavailableError(f"its link broke: {exc}", worker._actor_id.binary())


def _broken(opening: asyncio.Future) -> bool:
    if opening.cancelled() or opening.exception() is not None:
        return True
    link = opening.result()
    return link is not None and link.failure is not None


async def open_link(worker, connect: Callable[[wire.LinkAddress], Awaitable[T]]) -> T | None:
    """`connect` to `worker`'s link address; None (with a warning) if it cannot be reached,
    and the caller goes over Ray instead."""
    # A request cancelled while the link opens must not cancel the call later ones share.
    address = await detached(worker.link_address.remote)
    try:
        return await connect(address)
    except wire.LinkClosed as exc:
        log.warning("worker's link unreachable (%s): it is used over Ray", exc)
        return None


def _open(worker, ring: bool) -> Awaitable[wire.CallLink | None]:
    return open_link(worker, functools.partial(wire.CallLink.open, ring=ring))
