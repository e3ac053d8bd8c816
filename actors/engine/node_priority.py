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
slows long work, never stops it. A worker is urgent from the moment a short prompt waits in
it (`wait_begins`), not only while it computes one: its own long chunk then reaches the next
layer boundary, where the prompt runs, on cores its peers leave it. A decode loop makes way
between two steps (`between_steps`), for at most as long as its steps since computed and
never more than MAX_STEP_CREDIT_S at once: on the 2-core host the slowest text prompts beside
video shared the cores with a decode step that never stopped (docs/BENCHMARKS.md). A worker
that dies while urgent is forgotten at the board's next listing (actors/idle_cores.py).

A short prompt's forward may also run at a lower niceness (`urgent(niceness)`, with the boost
the worker gives, actors/thread_priority.py): a decode step at niceness 0 and a local client
otherwise take the core it needs from a worker at Ray's 15. While a short prompt waits behind
this worker's own long forward, that forward is lent the same niceness until the prompt starts
(`wait_begins(request_id, niceness)`): at Ray's 15 beside decode its layer took the prompt's
wait with it (the slowest tenth of texts beside video queued 30-70 ms for their worker).

No torch, no Ray: the engines call `urgent()`, `yielding()` and `pause()`; tests drive it with
several boards as several workers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

POLL_S = 0.0005  # how often a paused forward looks at the board again
# A decode loop's longest wait for a peer's short prompt: about one such forward on a busy
# 2-core host; the streams' next tokens wait meanwhile.
MAX_STEP_CREDIT_S = 0.1


class Board(Protocol):
    """The node's board as this needs it (actors/idle_cores.py NodeBoard)."""

    def set_urgent(self, urgent: bool) -> None: ...
    def others_urgent(self) -> bool: ...
    def num_others_busy(self) -> int: ...


class Boost(Protocol):
    """A thread's niceness lowered for a while (actors/thread_priority.py NicenessBoost)."""

    num_boosts: int

    def at(self, niceness: int | None) -> contextlib.AbstractContextManager[None]: ...
    def lend(self, tid: int, niceness: int | None) -> int | None: ...
    def give_back(self, tid: int, niceness: int) -> None: ...


