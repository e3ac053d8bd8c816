"""Idle-core borrowing: a worker's device step may use more torch threads while no other
worker of its fleet on the same node has work. An idle cluster then answers a request with
every core, as a single process would; under load each worker keeps `torch_threads`, since
oversubscribed threads collapse on small hosts.

The workers of one fleet on one node share a directory (under /dev/shm) of one-byte files,
one per worker process: 1 while that worker has work, 0 when it has none, 2 while it computes
a short prompt that the node's long forwards make way for (actors/engine/node_priority.py). A worker
marks itself busy before it looks at the others, so of two that start at once neither borrows.
The board knows only the fleet's workers; the cores the rest of the host keeps busy (an
ingress streaming tokens, clients, other fleets) come from /proc (actors/host_cpu.py).
No Ray and no torch here: tests drive several boards as several workers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

from actors.host_cpu import HostCpu

BUSY, IDLE, URGENT = b"\x01", b"\x00", b"\x02"
RESCAN_S = 0.5  # how often the directory is listed again (new or restarted workers)
BOARD_PREFIX = "epd-cores-"  # board directories are named this plus the fleet's id
# A core counts as idle while other processes keep less than half of it busy: Ray's own
# daemons tick on an idle host.
IDLE_CORE_SLACK = 0.5


def default_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_dead_boards(root: Path, keep: str) -> None:
    """Remove the board directories of fleets whose workers are all gone. Ray kills workers
    without a clean exit, so their files outlive them; each new worker clears what earlier
    fleets left on its node. An empty directory is left alone: a worker may be creating it."""
    for board in root.glob(BOARD_PREFIX + "*"):
        pids = (
            [int(p.name) for p in board.iterdir() if p.name.isdigit()]
            if board.is_dir() and board.name != keep
            else []
        )
        if pids and not any(_alive(pid) for pid in pids):
            with contextlib.suppress(OSError):  # another worker swept it first
                for pid in pids:
                    (board / str(pid)).unlink(missing_ok=True)
                board.rmdir()


class NodeBoard:
    """This process's flag and a view of its peers' (the files of dead processes go)."""

    def __init__(self, name: str, root: Path | None = None, pid: int | None = None):
        root = root or default_root()
        sweep_dead_boards(root, keep=name)
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pid = pid if pid is not None else os.getpid()
        self._fd = os.open(self.dir / str(self.pid), os.O_RDWR | os.O_CREAT, 0o644)
        self._flag: bytes | None = None  # as last written
        self._busy = self._urgent = False
        self._lock = threading.Lock()
        # pid -> its file mapped: read without a syscall, which would hand the GIL to the
        # actor's event loop (a step asks between layers).
        self._views: dict[int, mmap.mmap] = {}
        self._scanned_s = float("-inf")
        self._post()

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._post()

    def set_urgent(self, urgent: bool) -> None:
        """While set, the flag says URGENT (and busy): peers' long forwards make way."""
        self._urgent = urgent
        self._post()

    def _post(self) -> None:
        with self._lock:  # busy is posted by the device thread, urgent also by the caller's
            flag = URGENT if self._urgent else BUSY if self._busy else IDLE
            if flag != self._flag:
                os.pwrite(self._fd, flag, 0)
                self._flag = flag

    def peer_pids(self) -> frozenset[int]:
        """The fleet's other workers on this node, as of the last listing (`rescan`)."""
        return frozenset(self._views)

    def others_busy(self) -> bool:
        self.rescan()
        for pid, view in list(self._views.items()):
            if view[:1] != IDLE:
                if _alive(pid):
                    return True
                self._forget(pid, unlink=True)  # died in a step: its flag says busy forever
        return False

    def others_urgent(self) -> bool:
        """Whether a peer computes a short prompt now (its flag URGENT)."""
        self.rescan()
        return any(view[:1] == URGENT for view in list(self._views.values()))

    def num_others_busy(self) -> int:
        """Peers with work now (urgent ones included), as of the last listing."""
        return sum(view[:1] != IDLE for view in list(self._views.values()))

    def rescan(self) -> None:
        """List the fleet's workers again if the last listing is older than RESCAN_S."""
        now = time.monotonic()
        if now - self._scanned_s < RESCAN_S:
            return
        self._scanned_s = now
        listed = {int(p.name) for p in self.dir.iterdir() if p.name.isdigit()} - {self.pid}
        for pid in [pid for pid in listed if not _alive(pid)]:  # killed without a clean exit
            listed.discard(pid)
            with contextlib.suppress(OSError):
                os.unlink(self.dir / str(pid))
        for pid in set(self._views) - listed:
            self._forget(pid)
        for pid in listed - set(self._views):
            self._watch(pid)

    def _watch(self, pid: int) -> None:
        try:
            fd = os.open(self.dir / str(pid), os.O_RDONLY)
        except OSError:  # gone between the listing and the open
            return
        try:
            self._views[pid] = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
        except ValueError:  # created, not written yet: the next listing tries again
            pass
        finally:
            os.close(fd)  # the mapping outlives it

    def _forget(self, pid: int, unlink: bool = False) -> None:
        self._views.pop(pid).close()
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.dir / str(pid))

    def close(self) -> None:
        for pid in list(self._views):
            self._forget(pid)
        os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.dir / str(self.pid))
            self.dir.rmdir()  # the last worker of the fleet on this node


class ThreadPolicy:
    """How many torch threads the next device step uses: up to `idle_threads` while no peer
    on the board has work and the host's other processes leave cores idle (`host`), else
    `threads`. Without a board (or nothing to borrow) always `threads`."""

    def __init__(
        self,
        threads: int,
        idle_threads: int | None = None,
        board: NodeBoard | None = None,
        host: HostCpu | None = None,
    ):
        self.threads, self.board, self.host = threads, board, host
        self.idle_threads = idle_threads if board is not None and idle_threads else threads

    def for_step(self, pays: bool = True) -> int:
        """`pays`: the step is big enough to gain from more threads (a small one loses what
        waking them costs)."""
        if self.board is None:
            return self.threads
        self.board.set_busy(True)  # first: of two workers starting at once, neither borrows
        if self.idle_threads <= self.threads or not pays:  # posts its work, borrows nothing
            return self.threads
        # The host's answer first: it is cached between reads, and the board's listing is
        # syscalls that hand this thread's GIL to the actor's event loop on a busy worker.
        # The listing is kept current either way: the host's reading leaves the peers out.
        self.board.rescan()
        spare = self.idle_threads if self.host is None else self.host.spare_cores()
        threads = max(self.threads, min(self.idle_threads, int(spare + IDLE_CORE_SLACK)))
        if threads == self.threads or self.board.others_busy():
            return self.threads
        return threads

    def step_done(self, more_work: bool) -> None:
        """After a step: busy while work is left (a decode loop between steps), else idle."""
        if self.board is not None:
            self.board.set_busy(more_work)
