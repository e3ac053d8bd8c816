"""The fleet controller: one named, detached actor per Serve app and config that owns the
worker fleet, so the fleet outlives any ingress replica.

The first replica creates it (get-or-create by name) and every other or restarted replica
attaches to the same one. It creates the workers and their collective group, replaces a
worker a replica reports dead (bumping the generation), and hands out FleetSnapshots.
Requests never pass through it: replicas call the workers directly.

Its name carries the fingerprint of what the workers are built from (model, pools,
transport), so a redeploy that changes only ingress settings (an API key, limits, logging)
attaches to the running fleet, and one that changes the workers never attaches to an old
fleet: the new config's replicas retire the old controllers of their app (their workers die
with them: the controller owns them). A controller no replica has
asked anything for ORPHAN_AFTER_S (the app was deleted) shuts its fleet down itself.

Replicas register with an owner tag that starts their requests' ids; the controller pings
them, and when Ray says one died, the workers free whatever its requests still held
(KV no decode will pull, embeddings no prefill will use).

It also keeps the book of the replicas' metrics (cluster/metrics_merge.py): each pushes
its exposition about once a second, and a scrape on any replica merges the others' in. A
dead replica's counters stay in a retired sum, so the app's totals never go backwards.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from cluster.config import ClusterConfig
from cluster.metrics_merge import MetricsBook
from cluster.pool_scaling import PERIOD_S, PoolScaling
from cluster.snapshot import FleetSnapshot
from router.types import Modality, WorkerKind

log = logging.getLogger(__name__)

NAMESPACE = "epd"
ORPHAN_AFTER_S = 60.0  # well above a replica's restart, and its heartbeat (every supervisor check)
_REAP_PERIOD_S = 5.0
_WATCH_PERIOD_S = 1.0  # how soon a dead replica's leftovers are freed
_MIN_STEP_S = 0.05  # autoscaling steps at least this far apart
_PING_TIMEOUT_S = 10.0  # a replica slower than this is busy, not dead: only Ray's word counts


def controller_prefix(app_name: str) -> str:
    return f"fleet-{app_name}-"


def controller_name(app_name: str, config: ClusterConfig) -> str:
    return controller_prefix(app_name) + config.fleet_fingerprint()


@ray.remote(
    num_cpus=0, max_concurrency=16
)  # threaded: snapshots are served while a worker is replaced
class FleetController:
    def __init__(self, config: dict, model_modalities: list[str]):
        from cluster.fleet import Fleet  # here: ingress replicas import this module, not actors

        self._config = ClusterConfig.model_validate(config)
        self._fleet = Fleet(self._config)
        self._infos = tuple(
            self._fleet.worker_infos(frozenset(Modality(m) for m in model_modalities))
        )
        self._generation = 0
        self._lock = threading.Lock()  # one replacement (and group re-formation) at a time
        self._seen_s = time.monotonic()
        self._replicas: dict[str, object] = {}  # owner tag -> the replica's actor handle
        self._metrics = MetricsBook()
        self._bookings: dict[str, dict] = {}  # owner -> its router's booked ms per worker
        self._scaling = PoolScaling(self._fleet, time.monotonic())
        threading.Thread(target=self._reap_when_orphaned, daemon=True, name="reaper").start()
        threading.Thread(target=self._watch_replicas, daemon=True, name="watcher").start()
        if self._scaling.pools:
            threading.Thread(target=self._autoscale, daemon=True, name="autoscaler").start()

    def register(self, owner: str, replica) -> None:
        """A replica whose requests' ids start with `owner`; its death frees them on the workers."""
        self._replicas[owner] = replica

    def unregister(self, owner: str) -> None:
        """A replica reconfigured in place and `owner`, its old tag, has no request left: what
        the tag's requests left on the workers is freed and its counts join the retired sum,
        as for a replica that died."""
        self._free_owner(owner, "reconfigured")

    def report_metrics(
        self, owner: str, exposition: bytes, seq: int = 0, booked: dict | None = None
    ) -> None:
        """A replica's latest exposition, its `seq`-th rendering (also a heartbeat), and its
        router's running totals of booked ms per worker ({kind: [ms per index]}: autoscaling's
        load)."""
        self._seen_s = time.monotonic()
        self._metrics.report(owner, exposition, seq)
        if booked:
            with self._lock:
                self._scaling.booked.report(owner, booked)

    def share_metrics(self, owner: str, exposition: bytes, seq: int = 0) -> list[str | bytes]:
        """A scrape on `owner`: its exposition is recorded before the scrape is answered (should
        the replica die next, the totals already shown stay), and the others' come back."""
        self._seen_s = time.monotonic()
        return self._metrics.exchange(owner, exposition, seq)

    def apply_live(self, config: dict) -> bool:
        """A starting replica's config: where its live settings differ from the fleet's, every
        worker takes them in place (a redeploy that changed only those). Returns whether any
        changed."""
        new = ClusterConfig.model_validate(config)
        with self._lock:
            if new.live_settings() == self._config.live_settings():
                return False
            log.info("workers take new live settings: %s", new.live_settings())
            self._config = new
            self._fleet.apply_live(new)
            return True

    def snapshot(self) -> FleetSnapshot:
        self._seen_s = time.monotonic()
        with self._lock:
            return self._fleet.snapshot(self._generation, self._infos, self._scaling.scaling())

    def heartbeat(
        self, owner: str | None = None, booked: dict | None = None
    ) -> tuple[int, int, dict | None]:
        """What replicas poll: the generation (a change means a new snapshot), how many
        replicas are registered (each admits its share of the budgets), and the other
        replicas' booked ms per worker, summed ({kind: [ms per index]}; None while no other
        replica has shared): `booked` is the asking replica's own, shared with them."""
        if owner is not None and booked is not None:
            self._bookings[owner] = booked
        others = [b for o, b in list(self._bookings.items()) if o != owner and o in self._replicas]
        return self.generation(), len(self._replicas), sum_bookings(others)

    def generation(self) -> int:
        """What replicas poll (it is also their heartbeat): a change means a new snapshot."""
        self._seen_s = time.monotonic()
        return self._generation

    def replace(self, kind: WorkerKind, index: int, actor_id: str) -> FleetSnapshot:
        """A replica saw worker `actor_id` die: replace it unless that was done already
        (several replicas report the same death); returns the snapshot after."""
        with self._lock:
            if actor_id and self._fleet.actor_id(kind, index) == actor_id:
                log.warning("replacing %s worker %d (actor %s)", kind.value, index, actor_id)
                try:
                    self._fleet.replace(kind, index)
                finally:  # new actors even if the group failed to form: replicas must see them
                    self._generation += 1
        return self.snapshot()

    def shutdown(self) -> None:
        """Kill every worker, then this actor."""
        with self._lock:
            self._fleet.shutdown()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _watch_replicas(self) -> None:
        while True:
            time.sleep(_WATCH_PERIOD_S)
            for owner, replica in list(self._replicas.items()):
                try:
                    ray.get(replica.__ray_ready__.remote(), timeout=_PING_TIMEOUT_S)
                    continue
                except ray.exceptions.ActorDiedError:
                    pass
                except (
                    Exception
                ) as exc:  # busy (timeout), or unreachable for now: asked again next round
                    log.info("replica %s did not answer: %s", owner, type(exc).__name__)
                    continue
                try:
                    self._free_owner(owner)
                except (
                    Exception
                ):  # a worker died meanwhile: its replacement holds nothing of the replica's
                    log.exception("freeing what replica %s held failed", owner)

    def _autoscale(self) -> None:
        while True:
            self._wait_period()
            try:
                with self._lock:
                    infos = self._scaling.step(time.monotonic(), self._infos)
                    if infos is not None:
                        self._infos, self._generation = infos, self._generation + 1
            except Exception:  # scaling must outlive any one failure; the next period retries
                log.exception("autoscaling step failed")

    def _wait_period(self) -> None:
        """One period, or less once a starting worker is ready (it is routed to at once)."""
        with self._lock:
            starting = self._scaling.starting_refs()
        if not starting:
            time.sleep(PERIOD_S)
            return
        time.sleep(_MIN_STEP_S)  # a ready ref whose step failed must not spin this thread
        ray.wait(starting, num_returns=1, timeout=PERIOD_S - _MIN_STEP_S)

    def _free_owner(self, owner: str, why: str = "died") -> None:
        if self._replicas.pop(owner, None) is None:
            return  # freed already (the watcher and an unregister may meet)
        self._bookings.pop(owner, None)
        self._metrics.retire(owner)
        with self._lock:
            self._scaling.booked.forget(owner)
            workers = self._fleet.all_actors()  # encoders: references to release
        freed = ray.get([w.drop_owner.remote(owner) for w in workers], timeout=_PING_TIMEOUT_S)
        log.warning(
            "replica %s %s; its requests' leftovers freed on the workers: %d",
            owner,
            why,
            sum(freed),
        )

    def _reap_when_orphaned(self) -> None:
        while time.monotonic() - self._seen_s < ORPHAN_AFTER_S:
            time.sleep(_REAP_PERIOD_S)
        log.warning("no ingress replica for %.0f s: shutting the fleet down", ORPHAN_AFTER_S)
        self.shutdown()


