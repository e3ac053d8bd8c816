"""cluster/body_budget.py: bodies that carry media are charged from their Content-Length as
they arrive and refused once the budget is full; small bodies (text) never are; a charge
comes back once, whoever gives it back."""

from __future__ import annotations

import threading

import pytest
from starlette.datastructures import Headers

from cluster.backpressure import Overloaded
from cluster.body_budget import COUNTED_MIN_BYTES, MB, BodyBudget, content_length
from cluster.config import LimitsConfig


def test_bodies_are_charged_until_the_budget_is_full_and_then_refused_by_name():
    budget = BodyBudget(4 * MB, 2 * MB)
    first, second = budget.take(2 * MB), budget.take(2 * MB)
    assert budget.in_flight == 4 * MB
    with pytest.raises(Overloaded, match="limits.max_request_bodies_mb = 4"):
        budget.take(COUNTED_MIN_BYTES)
    first.release()
    budget.take(COUNTED_MIN_BYTES).release()  # room again
    second.release()
    assert budget.in_flight == 0


def test_small_or_unknown_bodies_are_never_charged_or_refused():
    budget = BodyBudget(COUNTED_MIN_BYTES, COUNTED_MIN_BYTES)
    held = budget.take(COUNTED_MIN_BYTES)
    for length in (COUNTED_MIN_BYTES - 1, 0, None):
        charge = budget.take(length)  # a text request beside a full budget
        assert charge.nbytes == 0
    held.release()


def test_a_body_over_the_request_limit_is_charged_only_up_to_it():
    budget = BodyBudget(3 * MB, 2 * MB)
    charge = budget.take(50 * MB)  # its handler refuses it (413) after reading 2 MB
    assert charge.nbytes == budget.in_flight == 2 * MB


def test_a_charge_comes_back_once_though_both_ends_give_it_back():
    budget = BodyBudget(8 * MB, 2 * MB)
    charges = [budget.take(2 * MB) for _ in range(4)]
    threads = [threading.Thread(target=c.release) for c in charges for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.in_flight == 0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"content-length", b"123")], 123),
        ([(b"Content-Length", b"7")], 7),
        ([(b"content-type", b"application/json")], None),
        ([(b"content-length", b"x1")], None),
        (Headers({"content-length": "42"}), 42),
        (Headers({}), None),
    ],
)
def test_content_length_from_asgi_or_starlette_headers(headers, expected):
    assert content_length(headers) == expected


def test_a_budget_that_cannot_hold_one_allowed_body_is_refused_by_name():
    with pytest.raises(ValueError, match="max_request_bodies_mb = 8 cannot hold one body"):
        LimitsConfig(max_request_bodies_mb=8, max_request_bytes=16 * MB)
    assert LimitsConfig().max_request_bodies_mb * MB >= LimitsConfig().max_request_bytes
