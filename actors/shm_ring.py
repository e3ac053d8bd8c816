"""A one-way ring of shared memory beside a link (actors/wire.py), for its calls' large buffers.

A frame over a loopback socket costs more the larger it is (a link's 750 kB of pixels: about
1.5 ms one way here, against 0.65 through a segment both ends map). The link's writer owns a
segment and offers its name; the reader attaches, which works only on the same node (the same
/dev/shm), removes the name and says so: a crash on either side then leaves nothing behind.
One producer, one consumer, in frame order: a frame names its buffers' places (`Region`),
the reader copies each out and moves the tail (a counter in the segment's first bytes) past
it, and the writer reuses what lies behind the tail. A buffer that finds no room goes inside
its frame, as every buffer did before.

Plain Python: no Ray, no torch, no asyncio.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from typing import NamedTuple

_HEADER_BYTES = 64  # the reader's tail (8 bytes), the nonce (16), room to spare
_NONCE = slice(8, 24)
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives (Linux)
SHM_MIN_FREE_BYTES = 256 << 20
# Mapped with its pages: no fault on a request's first pass through the ring.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_NAME = re.compile(r"epd_[0-9a-f]{16}")


class Region(NamedTuple):
    start: int  # a position counted from the ring's first byte ever written, never wrapped
    num_bytes: int


class RingOffer(NamedTuple):
    name: str
    nonce: bytes


class _Ring:
    def __init__(self, fd: int, num_bytes: int):
        try:
            self._map = mmap.mmap(fd, num_bytes, flags=_MAP_FLAGS)
        finally:
            os.close(fd)  # the mapping keeps the segment
        view = memoryview(self._map)
        self._tail = view[:8].cast("Q")  # one aligned 8-byte word: stored and loaded whole
        self._data = view[_HEADER_BYTES:]
        self.capacity_bytes = len(self._data)

    def _place(self, region: Region) -> slice:
        at = region.start % self.capacity_bytes
        return slice(at, at + region.num_bytes)

    def close(self) -> None:
        """Unmap (exported views first: mmap refuses to close under them)."""
        self._tail.release()
        self._data.release()
        self._map.close()


class RingWriter(_Ring):
    """The writer's end: it creates the segment (its pages reserved now, so a full /dev/shm
    fails here and not as a SIGBUS mid-copy) and puts buffers in."""

    def __init__(self, capacity_bytes: int):
        name = f"epd_{secrets.token_hex(8)}"
        self._path = os.path.join(SHM_DIR, name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _HEADER_BYTES + capacity_bytes)
        except OSError:
            os.close(fd)
            os.unlink(self._path)
            raise
        super().__init__(fd, _HEADER_BYTES + capacity_bytes)
        self.offer = RingOffer(name, secrets.token_bytes(16))
        self._map[_NONCE] = self.offer.nonce
        self._head = 0  # where the next buffer goes: the writer's own, never shared

    @classmethod
    def where_room(cls, capacity_bytes: int) -> RingWriter:
        """A ring, where /dev/shm keeps SHM_MIN_FREE_BYTES free beside it (Ray's object store
        may live there too); OSError otherwise."""
        stats = os.statvfs(SHM_DIR)
        free_bytes = stats.f_bavail * stats.f_frsize
        if free_bytes < capacity_bytes + SHM_MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, f"{free_bytes >> 20} MiB free in {SHM_DIR}")
        return cls(capacity_bytes)

    def put(self, buffer: memoryview) -> Region | None:
        """Copy `buffer` (bytes, 1-D) in; where it went, or None when the ring lacks room."""
        num_bytes, start = buffer.nbytes, self._head
        if start % self.capacity_bytes + num_bytes > self.capacity_bytes:
            start += self.capacity_bytes - start % self.capacity_bytes  # wrap: skip the end
        tail = self._tail[0]  # all before it is read; a lap behind [start, end) lies under it
        if tail < self._head and start + num_bytes - self.capacity_bytes > tail:
            return None  # the reader has yet to copy out what this would overwrite
        region = Region(start, num_bytes)
        self._data[self._place(region)] = buffer
        self._head = start + num_bytes
        return region

    def unlink(self) -> None:
        """Remove the name (if the reader has not): the segment lives while either end maps it."""
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


class RingReader(_Ring):
    """The reader's end: attached by name, checked by nonce."""

    num_taken_bytes = 0  # buffers copied out so far, for the worker's stats

    @classmethod
    def attach(cls, offer: RingOffer) -> RingReader | None:
        """The writer's ring, or None where its segment is not here (another node)."""
        if not isinstance(offer.name, str) or not _NAME.fullmatch(offer.name):
            return None
        path = os.path.join(SHM_DIR, offer.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        num_bytes = os.fstat(fd).st_size
        if num_bytes <= _HEADER_BYTES:
            os.close(fd)
            return None
        ring = cls(fd, num_bytes)
        if ring._map[_NONCE] != offer.nonce:
            ring.close()
            return None
        os.unlink(path)  # both ends map it now: nothing is left if either dies before the other
        return ring

    def take(self, region: Region) -> bytearray:
        """A copy of the buffer at `region` (writable, as one sent inside a frame is), its
        room given back to the writer. A region out of order or out of bounds is a broken
        peer's: ValueError."""
        start, num_bytes = region
        if start < self._tail[0] or start % self.capacity_bytes + num_bytes > self.capacity_bytes:
            raise ValueError(f"a ring region {region} the writer cannot have written")
        copy = bytearray(self._data[self._place(region)])
        self._tail[0] = start + num_bytes
        self.num_taken_bytes += num_bytes
        return copy
