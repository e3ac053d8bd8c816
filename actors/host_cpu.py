"""What the rest of the host leaves idle: the cores that processes other than this one kept
busy over the latest window, from /proc (Linux). Idle-core borrowing asks this as well as its
fleet's board, since the board knows only the fleet's workers: an ingress streaming tokens, a
client on the same host or another fleet need cores too, and a step that borrows them then
waits on its own descheduled threads.
No Ray and no torch here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

WINDOW_S = 0.05  # the shortest window measured; a step within it reuses the last answer
BUSY_FIELDS = (0, 1, 2, 5, 6)  # /proc/stat cpu line: user nice system irq softirq

Sample = tuple[float, float]  # (CPU seconds of the whole host, of this process) since boot


def read_proc() -> Sample | None:
    """Busy CPU seconds of the host and of this process; None without /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        host = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        own = Path("/proc/self/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    host_s = sum(int(host[i]) for i in BUSY_FIELDS) / tick
    return host_s, (int(own[11]) + int(own[12])) / tick  # utime, stime: every thread


class HostCpu:
    """Cores of this host that other processes left idle over the latest window."""

    def __init__(
        self,
        num_cores: int | None = None,
        read: Callable[[], Sample | None] = read_proc,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_cores = num_cores or len(os.sched_getaffinity(0))
        self._read, self._clock = read, clock
        sample = read()
        self._last = None if sample is None else (clock(), *sample)
        self._spare = float(self.num_cores)

    def spare_cores(self) -> float:
        """The host's cores less those others kept busy; all of them if /proc can't tell."""
        now = self._clock()
        if self._last is None or now - self._last[0] < WINDOW_S:
            return self._spare
        sample = self._read()
        if sample is None:
            return self._spare
        then_s, host_s, own_s = self._last
        others_s = max(0.0, (sample[0] - host_s) - (sample[1] - own_s))
        self._spare = max(0.0, self.num_cores - others_s / (now - then_s))
        self._last = (now, *sample)
        return self._spare