class NodePriority:
    """This process's side of the node's priority: mark short work, pause long work."""

    def __init__(
        self,
        board: Board | None,
        num_cores: int,  # the node's cores this process may use (host_cpu.usable_cores)
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        boost: Boost | None = None,  # the thread's niceness in an urgent forward
    ):
        self.board, self.num_cores, self._clock, self._sleep = board, num_cores, clock, sleep
        self.boost = boost
        self._began_s: float | None = None  # start of the long forward in progress
        self._paused_s = 0.0  # within it
        self.total_paused_s = 0.0  # since the worker started
        self.num_pauses = 0
        self._num_computing = 0  # short-prompt forwards in progress (one may nest in another)
        self._waiting: set[str] = set()  # short prompts here, not started yet
        self._lock = threading.Lock()  # waits begin on the caller's thread, end on the device's
        self._step_credit_s = 0.0  # how long a decode loop may still make way
        self._long_tid: int | None = None  # the thread in a long forward (yielding)
        self._lent: int | None = None  # its niceness before a waiting prompt lowered it
        self._wait_niceness: int | None = None

    @contextlib.contextmanager
    def urgent(self, niceness: int | None = None) -> Iterator[None]:
        """Around the forward of short prompts: peers' long forwards make way meanwhile, this
        one does not pause for theirs (a short prompt run inside a long forward), and with a
        boost the calling thread runs at `niceness` (None: its own)."""
        if self.board is None:
            yield
            return
        outer, self._began_s = self._began_s, None
        self._post(computing=+1)
        try:
            with self.boost.at(niceness) if self.boost else contextlib.nullcontext():
                yield
        finally:
            self._post(computing=-1)
            self._began_s = outer

    def wait_begins(self, request_id: str, niceness: int | None = None) -> None:
        """A short prompt waits here: urgent from now until `wait_ends`; a long forward of this
        worker's in progress runs at `niceness` meanwhile (None: its own)."""
        self._wait_niceness = niceness
        self._post(begins=request_id)

    def wait_ends(self, request_id: str) -> None:
        """It started (its forward is urgent itself), or it left."""
        self._post(ends=request_id)

    @property
    def num_boosts(self) -> int:
        """Urgent forwards this thread's niceness was lowered for."""
        return self.boost.num_boosts if self.boost else 0

    @property
    def short_waiting(self) -> bool:
        """A short prompt waits in this worker (work that can follow it should)."""
        return bool(self._waiting)

    def _post(self, computing: int = 0, begins: str = "", ends: str = "") -> None:
        if self.board is None:
            return
        with self._lock:
            self._num_computing += computing
            if begins:
                self._waiting.add(begins)
            self._waiting.discard(ends)
            self.board.set_urgent(self._num_computing > 0 or bool(self._waiting))
            self._lend()

    def _lend(self) -> None:
        """Under the lock: the long forward in progress at the waits' niceness while a short
        prompt waits behind it, back at its own once none does or the forward ends."""
        tid, boost = self._long_tid, self.boost
        if boost is None or tid is None:
            return
        if self._waiting and self._lent is None:
            self._lent = boost.lend(tid, self._wait_niceness)
        elif (not self._waiting or self._began_s is None) and self._lent is not None:
            boost.give_back(tid, self._lent)
            self._lent = None

    @contextlib.contextmanager
    def yielding(self) -> Iterator[Callable[[], float]]:
        """Around a long forward: `pause()` may wait inside it. Gives a function that returns
        the seconds paused so far in it (not compute: costs and stats leave it out)."""
        self._began_s, self._paused_s = self._clock(), 0.0
        with self._lock:
            self._long_tid = threading.get_native_id()
            self._lend()  # a short prompt came while the forward was planned
        try:
            yield lambda: self._paused_s
        finally:
            self._began_s = None
            with self._lock:
                self._lend()  # given back: the forward is over
                self._long_tid = None

    def pause(self) -> None:
        """Between two layers: wait while a peer is urgent, for at most as long as this forward
        has computed less what it has paused already."""
        if self._began_s is None or self.board is None or self._waiting or not self._contended():
            return  # a short prompt of its own waits: this forward goes on to the next layer
        started_s = now = self._clock()
        until = now + (now - self._began_s - self._paused_s) - self._paused_s
        if now >= until:
            return
        self.num_pauses += 1
        # A short prompt that reaches this worker meanwhile ends the pause: it runs at the next
        # layer boundary, not after the peer's.
        while now < until and not self._waiting and self._contended():
            self._sleep(min(POLL_S, until - now))
            now = self._clock()
        self._paused_s += now - started_s
        self.total_paused_s += now - started_s

    def between_steps(self, step_s: float) -> None:
        """Between two steps of a decode loop (`step_s`: the last one's length): wait while a
        peer is urgent, for at most as long as the steps since the last wait computed."""
        credit_s = self._step_credit_s = min(self._step_credit_s + step_s, MAX_STEP_CREDIT_S)
        if self.board is None or credit_s <= 0 or not self._contended():
            return
        started_s = now = self._clock()
        self.num_pauses += 1
        while now < started_s + credit_s and self._contended():
            self._sleep(min(POLL_S, started_s + credit_s - now))
            now = self._clock()
        # A sleep the OS stretched past the credit is not owed: the next step earns anew.
        self._step_credit_s = max(0.0, self._step_credit_s - (now - started_s))
        self.total_paused_s += now - started_s

    def _contended(self) -> bool:
        """A peer is urgent, and the workers with work (this one too) outnumber the cores."""
        board = self.board
        return board.others_urgent() and board.num_others_busy() + 1 > self.num_cores
