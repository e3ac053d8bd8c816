"""Unit tests for router/: the view, the least_loaded policy and the registry (no torch, no Ray)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.policies import POLICIES, LeastLoaded, make_policy
from router.types import MediaJob, RequestProfile, RouteDecision, WorkerKind
from router.view import ClusterView, NoWorkerError

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
REPO = Path(__file__).resolve().parents[2]

_ITEM = MediaJob(identifier="a", modality="image", size=0.05, num_embeddings=16, embedding_bytes=4096)
IMAGE = RequestProfile(num_prompt_tokens=100, items=(_ITEM, _ITEM))
TEXT = RequestProfile(num_prompt_tokens=10)


def view(e: int = 3, p: int = 3, d: int = 3) -> ClusterView:
    return ClusterView({E: e, P: p, D: d})


def test_idle_cluster_ties_to_lowest_index():
    assert LeastLoaded().pick(IMAGE, view()) == RouteDecision(0, 0, 0)


def test_text_only_request_gets_no_encoder():
    v = view()
    assert LeastLoaded().pick(TEXT, v).encoder is None
    # even when no encoder is healthy or none exists at all
    for i in range(3):
        v.set_healthy(E, i, False)
    assert LeastLoaded().pick(TEXT, v) == RouteDecision(None, 0, 0)
    assert LeastLoaded().pick(TEXT, view(e=0)) == RouteDecision(None, 0, 0)


def test_each_stage_picks_its_least_outstanding_worker():
    v = view(e=3, p=4, d=2)
    v.outstanding[E] = [5, 1, 3]
    v.outstanding[P] = [2, 2, 0, 1]
    v.outstanding[D] = [4, 7]
    assert LeastLoaded().pick(IMAGE, v) == RouteDecision(1, 2, 0)


def test_ties_go_to_the_lowest_index():
    v = view(e=4, p=4, d=4)
    v.outstanding[E] = [3, 1, 2, 1]
    v.outstanding[P] = [2, 2, 2, 2]
    v.outstanding[D] = [9, 0, 0, 0]
    assert LeastLoaded().pick(IMAGE, v) == RouteDecision(1, 0, 1)


def test_unhealthy_workers_are_never_picked():
    v = view()
    v.set_healthy(E, 0, False)
    v.set_healthy(P, 1, False)
    v.set_healthy(D, 0, False)
    v.outstanding[P] = [5, 0, 3]  # the idle prefill worker is down
    v.outstanding[D] = [0, 9, 9]
    assert LeastLoaded().pick(IMAGE, v) == RouteDecision(1, 2, 1)
    # back up: picked again
    v.set_healthy(P, 1, True)
    assert LeastLoaded().pick(IMAGE, v).prefill == 1


def test_routing_spreads_load_as_counts_grow():
    v = view(e=2, p=3, d=3)
    policy = make_policy("least_loaded")
    decisions = []
    for _ in range(6):
        decision = policy.pick(IMAGE, v)
        v.begin_route(decision, IMAGE.num_items)
        decisions.append(decision)
    assert [d.prefill for d in decisions] == [0, 1, 2, 0, 1, 2]
    assert [d.encoder for d in decisions] == [0, 1, 0, 1, 0, 1]
    assert v.outstanding[E] == [6, 6]  # encoder counts items, not requests
    assert v.queue_depth(P) == 6 and v.queue_depth(D) == 6


@pytest.mark.parametrize("dead", [E, P, D])
def test_no_healthy_worker_raises(dead):
    v = view(e=2, p=2, d=2)
    for i in range(2):
        v.set_healthy(dead, i, False)
    with pytest.raises(NoWorkerError, match=dead.value):
        LeastLoaded().pick(IMAGE, v)


def test_no_worker_at_all_raises():
    with pytest.raises(NoWorkerError):
        LeastLoaded().pick(TEXT, view(p=0))


def test_begin_route_and_end_keep_counts_non_negative():
    v = view(e=2, p=2, d=2)
    decision = RouteDecision(1, 0, 1)
    v.begin_route(decision, num_items=3)
    assert v.outstanding == {E: [0, 3], P: [1, 0], D: [0, 1]}
    v.end(E, 1, 3)
    v.end(P, 0)
    v.end(D, 1)
    assert v.outstanding == {E: [0, 0], P: [0, 0], D: [0, 0]}
    # ending more than began (a duplicate completion) never goes below zero
    v.end(E, 1, 5)
    v.end(P, 0)
    v.end(D, 0)
    assert v.outstanding == {E: [0, 0], P: [0, 0], D: [0, 0]}
    # a text-only decision touches no encoder
    v.begin_route(RouteDecision(None, 1, 0), num_items=0)
    v.end(E, None)
    assert v.outstanding == {E: [0, 0], P: [0, 1], D: [1, 0]}
    assert all(c >= 0 for counts in v.outstanding.values() for c in counts)


def test_make_policy():
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert make_policy("least_loaded") is not make_policy("least_loaded")
    assert "least_loaded" in POLICIES


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError) as info:
        make_policy("round_robin_typo")
    message = str(info.value)
    assert "round_robin_typo" in message
    for name in POLICIES:
        assert name in message


def test_router_imports_no_torch_and_no_ray():
    code = (
        "import router.policies, router.view, router.types, sys; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, "
        "[m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')]"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
