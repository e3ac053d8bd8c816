"""Unit tests for router/view.py and the Router facade (no torch, no Ray): liveness,
staleness, dispatch bookkeeping, calibration through completions, and the stand-in API
the ingress still uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.cost_model import CostPriors
from router.policies import LeastLoaded, make_policy
from router.router import Router
from router.types import (
    EncoderShare,
    MediaJob,
    RequestProfile,
    RouteDecision,
    WorkerInfo,
    WorkerKind,
    WorkerState,
)
from router.view import ClusterView, NoWorkerError
from tests.unit.conftest import fleet

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
REPO = Path(__file__).resolve().parents[2]

_ITEM = MediaJob(
    identifier="a", modality="image", size=0.05, num_embeddings=16, embedding_bytes=4096
)
IMAGE = RequestProfile(num_prompt_tokens=100, items=(_ITEM, _ITEM))
TEXT = RequestProfile(num_prompt_tokens=10)


def view(e: int = 3, p: int = 3, d: int = 3) -> ClusterView:
    return ClusterView({E: e, P: p, D: d})  # the stand-in's constructor still works


# -- the stand-in API (cluster/request_path.py, cluster/app.py, cluster/supervisor.py) -------------


def test_stand_in_api_still_routes():
    v = view(e=2, p=3, d=3)
    policy = make_policy("least_loaded")
    for _ in range(6):
        decision = policy.pick(IMAGE, v)  # no cost model, no clock: priors and the wall clock
        v.begin_route(decision, IMAGE.num_items)
    assert (
        v.queue_depth(E) == 12 and v.queue_depth(P) == 6 and v.queue_depth(D) == 6
    )  # encoder counts items
    assert sum(v.healthy[P]) == 3 and v.candidates(P) == [0, 1, 2]
    assert policy.pick(TEXT, v).encoder is None


def test_text_only_request_needs_no_encoder():
    v = view()
    for i in range(3):
        v.set_healthy(E, i, False)
    assert LeastLoaded().pick(TEXT, v).encoder is None
    assert LeastLoaded().pick(TEXT, view(e=0)).encoder is None


def test_unhealthy_workers_are_never_picked_and_come_back():
    v = view()
    v.set_healthy(P, 1, False)
    policy = make_policy("round_robin")
    assert {policy.pick(IMAGE, v).prefill for _ in range(6)} == {0, 2}
    assert v.state(P, 1) is WorkerState.DOWN
    v.set_healthy(P, 1, True)
    assert {policy.pick(IMAGE, v).prefill for _ in range(6)} == {0, 1, 2}


@pytest.mark.parametrize("dead", [E, P, D])
def test_no_healthy_worker_raises(dead):
    v = view(e=2, p=2, d=2)
    for i in range(2):
        v.set_healthy(dead, i, False)
    with pytest.raises(NoWorkerError, match=dead.value):
        LeastLoaded().pick(IMAGE, v)


def test_begin_route_and_end_keep_counts_and_ms_non_negative():
    v = view(e=2, p=2, d=2)
    decision = RouteDecision(1, 0, 1)
    v.begin_route(decision, num_items=3)
    assert v.outstanding == {E: [0, 3], P: [1, 0], D: [0, 1]}
    v.begin(E, 1, 1, ms=8.0)
    v.end(E, 1, 2)  # without ms: the finished jobs' share of the worker's ms
    assert v.outstanding[E][1] == 2 and v.outstanding_ms[E][1] == pytest.approx(4.0)
    v.end(E, 1, 5)  # more than began (a duplicate completion): zero, never negative
    v.end(P, 0)
    v.end(P, 0)
    v.end(D, 1)
    assert v.outstanding == {E: [0, 0], P: [0, 0], D: [0, 0]}
    assert all(ms == 0.0 for values in v.outstanding_ms.values() for ms in values)
    v.end(E, None)  # a text-only decision touches no encoder


def test_worker_indices_must_be_dense():
    with pytest.raises(ValueError, match="prefill"):
        ClusterView([WorkerInfo(P, 0), WorkerInfo(P, 2)])


# -- reports: staleness and liveness ---------------------------------------------------------------


def test_stale_cache_reports_are_ignored():
    v = ClusterView(fleet(2, 2, 1), staleness_s=5.0, dead_after_s=100.0)
    v.publish(E, 1, now_s=0.0, cached_identifiers=frozenset({"a"}))
    v.publish(P, 0, now_s=0.0, prefix_hashes=frozenset({"h0"}))
    v.refresh(4.0)
    assert v.holds_item(1, "a") and v.prefix_blocks(0, ("h0",)) == 1
    v.refresh(5.5)
    assert not v.holds_item(1, "a") and v.prefix_blocks(0, ("h0",)) == 0
    assert v.candidates(E) == [0, 1]  # stale contents, but the worker is still alive
    v.publish(E, 1, now_s=6.0, cached_identifiers=frozenset({"b"}))
    assert v.holds_item(1, "b") and not v.holds_item(
        1, "a"
    )  # a fresh report replaces the old contents


def test_the_routers_own_dispatches_count_as_cached_for_a_while():
    router = Router(fleet(3, 3, 1), CostPriors(), "joint", staleness_s=2.0)
    profile = RequestProfile(300, (MediaJob("v", "video", 30, 4000, 10**6),), ("h0", "h1"))
    first = router.route(profile, 0.0)
    assert (
        router.view.holds_item(first.encoder, "v")
        and router.view.prefix_blocks(first.prefill, ("h0", "h1")) == 2
    )
    second = router.route(
        profile, 0.1
    )  # before any report: the encoder that has it (a hit skips its queue)
    assert (
        second.encoder == first.encoder
        and second.encode_items == ()
        and second.estimate.encoder_queue_ms == 0.0
    )
    router.view.refresh(10.0)  # long after: forgotten until a report says so
    assert not router.view.holds_item(first.encoder, "v")


def test_silent_workers_leave_and_come_back_when_they_report():
    v = ClusterView(fleet(3, 2, 2), staleness_s=1.0, dead_after_s=10.0)
    v.publish(E, 1, now_s=0.0, queued=0)
    v.publish(E, 2, now_s=8.0)
    v.refresh(9.0)
    assert v.candidates(E) == [0, 1, 2]
    v.refresh(
        10.5
    )  # encoder 1 silent for > 10 s; 0 never reported (not tracked); 2 reported at 8 s
    assert v.candidates(E) == [0, 2] and v.state(E, 1) is WorkerState.SILENT
    v.refresh(18.5)
    assert v.candidates(E) == [0]
    v.publish(E, 1, now_s=19.0)
    assert v.candidates(E) == [0, 1] and v.state(E, 1) is WorkerState.UP
    v.set_healthy(E, 1, False)  # an explicit mark wins over a fresh report
    assert v.candidates(E) == [0] and v.state(E, 1) is WorkerState.DOWN
    for i in range(2):
        v.publish(D, i, now_s=19.0)
    v.refresh(40.0)
    with pytest.raises(NoWorkerError, match="decode"):
        v.candidates(D)


def test_decode_load_takes_fresh_reports_of_other_routers_work():
    v = ClusterView(fleet(1, 1, 3), staleness_s=5.0)
    v.begin(D, 0, 2)
    v.publish(D, 1, now_s=0.0, running=7)
    v.refresh(1.0)
    assert v.decode_loads() == [2, 7, 0]
    v.refresh(6.0)
    assert v.decode_loads() == [2, 0, 0]


# -- the Router facade ----------------------------------------------------------------------------


def test_route_books_the_work_and_completions_release_it():
    router = Router(fleet(2, 2, 2), CostPriors(), "joint")
    image = RequestProfile(1000, (MediaJob("x", "image", 0.113, 576, 576 * 8192),))
    decision = router.route(image, 0.0)
    v = router.view
    assert (
        v.outstanding_ms[E][decision.encoder] == pytest.approx(decision.estimate.encode_ms)
        and decision.estimate.encode_ms > 0
    )
    assert (
        v.outstanding_ms[P][decision.prefill] == pytest.approx(decision.estimate.prefill_ms)
        and decision.estimate.prefill_ms > 0
    )
    assert v.outstanding[D][decision.decode] == 1
    # the next request sees that queue and goes elsewhere
    other = router.route(
        RequestProfile(1000, (MediaJob("y", "image", 0.113, 576, 576 * 8192),)), 0.0
    )
    assert other.encoder != decision.encoder and other.prefill != decision.prefill
    assert other.estimate.encoder_queue_ms == 0.0
    for d in (decision, other):
        router.encode_done(d, 0.01)
        router.prefill_done(d, 0.05)
        router.decode_done(d, 0.5)
    assert all(c == 0 for counts in v.outstanding.values() for c in counts)
    assert all(ms == 0.0 for values in v.outstanding_ms.values() for ms in values)


def test_completions_calibrate_the_chosen_fleet():
    router = Router(fleet(2, 2, 1), CostPriors(), "round_robin")
    for k in range(120):  # relative times are learned slowly (CalibrationConfig.speed_rate)
        size = 0.1 + 0.05 * (k % 10)
        profile = RequestProfile(200 + 50 * k, (MediaJob(f"i{k}", "image", size, 576, 4096),))
        decision = router.route(profile, k * 0.01)
        slow = 2.0 if decision.encoder == 1 else 1.0
        router.encode_done(decision, k * 0.01, duration_ms=slow * (1 + 35 * size))
        router.prefill_done(
            decision,
            k * 0.01,
            duration_ms=(3.0 if decision.prefill == 1 else 1.0)
            * (2 + profile.num_prompt_tokens / 20),
        )
        router.decode_done(decision, k * 0.01)
    cost = router.cost
    assert cost.encode_ms(1, "image", 0.3) / cost.encode_ms(0, "image", 0.3) == pytest.approx(
        2.0, rel=0.1
    )
    assert cost.prefill_ms(1, 1000) / cost.prefill_ms(0, 1000) == pytest.approx(3.0, rel=0.1)


def test_router_accepts_a_policy_object_and_reports():
    router = Router(fleet(2, 2, 1), None, make_policy("affinity", seed=2))
    router.publish(E, 1, now_s=0.0, cached_identifiers=frozenset({"a"}))
    assert router.route(IMAGE, 0.0).encoder == 1
    router.set_healthy(E, 1, False)
    assert router.route(IMAGE, 0.0).encoder == 0
    with pytest.raises(ValueError, match="joint"):
        Router(fleet(), None, "fastest")


def test_router_imports_no_torch_and_no_ray():
    code = (
        "import router.router, router.policies, router.view, router.types, router.cost_model, sys; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, "
        "[m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')]"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# -- the fast paths keep the records and the loads exactly what the plain code gives ---------------


def test_record_constructors_build_the_same_records():
    from dataclasses import fields

    from router.types import TTFTEstimate

    est = TTFTEstimate.of(1.0, 2.0, 3.0, 4.0, 5.0)
    assert est == TTFTEstimate(1.0, 2.0, 3.0, 4.0, 5.0) and hash(est) == hash(
        TTFTEstimate(1.0, 2.0, 3.0, 4.0, 5.0)
    )
    decision = RouteDecision.of(1, 2, 3, est, (_ITEM,), (), 7)
    assert (
        decision == RouteDecision(1, 2, 3, est, (_ITEM,), (), 7)
        and decision.estimated_ttft_ms == 15.0
    )
    share = EncoderShare.of(1, ("image",), 2, (_ITEM,), 1.0, 2.0, 3.0)
    assert share == EncoderShare(1, ("image",), 2, (_ITEM,), 1.0, 2.0, 3.0)
    split = RouteDecision.of(1, 2, 3, est, (_ITEM,), (), 7, (share,))
    assert (
        split == RouteDecision(1, 2, 3, est, (_ITEM,), (), 7, (share,))
        and split.encoder_for("image") == 1
    )
    job = MediaJob.of("a", "image", 0.05, 16, 4096)
    assert job == _ITEM and hash(job) == hash(_ITEM)
    profile = RequestProfile.of(100, (job,), ("h",), 16, 8)
    assert profile == RequestProfile(100, (_ITEM,), ("h",), 16, 8) and profile.modalities == {
        "image"
    }
    for record in (
        est,
        decision,
        share,
        split,
        job,
        profile,
    ):  # every field set: a field added to the class must be added to `of`
        assert set(vars(record)) == {f.name for f in fields(record)}
    with pytest.raises(AttributeError):  # still frozen
        est.encode_ms = 0.0


def test_decode_loads_kept_incrementally_equal_the_definition():
    import random

    rng = random.Random(4)
    v = ClusterView(fleet(1, 1, 5), staleness_s=2.0)
    for step in range(400):
        now = step * 0.05
        action = rng.random()
        d = rng.randrange(5)
        if action < 0.35:
            v.begin(D, d, rng.randint(1, 3))
        elif action < 0.6:
            v.end(D, d, rng.randint(1, 2))
        elif action < 0.75:
            v.publish(D, d, now_s=now - rng.uniform(0, 3), running=rng.choice([None, 0, 2, 9]))
        elif action < 0.85:
            v.begin_route(RouteDecision(None, 0, d), 0)
        v.refresh(now)
        limit = v.now_s - v.staleness_s
        expected = [
            o if r is None or r.running is None or r.at_s < limit else max(o, r.running)
            for o, r in zip(v.outstanding[D], v.reports[D])
        ]
        assert v.decode_loads() == expected, step
        assert LeastLoaded().pick(TEXT, v, None, now).decode in range(5)
