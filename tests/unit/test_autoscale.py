"""Autoscaling's plain logic, without Ray: the pool-size decision (router/autoscale.py), the
booked load summed over replicas (cluster/pool_scaling.py), the config's bounds, and the
router's view of slots that empty, fill and move (router/view.py, cluster/snapshot.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import load_config
from cluster.controller import sum_bookings
from cluster.pool_scaling import BookedLoad
from cluster.snapshot import FleetSnapshot, Scaling
from router.autoscale import MeasuredLoad, PoolScaler, ScalingRule
from router.cost_model import CostPriors
from router.router import Router
from router.types import MediaJob, RequestProfile, WorkerInfo, WorkerKind
from tests.unit.conftest import fleet

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
RULE = ScalingRule(
    min_workers=1, max_workers=4, target_utilization=0.5, up_delay_s=2.0, down_delay_s=10.0
)


def test_wanted_workers_carry_the_load_at_the_target_within_bounds():
    assert RULE.wanted(0.0) == 1  # the floor
    assert RULE.wanted(1.0) == 2  # exactly two workers at 50%: not three
    assert RULE.wanted(1.01) == 3
    assert RULE.wanted(50.0) == 4  # the ceiling


def test_growth_waits_for_the_up_delay_then_jumps_to_what_the_load_needs():
    scaler = PoolScaler(RULE)
    assert scaler.decide(1.5, 1, now_s=0.0) == 1  # above target since t=0
    assert scaler.decide(1.5, 1, now_s=1.9) == 1
    assert scaler.decide(1.5, 1, now_s=2.0) == 3  # 1.5 workers' load at 50%: three at once


def test_a_dip_restarts_the_up_delay():
    scaler = PoolScaler(RULE)
    scaler.decide(1.5, 1, now_s=0.0)
    assert scaler.decide(0.2, 1, now_s=1.5) == 1  # the burst paused
    assert scaler.decide(1.5, 1, now_s=2.5) == 1  # a new spell: its own 2 s
    assert scaler.decide(1.5, 1, now_s=4.5) == 3


def test_shrinking_goes_one_worker_per_down_delay():
    scaler = PoolScaler(RULE)
    sizes, size = [], 4
    for t in range(0, 40):
        size = scaler.decide(0.1, size, now_s=float(t))
        sizes.append(size)
    assert sizes[9] == 4 and sizes[10] == 3  # after the first 10 s, one worker
    assert sizes[19] == 3 and sizes[20] == 2  # then a whole delay again for the next
    assert sizes[-1] == 1  # and never below the floor


def test_load_back_before_the_down_delay_keeps_the_workers():
    scaler = PoolScaler(RULE)
    assert scaler.decide(0.1, 3, now_s=0.0) == 3
    assert scaler.decide(1.2, 3, now_s=5.0) == 3  # needs 3 again: the spell ends
    assert scaler.decide(0.1, 3, now_s=12.0) == 3  # a new spell since 12 s
    assert scaler.decide(0.1, 3, now_s=22.0) == 2


def test_below_the_floor_returns_to_it_at_once():
    scaler = PoolScaler(ScalingRule(2, 4, 0.5, up_delay_s=30.0, down_delay_s=30.0))
    assert scaler.decide(0.0, 1, now_s=0.0) == 2


def counters(busy_s: float, work_in: int, work_done: int) -> dict[str, float]:
    """A worker's stats as the controller reads them for MeasuredLoad."""
    return {"busy_s": busy_s, "work_in": work_in, "work_done": work_done}


def test_measured_load_prices_what_arrives_at_what_a_unit_cost_lately():
    """One worker, busy all the time, while three workers' worth of work arrives: 3.0, not
    the 1.0 its busy time alone says; no estimate to calibrate first."""
    load = MeasuredLoad()
    assert load.update({(E, 0): counters(5.0, 100, 100)}, dt_s=1.0) == 0.0  # nothing to compare
    # The next second: 1 s busy for 10 units (0.1 s each), and 30 arrived.
    assert load.update({(E, 0): counters(6.0, 130, 110)}, dt_s=1.0) == pytest.approx(3.0)
    # A second in which no unit finished (a long batch): the last unit cost prices arrivals.
    assert load.update({(E, 0): counters(6.0, 145, 110)}, dt_s=0.5) == pytest.approx(3.0)
    # Two workers: their time and work add up.
    two = {(E, 0): counters(7.0, 150, 120), (E, 1): counters(0.5, 5, 5)}
    assert load.update(two, dt_s=1.0) == pytest.approx(1.0)  # (E, 1) is new: counted next time
    two = {(E, 0): counters(8.0, 160, 130), (E, 1): counters(1.5, 15, 15)}
    assert load.update(two, dt_s=1.0) == pytest.approx(2.0)  # busy 2 s for 20 units, 20 came
    # A restarted worker (its counters went back) counts from the next period; idle is 0.
    two = {(E, 0): counters(0.0, 0, 0), (E, 1): counters(1.5, 15, 15)}
    assert load.update(two, dt_s=1.0) == 0.0


