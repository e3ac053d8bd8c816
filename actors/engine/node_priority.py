"""Node-wide priority for short prompts: while a prefill worker computes prompts that each
fit one step, the long forwards of the other workers on its node (an encoder's tower, another
prefill worker's chunk of a long prompt) pause between two of their layers, and the short
prompt's forward has the cores.

Why: layer-boundary preemption (engine/preempt.py) lets a short prompt go ahead of a long one
inside one worker, but on a node whose cores the stages share, a text prompt's own forward
beside a video's encode and another worker's video chunk ran 2-3x its idle length on the
2-core CPU host (docs/BENCHMARKS.md, text beside video).

Only while the node is oversubscribed: a forward pauses while a peer is urgent and the
workers with work outnumber the cores (itself included), since a pause on a node with a core
to spare would leave that core idle. Bounded: a forward pauses at most as long as it has
computed so far, so it keeps at least half of the wall clock and a stream of short prompts
slows long work, never stops it. Decode steps never pause (they are short, and every
stream's next token waits for them). A worker that dies while urgent is forgotten at the
board's next listing (actors/idle_cores.py).

No torch, no Ray: the engines call `urgent()`, `yielding()` and `pause()`; tests drive it with
several boards as several workers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Protocol

POLL_S = 0.0005  # how often a paused forward looks at the board again


class Board(Protocol):
    """The node's board as this needs it (actors/idle_cores.py NodeBoard)."""

    def set_urgent(self, urgent: bool) -> None: ...
    def others_urgent(self) -> bool: ...
    def num_others_busy(self) -> int: ...


class NodePriority:
    """This process's side of the node's priority: mark short work, pause long work."""

    def __init__(
        self,
        board: Board | None,
        num_cores: int,  # the node's cores this process may use (host_cpu.usable_cores)
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.board, self.num_cores, self._clock, self._sleep = board, num_cores, clock, sleep
        self._began_s: float | None = None  # start of the long forward in progress
        self._paused_s = 0.0  # within it
        self.total_paused_s = 0.0  # since the worker started
        self.num_pauses = 0

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """Around the forward of short prompts: peers' long forwards make way meanwhile, and
        this one does not pause for theirs (a short prompt run inside a long forward)."""
        if self.board is None:
            yield
            return
        outer, self._began_s = self._began_s, None
        self.board.set_urgent(True)
        try:
            yield
        finally:
            self.board.set_urgent(False)
            self._began_s = outer

    @contextlib.contextmanager
    def yielding(self) -> Iterator[Callable[[], float]]:
        """Around a long forward: `pause()` may wait inside it. Gives a function that returns
        the seconds paused so far in it (not compute: costs and stats leave it out)."""
        self._began_s, self._paused_s = self._clock(), 0.0
        try:
            yield lambda: self._paused_s
        finally:
            self._began_s = None

    def pause(self) -> None:
        """Between two layers: wait while a peer is urgent, for at most as long as this forward
        has computed less what it has paused already."""
        if self._began_s is None or self.board is None or not self._contended():
            return
        started_s = now = self._clock()
        until = now + (now - self._began_s - self._paused_s) - self._paused_s
        if now >= until:
            return
        self.num_pauses += 1
        while now < until and self._contended():
            self._sleep(min(POLL_S, until - now))
            now = self._clock()
        self._paused_s += now - started_s
        self.total_paused_s += now - started_s

    def _contended(self) -> bool:
        """A peer is urgent, and the workers with work (this one too) outnumber the cores."""
        board = self.board
        return board.others_urgent() and board.num_others_busy() + 1 > self.num_cores