def sum_bookings(bookings: list[dict[str, list[float]]]) -> dict[str, list[float]] | None:
    """Replicas' booked ms per worker ({kind: [ms per index]}), summed; None for none."""
    if not bookings:
        return None
    return {kind: [sum(ms) for ms in zip(*(b[kind] for b in bookings))] for kind in bookings[0]}


def attach(
    app_name: str,
    config: ClusterConfig,
    model_modalities: frozenset[Modality],
    *,
    again: bool = False,
):
    """The app's controller for `config`, created if none runs yet; a new replica retires
    other configs' controllers. `again`: a running replica lost its controller; None if
    another config's controller runs (this replica is being replaced: it must not
    retire its successor's fleet, nor bring its own back)."""
    name = controller_name(app_name, config)
    if not again:
        retire(app_name, keep=name)
    elif any(other != name for other in running(app_name)):
        return None
    return prestart(app_name, config, model_modalities)


def prestart(app_name: str, config: ClusterConfig, model_modalities: frozenset[Modality]):
    """The controller for `config`, created if none runs, without waiting for its fleet and
    retiring no other: `epd serve` calls it before the ingress starts, so the workers load
    while the replicas import (the first replica's `attach` retires the old fleet)."""
    return FleetController.options(
        name=controller_name(app_name, config),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote(config.model_dump(mode="json"), sorted(m.value for m in model_modalities))


def running(app_name: str) -> list[str]:
    """Names of the app's controllers that Ray knows of."""
    prefix = controller_prefix(app_name)
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
    )


def retire(app_name: str, keep: str | None = None) -> list[str]:
    """Kill the app's controllers (and so their workers), except `keep`; returns those killed."""
    killed = []
    for name in running(app_name):
        if name == keep:
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            killed.append(name)
        except ValueError:  # gone meanwhile
            pass
    if killed:
        log.warning("retired fleet controllers of other configs: %s", killed)
    return killed
