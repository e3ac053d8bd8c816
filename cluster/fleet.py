"""Creation and replacement of the worker actors, placed by the resources in the config.

The fleet lives in the fleet controller (cluster/controller.py), which owns the actors, so
they outlive any ingress replica. Replicas get the handles from a controller method (so
they keep their tensor-transport flag) and adopt its collective group (cluster/fleet_client.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid

import ray

from actors.decode import DecodeActor
from actors.encoder import EncoderActor
from actors.idle_cores import BOARD_PREFIX
from actors.prefill import PrefillActor
from actors.runtime import WorkerSpec
from cluster.config import ClusterConfig, PoolConfig, Transport
from cluster.snapshot import FleetSnapshot, GroupRef, Scaling
from router.types import Modality, WorkerInfo, WorkerKind

log = logging.getLogger(__name__)

_BACKEND = {Transport.GLOO: "torch_gloo", Transport.NCCL: "nccl"}
# OpenMP threads that finish a parallel region spin this many times before they sleep. A
# worker that borrows a core starts its 2-thread forward after waiting for work: at 10,000 the
# second thread fell asleep between the forward's regions and bench-llava's encode took longer
# on two threads than on one; at 100,000 it keeps pace, and the spin that outlives a forward
# costs a core a few ms (scripts/bench_omp_spin.py). An operator's own setting wins.
_OPENMP_ENV = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "100000")}
_WORKER_ENV = {
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    **_OPENMP_ENV,
}


_ACTORS = {
    WorkerKind.ENCODER: EncoderActor,
    WorkerKind.PREFILL: PrefillActor,
    WorkerKind.DECODE: DecodeActor,
}


def _rdt_transport(config: ClusterConfig) -> Transport | None:
    """The collective transport the workers' group is formed for (cuda_ipc is one-sided: no
    group)."""
    used = {t for t in (config.transport.embeddings, config.transport.kv) if t.collective}
    return used.pop() if used else None


def _hex_id(actor) -> str:
    return "" if actor is None else actor._actor_id.hex()


class Fleet:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.rdt = _rdt_transport(config)
        m = config.model
        # The checkpoint as configured (a repo id stays one): each worker resolves it on its own
        # node.
        self.spec = WorkerSpec(
            m.checkpoint,
            m.dtype,  # `auto`: each worker picks what its own GPU supports
            m.device,
            1,
            m.max_model_len,
            revision=m.revision,
            hub_cache_dir=m.hub_cache_dir,
            # On each node, the board where workers post their work: idle-core borrowing and
            # node priority for short prompts (a live setting) read it.
            board=f"{BOARD_PREFIX}{uuid.uuid4().hex[:12]}",
            shared_memory=config.transport.shared_memory,
        )
        # Per kind, one entry per worker index (slot); None where an autoscaled pool runs
        # fewer than its max_workers.
        self.pools: dict[WorkerKind, list] = {kind: [] for kind in WorkerKind}
        for kind in WorkerKind:
            self.pools[kind] = [
                self._start(kind, i) if self._starts_live(kind, i) else None
                for i in range(self._num_slots(kind))
            ]
        ray.get([a.ready.remote() for a in self.all_actors()])
        self._group_name: str | None = None
        self._form_group()

    def _kind_pools(self, kind: WorkerKind) -> list[PoolConfig]:
        if kind == WorkerKind.ENCODER:
            return self.config.encoder_pools
        return [getattr(self.config, kind.value)]

    def _num_slots(self, kind: WorkerKind) -> int:
        return sum(pool.num_slots for pool in self._kind_pools(kind))

    def _starts_live(self, kind: WorkerKind, index: int) -> bool:
        """Whether worker `index` starts with the fleet: a pool's first num_workers slots."""
        pool, in_pool = self._pool_config(kind, index)
        return in_pool < pool.num_workers

    def _pool_config(self, kind: WorkerKind, index: int) -> tuple[PoolConfig, int]:
        """The pool worker `index` of `kind` belongs to, and its index within that pool."""
        for pool in self._kind_pools(kind):
            if index < pool.num_slots:
                return pool, index
            index -= pool.num_slots
        raise IndexError(f"no {kind.value} worker {index}")

    def slots_of(self) -> list[tuple[WorkerKind, range, PoolConfig]]:
        """Every pool: its kind, the worker indices it owns and its config."""
        spans = []
        for kind in WorkerKind:
            first = 0
            for pool in self._kind_pools(kind):
                spans.append((kind, range(first, first + pool.num_slots), pool))
                first += pool.num_slots
        return spans

    def _start(self, kind: WorkerKind, index: int):
        pool, in_pool = self._pool_config(kind, index)
        spec = dataclasses.replace(
            self.spec,
            torch_threads=pool.torch_threads,
            idle_torch_threads=pool.idle_torch_threads,
            niceness=pool.niceness,
            slowdown=pool.slowdown_of(in_pool),
        )
        options = dict(
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
            resources=dict(
                pool.resources
            ),  # custom resources pin the pool to the node types that declare them
            runtime_env={"env_vars": _WORKER_ENV},
            max_concurrency=1000,
        )
        # The pool's settings travel as one record, under the config's names.
        return _ACTORS[kind].options(**options).remote(spec, pool.settings())

    def apply_live(self, config: ClusterConfig) -> None:
        """Hand every worker its pool's live settings (config.LIVE_FIELDS) from `config`,
        whose fleet fingerprint is this fleet's; workers started later are built from it."""
        self.config = config
        ray.get(
            [
                actor.reconfigure.remote(pool.settings(), pool.slowdown_of(in_pool))
                for kind in WorkerKind
                for index, actor in enumerate(self.pools[kind])
                if actor is not None
                for pool, in_pool in [self._pool_config(kind, index)]
            ]
        )

    def worker_infos(self, model_modalities: frozenset[Modality]) -> list[WorkerInfo]:
        """The router's static picture of the fleet: kind, index, node (for placements) and,
        for encoders, the modalities each encodes."""
        per_encoder = [
            frozenset(m.value for m in ms)
            for ms in self.config.encoder_modalities(model_modalities)
        ]
        infos = []
        for kind in WorkerKind:
            nodes = ray.get([self.node_of(kind, i) for i in range(len(self.pools[kind]))])
            modalities = per_encoder if kind == WorkerKind.ENCODER else [frozenset()] * len(nodes)
            infos += [
                WorkerInfo(kind, i, node=node, modalities=m)
                for i, (node, m) in enumerate(zip(nodes, modalities))
            ]
        return infos

    def node_of(self, kind: WorkerKind, index: int):
        """A ref to the node id worker `index` runs on ("" for an empty slot: none yet)."""
        actor = self.pools[kind][index]
        return ray.put("") if actor is None else actor.node_id.remote()

    def actor_id(self, kind: WorkerKind, index: int) -> str:
        """Ray's hex id of a worker's current actor (failures name the actor that died); ""
        for an empty slot."""
        return _hex_id(self.pools[kind][index])

    def all_actors(self) -> list:
        return [a for kind in WorkerKind for a in self.pools[kind] if a is not None]

    def start(self, kind: WorkerKind, index: int):
        """A worker in empty slot `index` (autoscaling); returns the ref of its `ready`,
        which resolves once Ray has placed it (the autoscaler may launch its node first)."""
        assert self.pools[kind][index] is None, f"{kind.value} worker {index} is running"
        self.pools[kind][index] = self._start(kind, index)
        return self.pools[kind][index].ready.remote()

    def stop(self, kind: WorkerKind, index: int) -> None:
        """End worker `index` and empty its slot (autoscaling, after the worker drained)."""
        actor, self.pools[kind][index] = self.pools[kind][index], None
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def _form_group(self) -> None:
        """One collective group over every worker: an actor joins one group per backend."""
        if self.rdt is None:
            return
        from ray.experimental.collective import create_collective_group, destroy_collective_group

        if self._group_name is not None:
            try:
                destroy_collective_group(self._group_name)
            except Exception as exc:  # the group dies with any of its members
                log.info("old collective group already gone: %s", exc)
        self._group_name = f"epd-{uuid.uuid4().hex[:8]}"
        create_collective_group(
            self.all_actors(), backend=_BACKEND[self.rdt], name=self._group_name
        )

    def replace(self, kind: WorkerKind, index: int) -> None:
        """Restart one worker; with RDT the whole group is re-formed (a failed transfer
        destroys it for every member). A member whose transfer thread is still stuck in the
        aborted transfer never joins (the rendezvous times out): then every worker is
        restarted, so the group forms from fresh processes."""
        self._restart([(kind, index)])
        try:
            self._form_group()
        except Exception as exc:
            log.warning(
                "re-forming the collective group failed (%s); restarting every worker",
                type(exc).__name__,
            )
            self._restart([(k, i) for k in WorkerKind for i in range(len(self.pools[k]))])
            self._form_group()

    def _restart(self, workers: list[tuple[WorkerKind, int]]) -> None:
        workers = [(k, i) for k, i in workers if self.pools[k][i] is not None]  # not empty slots
        for kind, index in workers:
            try:
                ray.kill(self.pools[kind][index], no_restart=True)
            except Exception:  # already dead
                pass
            self.pools[kind][index] = self._start(kind, index)
        ray.get([self.pools[kind][index].ready.remote() for kind, index in workers])

    def snapshot(
        self, generation: int, infos: tuple[WorkerInfo, ...], scaling: Scaling = Scaling()
    ) -> FleetSnapshot:
        """The fleet as replicas route to it: workers still starting are left out (their
        slots stay empty until ready)."""
        group = GroupRef(self._group_name, _BACKEND[self.rdt]) if self.rdt is not None else None
        pools = {
            kind: tuple(
                None if (kind, i) in scaling.starting else actor
                for i, actor in enumerate(self.pools[kind])
            )
            for kind in WorkerKind
        }
        return FleetSnapshot(
            generation,
            pools,
            {kind: tuple(_hex_id(a) for a in pools[kind]) for kind in WorkerKind},
            infos,
            group,
            scaling,
        )

    def shutdown(self) -> None:
        for actor in self.all_actors():
            ray.kill(actor, no_restart=True)
