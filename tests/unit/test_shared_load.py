"""Several ingress replicas share one fleet, each with its own router: what a worker reports
beyond a router's own bookings is other replicas' work, and routing steers around it
(router/view.py `foreign`, priced by the cost model). No torch, no Ray."""

from __future__ import annotations

from router.router import Router
from router.types import MediaJob, RequestProfile, WorkerInfo, WorkerKind

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
ALL = frozenset({"image", "video", "audio"})
TEXT = RequestProfile(num_prompt_tokens=200)


def _router(e: int = 2, p: int = 2, d: int = 2) -> Router:
    infos = (
        [WorkerInfo(E, i, modalities=ALL) for i in range(e)]
        + [WorkerInfo(P, i) for i in range(p)]
        + [WorkerInfo(D, i) for i in range(d)]
    )
    return Router(infos, policy="joint")


def _image(identifier: str) -> RequestProfile:
    return RequestProfile(
        num_prompt_tokens=200, items=(MediaJob(identifier, "image", 0.3, 64, 4096),)
    )


def test_other_replicas_prefill_queue_steers_this_router_away():
    assert _router().route(TEXT, 0.0).prefill == 0  # idle fleet: ties go to the first worker
    router = _router()
    router.publish(P, 0, now_s=0.1, queued=6)  # six requests of another replica queue on prefill 0
    assert router.view.foreign[P] == [6, 0]
    decisions = [router.route(TEXT, 0.2) for _ in range(4)]
    assert [d.prefill for d in decisions] == [
        1,
        1,
        1,
        1,
    ]  # its own four still cost less than the other's six


def test_own_bookings_are_not_counted_twice():
    router = _router()
    mine = [router.route(TEXT, 0.0) for _ in range(4)]  # spread over both prefill workers
    per_worker = [sum(d.prefill == p for d in mine) for p in range(2)]
    for p in range(2):  # each reports exactly this router's own requests
        router.publish(P, p, now_s=0.1, queued=per_worker[p])
    assert router.view.foreign[P] == [0, 0] and router.view.num_foreign[P] == 0


def test_other_replicas_encoder_queue_steers_images_away():
    router = _router()
    router.publish(E, 0, now_s=0.0, queued=5, running=3)
    assert router.view.foreign[E] == [8, 0]
    assert {router.route(_image(f"img-{i}"), 0.1).encoder for i in range(3)} == {1}


def test_decode_takes_the_larger_of_own_and_reported_running():
    router = _router()
    router.publish(D, 0, now_s=0.0, running=5)
    assert [router.route(TEXT, 0.1).decode for _ in range(3)] == [1, 1, 1]


def test_a_later_report_replaces_the_foreign_count():
    router = _router()
    router.publish(P, 0, now_s=0.0, queued=6)
    router.publish(P, 0, now_s=0.2, queued=0)  # the other replica's requests finished
    assert router.view.foreign[P] == [0, 0] and router.view.num_foreign[P] == 0
