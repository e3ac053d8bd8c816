"""A prefill worker's utilisation (router/busy.py) and what it does to joint's choice."""

from __future__ import annotations

import math

import pytest

from router.busy import BusyRates
from router.calibration import CalibrationConfig
from router.cost_model import CostModel
from router.policies import Joint
from router.types import RequestProfile, WorkerKind
from router.view import ClusterView
from tests.unit.conftest import fleet

P = WorkerKind.PREFILL


def test_a_steady_booking_rate_is_the_utilisation_and_its_wait_grows_by_one_over_one_less_it():
    busy = BusyRates(2, memory_s=10.0, max_busy=0.95)
    for k in range(1, 2001):  # 60 ms booked every 100 ms on worker 0, for 200 s (20 memories)
        busy.book(0, 60.0, k * 0.1)
    rho = busy.utilisation(200.0)
    assert rho[0] == pytest.approx(0.6, rel=0.01) and rho[1] == 0.0
    assert busy.factors(200.0) == pytest.approx([1 / 0.4, 1.0], rel=0.02)


def test_utilisation_fades_with_its_memory_and_the_growth_is_capped():
    busy = BusyRates(1, memory_s=10.0, max_busy=0.9)
    for k in range(1, 2001):
        busy.book(0, 200.0, k * 0.1)  # twice what the worker can do: rho 2
    assert busy.utilisation(200.0)[0] == pytest.approx(2.0, rel=0.01)
    assert busy.factors(200.0) == [pytest.approx(10.0)]  # 1 / (1 - 0.9), not negative or infinite
    assert busy.utilisation(230.0)[0] == pytest.approx(
        2.0 * math.exp(-3), rel=0.01
    )  # idle for 3 memories


def test_no_growth_when_max_busy_is_zero():
    busy = BusyRates(2, memory_s=10.0, max_busy=0.0)
    for k in range(100):
        busy.book(1, 500.0, k * 0.1)
    assert busy.factors(10.0) == [1.0, 1.0]


def test_rebasing_over_a_long_run_keeps_the_rate_finite_and_right():
    busy = BusyRates(1, memory_s=1.0, max_busy=0.95)
    for k in range(
        1, 200_001
    ):  # 20,000 s: 20,000 memories, far past where e**(t / memory) overflows
        busy.book(0, 30.0, k * 0.1)
    # right after a booking: the steady sawtooth's top, 0.03 / (1 - e**-0.1) (0.3 on average)
    assert busy.utilisation(20_000.0)[0] == pytest.approx(0.03 / (1 - math.exp(-0.1)), rel=1e-6)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("busy_memory_s", 0.0, "busy_memory_s must be > 0"),
        ("max_busy", 1.0, r"max_busy must be in \[0, 1\)"),
    ],
)
def test_a_busy_setting_that_cannot_hold_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(**{field: value})


def test_a_busy_memory_without_max_busy_is_refused_rather_than_ignored():
    with pytest.raises(ValueError, match="busy_memory_s has no effect while max_busy is 0"):
        CalibrationConfig.from_dict({"busy_memory_s": 30.0})
    assert (
        CalibrationConfig.from_dict({"busy_memory_s": 30.0, "max_busy": 0.9}).busy_memory_s == 30.0
    )


def test_joint_sends_a_prompt_to_the_worker_whose_wait_grows_less():
    # Two equal prefill workers, the same work booked on both; worker 0 has been twice as busy, so
    # shorter arrivals will overtake more there: the plain argmin took worker 0 (the lower index).
    view = ClusterView(fleet(0, 2, 1))
    view.refresh(10.0)
    for p in (0, 1):
        view.begin(P, p, 1, 300.0)
    plain = CostModel.for_view(
        None, view, CalibrationConfig(spread_z=0.0)
    )  # max_busy 0, the default: booked work alone
    grown = CostModel.for_view(None, view, CalibrationConfig(max_busy=0.95, spread_z=0.0))
    for cost in (plain, grown):
        for k in range(100):
            cost.busy.book(0, 80.0, k * 0.1)
            cost.busy.book(1, 40.0, k * 0.1)
    profile = RequestProfile(500)
    assert Joint().pick(profile, view, plain, 10.0).prefill == 0
    decision = Joint().pick(profile, view, grown, 10.0)
    assert decision.prefill == 1
    # the estimate it reports keeps the booked work: growth ranks workers, it does not price the
    # wait
    assert decision.estimate.prefill_queue_ms == pytest.approx(300.0)
