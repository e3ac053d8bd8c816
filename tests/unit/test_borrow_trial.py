"""Idle-core borrowing for a loop of like steps: both thread counts tried in turn, the faster
kept for a while, then tried again; a step the host cannot lend to is no evidence."""

from __future__ import annotations

from actors import borrow_trial
from actors.borrow_trial import BorrowTrial
from actors.idle_cores import NodeBoard, ThreadPolicy


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _run(trial: BorrowTrial, key: int, own_s: float, borrowed_s: float, steps: int) -> list[bool]:
    """`steps` steps of size `key` taking `own_s` or `borrowed_s`: what each one chose."""
    chosen = []
    for _ in range(steps):
        borrow = trial.allows(key)
        trial.timed(key, borrow, borrowed_s if borrow else own_s)
        chosen.append(borrow)
    return chosen


def test_a_loop_tries_both_counts_in_turn_and_keeps_the_faster():
    trial, n = BorrowTrial(Clock()), borrow_trial.SAMPLES
    chosen = _run(trial, 5, own_s=0.070, borrowed_s=0.090, steps=2 * n + 20)
    assert chosen[: 2 * n] == [True, False] * n, "alternating while on trial"
    assert not any(chosen[2 * n :]), "borrowing lost: own threads from then on"
    assert trial.verdicts() == {5: False}
    faster = BorrowTrial(Clock())
    assert all(_run(faster, 5, own_s=0.070, borrowed_s=0.040, steps=2 * n + 20)[2 * n :])
    assert faster.verdicts() == {5: True}


def test_a_gain_within_the_margin_is_not_worth_borrowing():
    trial = BorrowTrial(Clock())
    barely = 0.070 * (1 - borrow_trial.MIN_GAIN / 2)
    _run(trial, 3, own_s=0.070, borrowed_s=barely, steps=2 * borrow_trial.SAMPLES)
    assert trial.verdicts() == {3: False}


def test_each_size_has_its_own_verdict_and_a_verdict_expires():
    clock, n = Clock(), borrow_trial.SAMPLES
    trial = BorrowTrial(clock)
    _run(trial, 5, own_s=0.070, borrowed_s=0.090, steps=2 * n)
    _run(trial, 0, own_s=0.030, borrowed_s=0.010, steps=2 * n)
    assert trial.verdicts() == {5: False, 0: True}
    clock.now_s += borrow_trial.VERDICT_S + 1  # the host may have changed: try again
    assert trial.allows(5), "a new trial starts with a borrowed step"
    assert trial.verdicts() == {0: True}
    trial.timed(5, True, 0.010)
    _run(trial, 5, own_s=0.070, borrowed_s=0.010, steps=2 * n)
    assert trial.verdicts()[5] is True


def test_the_policy_puts_a_sized_step_on_trial_only_where_it_could_borrow(tmp_path, monkeypatch):
    monkeypatch.setattr(borrow_trial, "SAMPLES", 1)
    policy = ThreadPolicy(1, 2, NodeBoard("fleet", tmp_path))  # no peers, no host reading
    assert policy.for_step() == 2, "an unsized step borrows as before"
    policy.timed(0.001)
    assert policy.trial.verdicts() == {}, "and is not on trial"
    assert policy.for_step(key=4) == 2
    policy.timed(0.090)
    assert policy.for_step(key=4) == 1
    policy.timed(0.070)
    assert policy.trial.verdicts() == {4: False}
    assert policy.for_step(key=4) == 1, "borrowing lost at this size"
    lone = ThreadPolicy(1, 1, NodeBoard("fleet", tmp_path))  # nothing to lend
    assert lone.for_step(key=4) == 1
    lone.timed(0.5)
    assert lone.trial.verdicts() == {} and not lone.trial._trials, "no evidence from it"
