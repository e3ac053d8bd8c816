"""Whether borrowed threads pay, measured on the steps themselves. An idle core is worth
borrowing for a big step; for a steady loop of small ones (a decode batch of a small model)
two threads can lose to one even on a quiet host: every op waits for the slower thread, and
an ingress streaming the loop's tokens takes the second core in bursts. So a loop that keeps
running steps of one size tries both counts, alternating, and keeps the faster for a while.
No Ray and no torch here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SAMPLES = 4  # steps timed with each thread count before a verdict
MIN_GAIN = 0.05  # borrowed steps must be this much faster than own-thread ones to be kept
VERDICT_S = 10.0  # how long a verdict stands before the next trial (the host changes)


@dataclass
class _Trial:
    own_s: list[float] = field(default_factory=list)
    borrowed_s: list[float] = field(default_factory=list)
    borrow: bool | None = None  # the verdict; None while the trial runs
    decided_at: float = 0.0


class BorrowTrial:
    """Per step size (a key such as a decode batch's bucket): borrow or not, from step times."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._trials: dict[int, _Trial] = {}

    def allows(self, key: int) -> bool:
        """Whether the next step of this size may borrow (the caller also needs idle cores)."""
        trial = self._trials.get(key)
        if trial is None or (
            trial.borrow is not None and self._clock() - trial.decided_at > VERDICT_S
        ):
            trial = self._trials[key] = _Trial()
        if trial.borrow is not None:
            return trial.borrow
        return len(trial.borrowed_s) <= len(trial.own_s)  # alternate, borrowed first

    def timed(self, key: int, borrowed: bool, seconds: float) -> None:
        """A step of this size took `seconds` with borrowed threads or its own."""
        trial = self._trials.get(key)
        if trial is None or trial.borrow is not None:
            return
        (trial.borrowed_s if borrowed else trial.own_s).append(seconds)
        if min(len(trial.own_s), len(trial.borrowed_s)) >= SAMPLES:
            gain = 1.0 - statistics.median(trial.borrowed_s) / statistics.median(trial.own_s)
            trial.borrow, trial.decided_at = gain >= MIN_GAIN, self._clock()

    def verdicts(self) -> dict[int, bool]:
        """Step sizes with a verdict standing: whether they borrow."""
        return {k: t.borrow for k, t in self._trials.items() if t.borrow is not None}
