"""What the rest of the host leaves idle: the cores that processes other than this worker and
its fleet's peers on the node kept busy over the latest window, from /proc (Linux).
Idle-core borrowing asks this as well as its fleet's board, since the board knows only the
fleet's workers: an ingress streaming tokens, a client on the same host or another fleet need
cores too, and a step that borrows them then waits on its own descheduled threads. The peers'
own CPU is left out: the board says whether they are busy now, and a window that saw the
previous request's other stage at work (an encoder before this prefill) says nothing about now.
No Ray and no torch here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

WINDOW_S = 0.05  # the shortest window measured; a step within it reuses the last answer
BUSY_FIELDS = (0, 1, 2, 5, 6)  # /proc/stat cpu line: user nice system irq softirq

Sample = tuple[float, float]  # CPU seconds since boot: the whole host's; this process's and peers'


def _process_s(stat: str, tick: int) -> float:
    fields = stat.rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime: every thread


def read_proc(peers: Iterable[int] = ()) -> Sample | None:
    """Busy CPU seconds of the host and of this process plus `peers` (pids; one that is gone
    counts nothing); None without /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        host = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        own_s = _process_s(Path("/proc/self/stat").read_text(), tick)
    except (OSError, IndexError):
        return None
    for pid in peers:
        try:
            own_s += _process_s(Path(f"/proc/{pid}/stat").read_text(), tick)
        except (OSError, IndexError):
            pass
    return sum(int(host[i]) for i in BUSY_FIELDS) / tick, own_s


class HostCpu:
    """Cores of this host that processes other than this one and its peers left idle over the
    latest window."""

    def __init__(
        self,
        num_cores: int | None = None,
        read: Callable[[frozenset[int]], Sample | None] = read_proc,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_cores = num_cores or len(os.sched_getaffinity(0))
        self._read, self._clock = read, clock
        self._peers: frozenset[int] = frozenset()
        sample = read(self._peers)
        self._last = None if sample is None else (clock(), *sample)
        self._spare = float(self.num_cores)

    def spare_cores(self, peers: frozenset[int] = frozenset()) -> float:
        """The host's cores less those others kept busy; all of them if /proc can't tell.
        `peers`: the fleet's other workers here, whose CPU is not the others'."""
        now = self._clock()
        if self._last is None or now - self._last[0] < WINDOW_S:
            return self._spare
        sample = self._read(peers)
        if sample is None:
            return self._spare
        if peers != self._peers:  # a peer came or went: its counter has no baseline yet
            self._peers, self._last = peers, (now, *sample)
            return self._spare
        then_s, host_s, own_s = self._last
        others_s = max(0.0, (sample[0] - host_s) - (sample[1] - own_s))
        self._spare = max(0.0, self.num_cores - others_s / (now - then_s))
        self._last = (now, *sample)
        return self._spare
