"""Media decoding in a small pool of child processes with a memory cap.

Why children: decoding a few large images or videos grows a process's heap by hundreds
of megabytes that glibc keeps (fragmented around live blocks) even after malloc_trim, so
an ingress that decoded in its own threads never came back to its idle size. A child's
heap goes away with it: each child serves `max_tasks_per_child` decodes, then exits and
is replaced. Each is capped by RLIMIT_AS (`max_memory_mb`), so one decode can never take
the machine's memory; one that needs more fails with a MediaError naming the limit, and
a child that dies for any reason is replaced, failing only the decode it was running.
A child that has not answered within `max_decode_s` (hung in a decoder, or stopped) is
killed and replaced too, so that it cannot hold its slot until the request times out.
With a `hold` (the request's share of the ingress's in-flight budget), a child asks before it
decodes (child.HoldAsk); time spent waiting for that answer does not count against the deadline.

Children are started with subprocess (fork + exec of a fresh interpreter; never a plain
fork of the many-threaded ingress) and talk over a socketpair. The pool is made lazily,
once per process and configuration, and its children exit with the process (atexit, or
on their own when the socket closes if the process is killed).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from cluster.media.budget import Hold
from cluster.media.child import DecodeReply, DecodeTask, HoldAsk
from cluster.media.errors import MediaError
from cluster.media.pool import release_memory

_ROOT = str(Path(__file__).resolve().parents[2])  # holds the `cluster` package the children import
_START_TIMEOUT_S = (
    120.0  # a fresh interpreter importing numpy, Pillow and PyAV, on a loaded machine
)


@dataclass(frozen=True)
class PoolShape:
    """How many children, how big, how long-lived."""

    num_workers: int
    max_memory_mb: int
    max_tasks_per_child: int
    max_decode_s: float  # one item's deadline, from sending the task to the last byte of its answer


class _Child:
    """One decoding child and the ingress end of its socket."""

    def __init__(self, shape: PoolShape) -> None:
        parent_end, child_end = Pipe(duplex=True)
        fd = child_end.fileno()
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
        )  # one decode, one core
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cluster.media.child",
                "--fd",
                str(fd),
                "--max-memory-mb",
                str(shape.max_memory_mb),
                "--max-tasks",
                str(shape.max_tasks_per_child),
            ],
            pass_fds=(fd,),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child_end.close()  # so that the child's death reads as EOF here
        self.conn: Connection = parent_end
        self.tasks_left = shape.max_tasks_per_child
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            if not self.conn.poll(_START_TIMEOUT_S) or self.conn.recv() != "ready":
                raise RuntimeError("a media decoding process did not start")
            self.ready = True

    def close(self) -> None:
        self.conn.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _recv_array(conn: Connection, into: memoryview) -> None:
    """One `send_bytes` message read straight into `into`. Connection.recv_bytes_into would
    gather it in a BytesIO first and copy it twice, holding the GIL for both: with a 48 MB
    image that stalled the ingress's event loop (py-spy: 70% of the GIL's time under a burst of
    large images). `os.readv` copies in the kernel with the GIL released."""
    fd = conn.fileno()
    (size,) = struct.unpack("!i", _read_exactly(fd, 4))
    if size == -1:  # Connection's framing for messages of 2 GiB or more
        (size,) = struct.unpack("!Q", _read_exactly(fd, 8))
    if size != len(into):
        raise OSError(f"a decoding process sent {size} bytes for a {len(into)}-byte array")
    filled = 0
    while filled < size:
        count = os.readv(fd, [into[filled:]])
        if count == 0:
            raise EOFError("a decoding process closed its socket mid-array")
        filled += count


def _exit_code(process: subprocess.Popen) -> int:
    """A child whose socket failed has exited or is exiting; one that broke the framing may still
    run, and is killed after a moment."""
    try:
        return process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _read_exactly(fd: int, size: int) -> bytes:
    out = b""
    while len(out) < size:
        chunk = os.read(fd, size - len(out))
        if not chunk:
            raise EOFError("a decoding process closed its socket")
        out += chunk
    return out


class DecodePool:
    """At most `shape.num_workers` decodes at once, each in a capped child process."""

    def __init__(self, shape: PoolShape) -> None:
        self.shape = shape
        self._slots = threading.BoundedSemaphore(shape.num_workers)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._closed = False

    def decode(self, task: DecodeTask, hold: Hold | None = None) -> tuple[DecodeReply, np.ndarray]:
        """Run `task` in a child: (reply, array); MediaError (or the child's own exception, or
        `hold`'s) on failure. `hold` answers the child's HoldAsk (when `task.asks_hold`)."""
        with self._slots:
            child = self._take()
            try:
                reply, data = self._exchange(child, task, hold)
            except BaseException:
                self._retire(
                    child
                )  # died, or this thread was interrupted mid-exchange: never reuse it
                raise
            finally:
                release_memory()
            self._give_back(child, reusable=not reply.out_of_memory)
        self._raise_failure(reply, task.param)
        return reply, data

    def _exchange(
        self, child: _Child, task: DecodeTask, hold: Hold | None
    ) -> tuple[DecodeReply, np.ndarray | None]:
        """Send `task`, read its answer. A child silent past the deadline is a MediaError naming
        limits.max_decode_s; `decode` then kills it, as it does any child an exchange failed
        with."""
        try:
            child.wait_ready()  # a child's start is not the item's fault: outside the deadline
            deadline_s = time.monotonic() + self.shape.max_decode_s
            child.conn.send(task)
            child.tasks_left -= 1
            reply, refused = self._reply(child, deadline_s, task.param, hold)
            if refused is not None:  # the child stopped, and is as good as new
                return dataclasses.replace(reply, error=refused), None
            if reply.media_error is not None or reply.error is not None or reply.out_of_memory:
                return reply, None
            data = np.empty(reply.shape, np.dtype(reply.dtype))
            self._await(child, deadline_s, task.param)
            _recv_array(child.conn, memoryview(data).cast("B"))
            return reply, data
        except (EOFError, OSError):
            code = _exit_code(child.process)
            raise MediaError(self._died(code), task.param) from None

    def _reply(
        self, child: _Child, deadline_s: float, param: str, hold: Hold | None
    ) -> tuple[DecodeReply, Exception | None]:
        """The task's reply header, answering the child's HoldAsk on the way: (reply, what
        `hold` raised when it refused)."""
        refused = None
        while True:
            self._await(child, deadline_s, param)
            message = child.conn.recv()
            if not isinstance(message, HoldAsk):
                return message, refused
            started_s = time.monotonic()
            try:
                if hold is None:
                    raise RuntimeError("a decoding process asked to hold an item; none was given")
                hold(message.num_bytes, message.param, message.noun)
            except Exception as exc:  # noqa: BLE001 - raised once the child has stopped
                refused = exc
            child.conn.send(refused is None)
            deadline_s += time.monotonic() - started_s  # waiting for room is not decoding

    def _await(self, child: _Child, deadline_s: float, param: str) -> None:
        if not child.conn.poll(max(0.0, deadline_s - time.monotonic())):
            raise MediaError(
                "decoding this item took longer than this server's "
                f"{self.shape.max_decode_s:g} s per item (limits.max_decode_s); its decoding "
                "process was stopped. Send a smaller or simpler item",
                param,
            )

    def _died(self, code: int) -> str:
        return (
            f"decoding this item stopped its decoding process (exit status {code}); it may need "
            f"more than this server's {self.shape.max_memory_mb} MB per decode "
            "(limits.max_decode_memory_mb)"
        )

    def _raise_failure(self, reply: DecodeReply, param: str) -> None:
        if reply.media_error is not None:
            raise MediaError(*reply.media_error)
        if reply.out_of_memory:
            raise MediaError(
                "decoding this item needs more than this server's "
                f"{self.shape.max_memory_mb} MB per decode (limits.max_decode_memory_mb); "
                "send a smaller or shorter item",
                param,
            )
        if reply.error is not None:
            raise reply.error

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("the media decoding pool is shut down")
            if self._idle:
                return self._idle.pop()
        return _Child(self.shape)

    def _give_back(self, child: _Child, *, reusable: bool) -> None:
        with self._lock:
            if reusable and child.tasks_left > 0 and not self._closed:
                self._idle.append(child)
                return
        self._retire(child)

    def _retire(self, child: _Child) -> None:
        """Stop `child` (its heap goes with it) and start its replacement, which imports while
        nobody waits."""
        child.close()
        with self._lock:
            if not self._closed:
                self._idle.append(_Child(self.shape))

    def child_pids(self) -> list[int]:
        """Process ids of the idle children (for tests and probes)."""
        with self._lock:
            return [child.process.pid for child in self._idle]

    def shutdown(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for child in idle:
            child.close()


_pools: dict[PoolShape, DecodePool] = {}
_pools_lock = threading.Lock()


def decode_pool(shape: PoolShape) -> DecodePool:
    """This process's pool of `shape`, made on first use."""
    with _pools_lock:
        pool = _pools.get(shape)
        if pool is None:
            pool = _pools[shape] = DecodePool(shape)
        return pool


@atexit.register
def shutdown_pools() -> None:
    """Stop every pool's children (at exit; tests call it too)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown()
