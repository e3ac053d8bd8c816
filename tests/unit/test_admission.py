"""Bounded admission (cluster/backpressure.py): budgets fill, refuse with Overloaded, and every
ticket gives back exactly what it took, however the request ends."""

from __future__ import annotations

import pytest

from cluster.backpressure import Admission, Overloaded


def test_waiting_tokens_bound_admission_and_free_at_the_first_token():
    adm = Admission(max_waiting_tokens=1000, max_generating=10)
    a, b = adm.admit(600), adm.admit(400)
    with pytest.raises(Overloaded, match="1000 prompt tokens are waiting"):
        adm.admit(1)
    a.first_token()
    assert adm.waiting_tokens == 400 and adm.generating == 1
    c = adm.admit(600)
    for ticket in (a, b, c):
        ticket.release()
        ticket.release()  # idempotent: a second release takes nothing twice
    assert adm.waiting_tokens == 0 and adm.generating == 0


def test_a_lone_prompt_larger_than_the_budget_is_let_in_when_nothing_waits():
    adm = Admission(max_waiting_tokens=100, max_generating=10)
    big = adm.admit(5000)
    with pytest.raises(Overloaded):
        adm.admit(10)
    big.release()
    adm.admit(10)


def test_requests_in_the_cluster_bound_admission():
    adm = Admission(max_waiting_tokens=10_000, max_generating=2)
    tickets = [adm.admit(10) for _ in range(2)]
    with pytest.raises(Overloaded, match="2 requests are generating or on their way"):
        adm.admit(10)  # both still wait for their first token: each will hold a decode slot
    for t in tickets:
        t.first_token()
        t.first_token()  # a resumed request's second "first token" counts once
    assert adm.generating == 2
    with pytest.raises(Overloaded, match=r"2 requests .* \(2 generating, 0 waiting"):
        adm.admit(10)
    tickets[0].release()
    adm.admit(10)


def test_generating_never_passes_its_budget():
    """Waiting tickets hold their slot: their first tokens cannot take generating past it."""
    adm = Admission(max_waiting_tokens=10_000, max_generating=3)
    tickets = []
    while True:
        try:
            tickets.append(adm.admit(5))
        except Overloaded:
            break
    for t in tickets:
        t.first_token()
    assert adm.generating == len(tickets) == 3


def test_requests_still_being_admitted_count_at_arrival():
    adm = Admission(max_waiting_tokens=10_000, max_generating=4)
    adm.admit(10).first_token()
    adm.check_room(num_admitting=2)  # 1 generating + 2 on their way: room for one more
    with pytest.raises(Overloaded, match=r"1 generating, 0 waiting .* 3 being admitted"):
        adm.check_room(num_admitting=3)


def test_arrival_is_refused_only_while_a_budget_is_full():
    adm = Admission(max_waiting_tokens=100, max_generating=2)
    adm.check_room()  # empty: room
    waiting = adm.admit(60)
    adm.check_room()  # 60 of 100: a smaller prompt may still fit
    more = adm.admit(40)
    with pytest.raises(Overloaded, match="100 prompt tokens are waiting"):
        adm.check_room()
    more.release()
    waiting.first_token()  # one generating, none waiting: room for one more
    adm.check_room()
    with pytest.raises(Overloaded, match="2 requests are generating or on their way"):
        adm.check_room(num_admitting=1)
    waiting.release()
    adm.check_room(num_admitting=1)


def test_a_resized_budget_applies_to_the_next_arrival_and_tickets_keep_theirs():
    adm = Admission(max_waiting_tokens=10_000, max_generating=4)
    tickets = [adm.admit(10) for _ in range(3)]
    for t in tickets:
        t.first_token()
    adm.resize(max_waiting_tokens=5_000, max_generating=2)  # a second replica joined
    with pytest.raises(Overloaded, match="the limit is 2"):
        adm.admit(10)
    for t in tickets:
        t.release()
    assert adm.generating == 0
    adm.admit(10)
