"""An ingress replica's side of the fleet: the controller's latest snapshot, adopted.

Requests call the workers straight from the snapshot's handles. Adopting a snapshot also
adopts the controller's collective group: Ray's RDT looks groups up in the calling
process's RemoteCommunicatorManager, so registering a CommunicatorHandle for the group
(already initialised on every worker) lets this process own tensor refs that travel over
it, without forming the group again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from collections.abc import Callable

import ray

from cluster.config import ClusterConfig, Transport
from cluster.leftovers import detached
from cluster.snapshot import FleetSnapshot
from router.types import WorkerKind

log = logging.getLogger(__name__)

# One RDT transfer at a time per collective group in this process (receiving()): a replica
# that reconfigured in place has two clients on one group while the old one drains.
_TRANSFER_LOCKS: dict[str, asyncio.Lock] = {}
_OPEN: weakref.WeakSet = weakref.WeakSet()  # this process's clients not closed yet


def with_options(method, options: dict):
    """`method` with Ray call options; with none, the method itself: Ray builds an options
    wrapper on every call otherwise (per request on the hot path)."""
    return method.options(**options) if options else method


class FleetClient:
    def __init__(self, attach: Callable[..., object], config: ClusterConfig):
        """`attach(again=False)` returns the controller's handle, creating the controller if
        none runs (controller.attach)."""
        self._attach, self.config = attach, config
        self.owner = (
            f"{uuid.uuid4().hex[:8]}:"  # starts this replica's request ids: what its death frees
        )
        self.controller = attach(again=False)
        self.num_replicas = 1  # registered with the controller, as of the last sync
        self.others_booked: dict | None = None  # the other replicas' booked ms per worker
        self.on_replicas: Callable[[int], None] | None = None  # told when that count changes
        # A redeploy that changed only live settings kept the fleet: they reach it from here.
        ray.get(self.controller.apply_live.remote(config.model_dump(mode="json")))
        self.snapshot: FleetSnapshot | None = None
        self.adopt(ray.get(self.controller.snapshot.remote()))
        _OPEN.add(self)
        ray.get(self._register())  # before anything counts the registered replicas

    def registered_replicas(self) -> int:
        """Blocking: how many replicas the controller holds registered now, this one included."""
        return ray.get(self.controller.heartbeat.remote())[1]

    def _register(self):
        return self.controller.register.remote(self.owner, ray.get_runtime_context().current_actor)

    @property
    def pools(self):
        return self.snapshot.pools

    @property
    def generation(self) -> int:
        return self.snapshot.generation

    def actor_id(self, kind: WorkerKind, index: int) -> str:
        """Ray's hex id of a worker's current actor (failures name the actor that died)."""
        return self.snapshot.actor_id(kind, index)

    def adopt(self, snapshot: FleetSnapshot, force: bool = False) -> list[tuple[WorkerKind, int]]:
        """Route with `snapshot` from now on unless the one held is as new (or `force`); returns
        the workers whose actor changed (their routing state must be reset)."""
        old = self.snapshot
        if not (force or snapshot.newer_than(old)):
            return []
        from ray.experimental.collective.collective import RemoteCommunicatorManager
        from ray.experimental.collective.communicator import CommunicatorHandle

        manager = RemoteCommunicatorManager.get()
        if snapshot.group is not None:
            manager.add_remote_communicator(
                CommunicatorHandle(
                    snapshot.all_actors(), snapshot.group.name, snapshot.group.backend
                )
            )
        if old is not None and old.group is not None and old.group != snapshot.group:
            manager.remove_remote_communicator(old.group.name)
        self.snapshot = snapshot
        changed = snapshot.changed_since(old)
        if changed and snapshot.group is not None:
            # a transfer hung with a replaced worker must not hold up the others (a re-formed
            # group has a new name, and so a new lock, anyway)
            _TRANSFER_LOCKS.pop(snapshot.group.name, None)
        return changed

    def close(self) -> None:
        """This client is done (its replica reconfigured in place and its requests ended):
        forget its group unless the replica's current client uses it too."""
        group = self.snapshot.group if self.snapshot is not None else None
        if group is None:
            return
        from ray.experimental.collective.collective import RemoteCommunicatorManager

        if not any(c is not self and c.uses(group.name) for c in _OPEN):
            RemoteCommunicatorManager.get().remove_remote_communicator(group.name)
            _TRANSFER_LOCKS.pop(group.name, None)
        _OPEN.discard(self)

    def uses(self, group_name: str) -> bool:
        group = self.snapshot.group if self.snapshot is not None else None
        return group is not None and group.name == group_name

    def replace(self, kind: WorkerKind, index: int) -> list[tuple[WorkerKind, int]]:
        """Blocking (run it in a thread): have the controller replace a dead worker, or learn
        that it did already; returns what changed."""
        return self.adopt(
            ray.get(self.controller.replace.remote(kind, index, self.actor_id(kind, index)))
        )

    async def sync(self, booked: dict | None = None) -> list[tuple[WorkerKind, int]]:
        """Adopt the controller's snapshot if its generation moved; share this replica's
        `booked` ms per worker and keep the others' (`others_booked`). A controller that is
        gone (killed, or its node lost) is created again, with a new fleet, unless another
        config's controller took over (this replica is being replaced)."""
        try:
            generation, num_replicas, self.others_booked = await self.controller.heartbeat.remote(
                self.owner, booked
            )
            self._count_replicas(num_replicas)
            if generation == self.snapshot.generation:
                return []
            return self.adopt(await self.controller.snapshot.remote())
        except ray.exceptions.RayActorError:
            handle = await asyncio.to_thread(self._attach, again=True)
            if handle is None:
                return []
            log.warning("the fleet controller was gone; attached to a new one")
            self.controller = handle
            await self._register()
            return self.adopt(
                await self.controller.snapshot.remote(), force=True
            )  # its generations start over

    async def share_now(self, booked: dict, timeout_s: float) -> bool:
        """A heartbeat between syncs, for a large request: share this replica's `booked` ms and
        take the others' (`others_booked`). False if the controller did not answer within
        `timeout_s` or is gone: the request routes on the last share, and the next sync deals
        with the controller."""
        try:
            answer = await asyncio.wait_for(
                self.controller.heartbeat.remote(self.owner, booked), timeout_s
            )
        except (TimeoutError, ray.exceptions.RayActorError):
            return False
        _, num_replicas, self.others_booked = answer
        self._count_replicas(num_replicas)
        return True

    def publish(self, booked: dict) -> None:
        """Share this replica's `booked` ms now, answer unread (a large request was just booked:
        the next large one on another replica should see it)."""
        detached(self.controller.heartbeat.remote, self.owner, booked)

    def _count_replicas(self, num_replicas: int) -> None:
        if num_replicas != self.num_replicas:
            self.num_replicas = num_replicas
            if self.on_replicas is not None:
                self.on_replicas(num_replicas)

    def transport_option(self, transport: Transport) -> dict:
        """Call options that make an actor method return its tensors over `transport`."""
        return {} if transport == Transport.OBJECT_STORE else {"tensor_transport": transport.value}

    def receiving(self, transport: Transport):
        """Context for handing tensors to a worker. Over gloo/nccl one transfer runs at a time
        in the whole group: Ray 2.60 RDT pairs sends and receives by order alone, concurrent
        receives on an actor corrupt each other, and with transfers into different actors
        in flight at once (a prefill worker receiving embeddings while it sends KV) the
        suite saw a transfer hang until Ray's 60 s abort killed the group. The lock is this
        process's: hence RDT transports need server.num_replicas 1 (ClusterConfig checks)."""
        if not transport.collective:
            return contextlib.nullcontext()
        return _TRANSFER_LOCKS.setdefault(self.snapshot.group.name, asyncio.Lock())
