"""Fleet.replace when the collective group cannot be formed again (no Ray: actors are stubs)."""

from __future__ import annotations

import types

import pytest

import cluster.fleet as fleet_module
from cluster.fleet import Fleet
from router.types import WorkerKind

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE


class _Actor:
    def __init__(self, name: str):
        self.name = name
        self.ready = types.SimpleNamespace(remote=lambda: name)


def _fleet(monkeypatch, form_results: list[bool]) -> tuple[Fleet, list[str]]:
    """A fleet of one worker per kind whose group formations succeed or fail in turn."""
    killed: list[str] = []
    monkeypatch.setattr(
        fleet_module,
        "ray",
        types.SimpleNamespace(
            kill=lambda a, no_restart: killed.append(a.name), get=lambda refs: refs
        ),
    )
    fleet = object.__new__(Fleet)
    fleet.pools = {kind: [_Actor(f"{kind.value}-0")] for kind in WorkerKind}
    starts = iter(range(1, 100))
    fleet._start = lambda kind, index: _Actor(f"{kind.value}-{next(starts)}")

    def form() -> None:
        if not form_results.pop(0):
            raise TimeoutError("Timed out waiting for GLOO rendezvous metadata")

    fleet._form_group = form
    return fleet, killed


def test_one_worker_is_replaced_when_the_group_forms(monkeypatch):
    fleet, killed = _fleet(monkeypatch, [True])
    fleet.replace(P, 0)
    assert killed == ["prefill-0"] and fleet.pools[P][0].name == "prefill-1"
    assert fleet.pools[E][0].name == "encoder-0" and fleet.pools[D][0].name == "decode-0"


def test_every_worker_is_restarted_when_a_stuck_member_keeps_the_group_from_forming(monkeypatch):
    fleet, killed = _fleet(monkeypatch, [False, True])
    fleet.replace(P, 0)
    assert killed == ["prefill-0", "encoder-0", "prefill-1", "decode-0"]
    assert [fleet.pools[k][0].name for k in (E, P, D)] == ["encoder-2", "prefill-3", "decode-4"]


def test_a_group_that_fails_from_fresh_workers_too_is_an_error(monkeypatch):
    fleet, _ = _fleet(monkeypatch, [False, False])
    with pytest.raises(TimeoutError):
        fleet.replace(P, 0)
