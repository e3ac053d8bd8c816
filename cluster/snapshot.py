"""What the fleet controller hands to ingress replicas: the workers as they are now.

A snapshot is plain data (Ray pickles the actor handles in it with their tensor-transport
flag), numbered by a generation the controller bumps whenever it replaces, adds or drains a
worker. A replica routes with the snapshot it holds and swaps it for a newer one when the
generation moves; which workers changed is what it must reset in its routing view.

Autoscaled pools own one slot per worker they may run (max_workers): an empty slot holds
None, as does one whose worker is still starting; a draining worker is present (its requests
still reach it) but not routed to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.types import WorkerInfo, WorkerKind


@dataclass(frozen=True)
class GroupRef:
    """A collective group the controller formed over every worker (RDT transports only)."""

    name: str
    backend: str  # ray.util.collective Backend value, e.g. "torch_gloo"


Slot = tuple[WorkerKind, int]


@dataclass(frozen=True)
class Scaling:
    """Workers in transition: started but not ready yet, and draining before they stop."""

    starting: frozenset[Slot] = frozenset()
    draining: frozenset[Slot] = frozenset()


@dataclass(frozen=True)
class FleetSnapshot:
    generation: int
    pools: Mapping[WorkerKind, tuple[Any, ...]]  # actor handles by kind, in worker-index order
    actor_ids: Mapping[WorkerKind, tuple[str, ...]]  # Ray's hex id of each, same order
    infos: tuple[WorkerInfo, ...]  # the router's static picture (kind, index, node, modalities)
    group: GroupRef | None
    scaling: Scaling = Scaling()

    def actor_id(self, kind: WorkerKind, index: int) -> str:
        return self.actor_ids[kind][index]

    def all_actors(self) -> list:
        """Every worker, in the order they rank in the collective group."""
        return [actor for kind in WorkerKind for actor in self.pools[kind] if actor is not None]

    def routable(self, kind: WorkerKind, index: int) -> bool:
        """Whether new requests may go to worker `index`: running and not draining."""
        return self.pools[kind][index] is not None and (kind, index) not in self.scaling.draining

    def pool_sizes(self) -> dict[str, dict[str, int]]:
        """Per kind: worker slots, workers routed to, starting and draining (for /health)."""
        sizes = {}
        for kind in WorkerKind:
            slots = range(len(self.pools[kind]))
            sizes[kind.value] = {
                "slots": len(slots),
                "routed": sum(self.routable(kind, i) for i in slots),
                "starting": sum((kind, i) in self.scaling.starting for i in slots),
                "draining": sum((kind, i) in self.scaling.draining for i in slots),
            }
        return sizes

    def is_current(self, kind: WorkerKind, index: int, actor_id: str) -> bool:
        """Does `actor_id` still serve as worker `index` of `kind`? A report about an actor
        already replaced (another replica saw it die first) is stale."""
        return self.actor_ids[kind][index] == actor_id

    def changed_since(self, older: FleetSnapshot | None) -> list[tuple[WorkerKind, int]]:
        """Workers whose actor differs from `older`'s (all of them when there is none)."""
        return [
            (kind, index)
            for kind in WorkerKind
            for index, actor_id in enumerate(self.actor_ids[kind])
            if older is None
            or index >= len(older.actor_ids[kind])
            or older.actor_ids[kind][index] != actor_id
        ]

    def newer_than(self, other: FleetSnapshot | None) -> bool:
        return other is None or self.generation > other.generation