def test_booked_load_sums_replicas_and_counts_only_what_is_new():
    book = BookedLoad()
    book.report("a:", {"encoder": [100.0, 0.0], "prefill": [50.0]})
    book.report("b:", {"encoder": [0.0, 30.0], "prefill": [0.0]})
    assert book.take() == {("encoder", 0): 100.0, ("encoder", 1): 30.0, ("prefill", 0): 50.0}
    book.report("a:", {"encoder": [160.0, 0.0], "prefill": [50.0]})
    assert book.take() == {("encoder", 0): 60.0}  # only the growth since its last report
    assert book.take() == {}
    book.forget("a:")  # a replica that died; a new one with its totals starts from zero
    book.report("c:", {"encoder": [10.0, 0.0]})
    assert book.take() == {("encoder", 0): 10.0}


def _config(**pool):
    base = load_config().model_dump(mode="json")
    base["encoder"] = {**base["encoder"], **pool}
    return type(load_config()).model_validate(base)


def test_autoscaling_bounds_are_checked_and_slots_follow_max_workers():
    config = _config(num_workers=1, autoscaling={"min_workers": 1, "max_workers": 3})
    assert config.encoder.num_slots == 3 and config.prefill.num_slots == 1
    modalities = config.encoder_modalities(frozenset(config.encoder_pools[0].modalities or []))
    assert len(modalities) == 3  # one entry per slot: the router's workers
    with pytest.raises(ValidationError, match="exceeds max_workers"):
        _config(autoscaling={"min_workers": 3, "max_workers": 2})
    with pytest.raises(ValidationError, match="must lie within"):
        _config(num_workers=4, autoscaling={"min_workers": 1, "max_workers": 3})


def test_autoscaling_needs_the_object_store_transport():
    data = _config(autoscaling={"max_workers": 2}).model_dump(mode="json")
    data["transport"] = {"embeddings": "gloo", "kv": "gloo"}
    with pytest.raises(ValidationError, match="needs fixed pools.*encoder sets autoscaling"):
        type(load_config()).model_validate(data)


def test_an_emptied_slot_leaves_routing_and_its_cache_the_view():
    router = Router(fleet(2, 1, 1), CostPriors(), "joint")
    router.publish(E, 1, now_s=0.0, queued=0, cached_identifiers=frozenset({"img"}))
    assert router.view.holds_item(1, "img")
    router.forget(E, 1, now_s=0.1)
    assert not router.view.holds_item(1, "img") and router.view.candidates(E) == [0]
    router.set_healthy(E, 1, True)  # a new worker started in the slot
    assert router.view.candidates(E) == [0, 1]


def test_routing_books_load_for_the_autoscaler_and_set_infos_places_workers_anew():
    router = Router(fleet(2, 2, 1), CostPriors(), "joint")
    image = RequestProfile(500, (MediaJob("x", "image", 0.1, 256, 256 * 4096),))
    decision = router.route(image, 0.0)
    totals = router.booked_ms_totals()
    assert totals["encoder"][decision.encoder] == pytest.approx(decision.estimate.encode_ms)
    assert totals["prefill"][decision.prefill] == pytest.approx(decision.estimate.prefill_ms)
    router.encode_done(decision, 0.01)
    assert router.booked_ms_totals() == totals  # running totals: completions do not lower them
    moved = [
        WorkerInfo(w.kind, w.index, node="node-b" if w.index else "node-a") for w in fleet(2, 2, 1)
    ]
    router.set_infos(moved)
    assert router.view.num_nodes == 2 and router.view.node_ids[E] == [0, 1]
    with pytest.raises(ValueError, match="same worker slots"):
        router.set_infos(fleet(3, 2, 1))


def test_a_snapshot_routes_only_to_running_workers_that_do_not_drain():
    pools = {E: ("e0", None, "e2"), P: ("p0",), D: ("d0",)}
    ids = {k: tuple(a or "" for a in v) for k, v in pools.items()}
    scaling = Scaling(starting=frozenset({(E, 1)}), draining=frozenset({(E, 2)}))
    snap = FleetSnapshot(4, pools, ids, (), None, scaling)
    assert [snap.routable(E, i) for i in range(3)] == [True, False, False]
    assert len(snap.all_actors()) == 4  # the running ones, draining included
    assert snap.pool_sizes()["encoder"] == {"slots": 3, "routed": 1, "starting": 1, "draining": 1}


def test_the_controller_sums_the_other_replicas_bookings_per_worker():
    a = {"encoder": [10.0, 0.0], "prefill": [5.0]}
    b = {"encoder": [1.0, 2.0], "prefill": [0.0]}
    assert sum_bookings([a, b]) == {"encoder": [11.0, 2.0], "prefill": [5.0]}
    assert sum_bookings([]) is None  # no other replica: routers keep the workers' counts


def test_shared_bookings_stop_counting_once_the_other_replicas_are_gone():
    router = Router(fleet(1, 2, 1), CostPriors(), "joint")
    router.share_foreign({"encoder": [0.0], "prefill": [500.0, 0.0]}, num_others=1)
    assert router.view.foreign_queue_ms(P) == [500.0, 0.0]
    assert router.route(RequestProfile(100), 0.0).prefill == 1  # the other's queue on worker 0
    router.share_foreign(None, num_others=0)  # the last other replica died
    assert router.view.foreign_queue_ms(P) is None  # its last share no longer counts
