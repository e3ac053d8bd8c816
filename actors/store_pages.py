"""The object store's pages this process wrote or read, let go once used.

Putting an array into Ray's object store writes it through this process's shared mapping of
the store (`/dev/shm/plasma...`), and reading one maps its pages the same way; every page
touched stays mapped here afterwards, counted in this process's RSS (RssShmem) though the
object is the store's, bounded by its own budget, and may be gone. In the ingress, which puts
every decoded image, that was about 1 GiB of "its" RSS under a burst of big uploads (issue
#29), enough to make it the kernel's first choice to kill; an encoder reads them all.
`madvise(MADV_DONTNEED)` on a shared mapping only drops this process's page-table entries:
the data stays in the store's shared memory, and a later access maps it again. Linux only;
elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

MADV_DONTNEED = 4  # Linux's value on every architecture Ray ships for
# A release scans this process's maps and costs about 1 ms: done once this much has been put
# since the last, so a big image's pages go at once and small ones' cost is spread thin.
RELEASE_EVERY_BYTES = 8 << 20


def store_ranges(maps_text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each shared mapping of a plasma file in a /proc/<pid>/maps text.
    Private mappings are never included: DONTNEED would discard their data."""
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "plasma" not in fields[5] or fields[1][3:4] != "s":
            continue
        start, end = fields[0].split("-")
        yield int(start, 16), int(end, 16)


class StorePages:
    """Drops this process's mapping of the store's pages (not their data)."""

    def __init__(self, maps_path: str = "/proc/self/maps"):
        self.maps_path = maps_path
        self._madvise = _libc_madvise() if sys.platform.startswith("linux") else None
        self._lock = threading.Lock()  # admission threads put at once
        self._unreleased_bytes = 0

    def release(self) -> int:
        """Bytes of address space advised; 0 where the platform has no such call."""
        if self._madvise is None:
            return 0
        try:
            with open(self.maps_path) as maps:
                ranges = list(store_ranges(maps.read()))
        except OSError:  # no /proc here: only RSS is at stake, never a request
            return 0
        for start, end in ranges:
            self._madvise(start, end - start, MADV_DONTNEED)  # best effort: RSS, not data
        return sum(end - start for start, end in ranges)

    def due(self, num_bytes: int) -> bool:
        """`num_bytes` more of the store written or read here: True (and counting afresh)
        once RELEASE_EVERY_BYTES have come since the last release."""
        with self._lock:
            self._unreleased_bytes += num_bytes
            if self._unreleased_bytes < RELEASE_EVERY_BYTES:
                return False
            self._unreleased_bytes = 0
            return True

    def putter(self, put: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`put` (ray.put), each value's bytes noted."""

        def put_and_release(value: Any) -> Any:
            ref = put(value)
            if self.due(getattr(value, "nbytes", 0)):
                self.release()
            return ref

        return put_and_release


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
