"""Media decoding in the ingress, bounded: a few decodes at once, and their freed memory
handed back to the operating system afterwards.

Why a bound: admission runs on a thread pool, and every decode there competes for the
same cores and memory; a handful of heavy items at once could stall every other
request. Why the trim: glibc keeps freed heap pages for reuse, and once it has seen large
frees it serves even multi-megabyte buffers (Pillow's 16 MB blocks, numpy arrays) from
that heap rather than from mmap, so an ingress that once decoded a few 16 MP images kept
gigabytes it no longer used. malloc_trim(0) costs well under a millisecond when there is
little to give back, so it runs after every decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Iterator

_slots: dict[int, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()


def release_memory() -> bool:
    """Return the C heap's free pages to the OS; False where that is not possible here."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def _semaphore(max_concurrent: int) -> threading.BoundedSemaphore:
    # One per size, process-wide: every ingress request path with the same limit shares it.
    with _slots_lock:
        return _slots.setdefault(max_concurrent, threading.BoundedSemaphore(max_concurrent))


@contextlib.contextmanager
def decode_slot(max_concurrent: int) -> Iterator[None]:
    """Hold one of `max_concurrent` decode slots (waiting while all are taken); on the way
    out, whether the decode worked or not, hand its freed memory back to the OS."""
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
    with _semaphore(max_concurrent):
        try:
            yield
        finally:
            release_memory()
