"""What the rest of the host leaves idle: the cores that processes other than this worker and
its fleet's peers on the node kept busy over the last ~150 ms, from /proc (Linux).
Idle-core borrowing asks this as well as its fleet's board, since the board knows only the
fleet's workers: an ingress streaming tokens, a client on the same host or another fleet need
cores too, and a step that borrows them then waits on its own descheduled threads.
- The peers' own CPU is left out: the board says whether they are busy now, and a window that
  saw the previous request's other stage at work (an encoder before this prefill) says nothing
  about now.
- A sampler thread keeps the window recent: a reading taken only at each step spans the whole
  gap since the last one, so at idle it held the request's own earlier hops.
No Ray and no torch here.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

TICK_S = 0.05  # how often the sampler reads /proc; a step within a tick reuses the last answer
NUM_MARKS = 4  # the window spans the last 3 ticks: /proc counts in 10 ms ticks per process
BUSY_FIELDS = (0, 1, 2, 5, 6)  # /proc/stat cpu line: user nice system irq softirq

Sample = tuple[float, float]  # CPU seconds since boot: the whole host's; this process's and peers'


def _process_s(stat: bytes, tick: int) -> float:
    fields = stat.rsplit(b") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime: every thread


class ProcReader:
    """Reads the counters from /proc files it keeps open. A /proc file read again from offset
    0 is generated anew, and a kept file skips the path walk and the open: a tick at 20 Hz
    took 1.0% of a core opening its files and 0.27% reading kept ones (a 2-core VM). A
    process's stat file kept open reads as gone once that process is, even if its pid is
    reused."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._tick = os.sysconf("SC_CLK_TCK")

    def __call__(self, peers: Iterable[int] = ()) -> Sample | None:
        """Busy CPU seconds of the host and of this process plus `peers` (pids; one that is
        gone counts nothing); None without /proc."""
        try:
            host = self._read("/proc/stat").split(b"\n", 1)[0].split()[1:]
            own_s = _process_s(self._read("/proc/self/stat"), self._tick)
        except (OSError, IndexError):
            return None
        wanted = {"/proc/stat", "/proc/self/stat"}
        for pid in peers:
            wanted.add(path := f"/proc/{pid}/stat")
            try:
                own_s += _process_s(self._read(path), self._tick)
            except (OSError, IndexError):
                self._forget(path)
        for path in self._fds.keys() - wanted:
            self._forget(path)  # a peer that left the fleet
        return sum(int(host[i]) for i in BUSY_FIELDS) / self._tick, own_s

    def close(self) -> None:
        for path in list(self._fds):
            self._forget(path)

    def _read(self, path: str) -> bytes:
        if (fd := self._fds.get(path)) is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return os.pread(fd, 4096, 0)

    def _forget(self, path: str) -> None:
        if (fd := self._fds.pop(path, None)) is not None:
            os.close(fd)


class Mark(NamedTuple):
    at_s: float
    peers: frozenset[int]
    host_s: float
    own_s: float


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota
    (a container's CPU limit, as in a Kubernetes pod: v2 `cpu.max`, or v1's CFS quota)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    return max(1, min(cores, int(quota + 0.5))) if quota else cores


def _cgroup_quota(root: str) -> float | None:
    """Cores' worth of CPU time the cgroup allows, or None when unlimited or unknown."""
    pair = _read_words(f"{root}/cpu.max") or (
        _read_words(f"{root}/cpu/cpu.cfs_quota_us") + _read_words(f"{root}/cpu/cpu.cfs_period_us")
    )
    if len(pair) < 2 or not pair[0].isdigit() or not pair[1].isdigit() or int(pair[1]) == 0:
        return None  # "max" or -1: no limit
    return int(pair[0]) / int(pair[1])


def _read_words(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except OSError:
        return []


class HostCpu:
    """Cores of this host that processes other than this one and its peers (`peers()`: the
    fleet's other workers here) left idle over the latest window."""

    def __init__(
        self,
        num_cores: int | None = None,
        peers: Callable[[], frozenset[int]] = frozenset,
        read: Callable[[frozenset[int]], Sample | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_cores = num_cores or usable_cores()
        self._peers, self._read, self._clock = peers, read or ProcReader(), clock
        self._marks: deque[Mark] = deque(maxlen=NUM_MARKS)
        self._lock = threading.Lock()  # the sampler and a step may read at once
        self._spare = float(self.num_cores)
        self.tick()

    def start(self) -> HostCpu:
        """Read every tick on a daemon thread from now on, so the window ends when it is asked."""
        threading.Thread(target=self._sample, name="host-cpu", daemon=True).start()
        return self

    def spare_cores(self) -> float:
        """The host's cores less those others kept busy; all of them if /proc can't tell."""
        if not self._marks or self._clock() - self._marks[-1].at_s >= TICK_S:
            self.tick()  # no sampler, or it fell behind
        return self._spare

    def tick(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the other thread is reading: its answer will do
        try:
            peers, now = self._peers(), self._clock()
            sample = self._read(peers)
            if sample is None:
                return
            if self._marks and self._marks[-1].peers != peers:
                self._marks.clear()  # a peer came or went: its counter has no baseline yet
            if self._marks and now > (then := self._marks[0]).at_s:
                others_s = max(0.0, (sample[0] - then.host_s) - (sample[1] - then.own_s))
                self._spare = max(0.0, self.num_cores - others_s / (now - then.at_s))
            self._marks.append(Mark(now, peers, *sample))
        finally:
            self._lock.release()

    def _sample(self) -> None:
        while True:
            time.sleep(TICK_S)
            self.tick()
