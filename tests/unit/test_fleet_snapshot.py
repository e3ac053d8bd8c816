"""The fleet controller's snapshot bookkeeping (cluster/snapshot.py) and a replica's adoption
of it (cluster/fleet_client.py), without Ray: stale death reports, generations, which workers
changed, the collective group's registration swapped in this process."""

from __future__ import annotations

from ray.experimental.collective.collective import RemoteCommunicatorManager

from cluster.config import Transport, load_config
from cluster.fleet_client import FleetClient
from cluster.snapshot import FleetSnapshot, GroupRef
from router.types import WorkerInfo, WorkerKind

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


def _snapshot(
    generation: int, ids: dict[WorkerKind, tuple[str, ...]], group: str | None = None
) -> FleetSnapshot:
    infos = tuple(WorkerInfo(kind, i) for kind in WorkerKind for i in range(len(ids[kind])))
    pools = {kind: tuple(f"handle-{a}" for a in ids[kind]) for kind in WorkerKind}
    return FleetSnapshot(
        generation, pools, ids, infos, GroupRef(group, "torch_gloo") if group else None
    )


FIRST = {E: ("e0", "e1"), P: ("p0",), D: ("d0",)}
SECOND = {E: ("e0", "e1-new"), P: ("p0",), D: ("d0",)}


def test_a_report_about_a_replaced_actor_is_stale():
    snap = _snapshot(1, SECOND)
    assert snap.is_current(E, 1, "e1-new") and not snap.is_current(E, 1, "e1")


def test_changed_since_names_only_replaced_workers():
    assert _snapshot(1, SECOND).changed_since(_snapshot(0, FIRST)) == [(E, 1)]
    assert len(_snapshot(0, FIRST).changed_since(None)) == 4


class _Client(FleetClient):
    def __init__(self, first: FleetSnapshot):  # no controller: adoption only
        self.snapshot, self._transfer_lock = None, None
        self.adopt(first)


def test_a_replica_adopts_only_newer_generations_and_swaps_the_group():
    manager = RemoteCommunicatorManager.get()
    client = _Client(_snapshot(3, FIRST, group="g-old"))
    assert "g-old" in manager._remote_communicators
    held = client.receiving(Transport.GLOO)
    assert client.receiving(Transport.GLOO) is held  # one lock for every transfer in the group
    assert (
        client.adopt(_snapshot(2, SECOND, group="g-older")) == [] and client.generation == 3
    )  # late answer: ignored
    assert client.adopt(_snapshot(4, SECOND, group="g-new")) == [(E, 1)]
    assert client.actor_id(E, 1) == "e1-new" and client.pools[E][1] == "handle-e1-new"
    assert "g-new" in manager._remote_communicators and "g-old" not in manager._remote_communicators
    assert (
        client.receiving(Transport.GLOO) is not held
    )  # the new group's transfers do not wait on the old one's lock
    assert client.adopt(_snapshot(0, FIRST), force=True) == [
        (E, 1)
    ]  # a re-created controller counts from 0 again
    manager.remove_remote_communicator("g-new")


def test_rdt_transports_need_one_replica():
    import pytest

    config = load_config()
    assert config.replace(server={"num_replicas": 2}).server.num_replicas == 2
    with pytest.raises(ValueError, match="num_replicas: 1"):
        config.replace(server={"num_replicas": 2}, transport={"embeddings": "gloo", "kv": "gloo"})


def test_a_dead_replicas_owner_tag_frees_its_requests_and_refuses_late_ones():
    from actors.inbox import TensorInbox

    inbox = TensorInbox()
    inbox.put("aaaa:chatcmpl-1/0", "kv1")
    inbox.put("aaaa:chatcmpl-2/1", "kv2")
    inbox.put("bbbb:chatcmpl-3/0", "kv3")  # the surviving replica's
    assert inbox.close_owner("aaaa:") == 2 and len(inbox) == 1
    assert (
        inbox.put("aaaa:chatcmpl-4/0", "late") is False
    )  # a prefill that finishes after the death
    assert (
        inbox.put("bbbb:chatcmpl-5/0", "kv5") is True and inbox.take("bbbb:chatcmpl-3/0") == "kv3"
    )
