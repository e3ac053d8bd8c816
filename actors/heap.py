"""A model worker's C heap: memory a step frees is kept for the next step, not handed back.

glibc serves a large block (above a threshold that adapts up to 32 MiB) with its own mmap and
returns it on free, and trims the top of a heap once more than twice that threshold lies free
there. A worker's steps allocate and free the same large blocks over and over (activations, a
prompt's KV, the decode batch's buffers when they grow), so each step would fault them in
afresh: on the 2-core VM a 219-token prefill of bench-llava's LM took 49 ms with the heap
kept against 57-62 ms without, in one process (docs/BENCHMARKS.md, 2026-12-02). A CUDA
caching allocator does for device memory what this does for host memory: the process keeps
its peak.

An operator's own malloc settings win: with MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ or
glibc.malloc tunables in the environment, the process is left as they set it. Plain ctypes; a
C library without mallopt (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest: blocks above it still get their own mmap
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: never trim, in practice


def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None


def operator_set(environ: Mapping[str, str]) -> bool:
    """Whether the environment already tunes glibc's malloc thresholds."""
    own = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
    return any(name in environ for name in own) or "glibc.malloc." in environ.get(
        "GLIBC_TUNABLES", ""
    )


def keep_freed_memory(mallopt=None, environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's thresholds for this process: blocks up to 32 MiB from the heap, and freed
    heap memory kept. True if the C library took both settings; False, changing nothing,
    where the operator's environment sets them or the library has no mallopt."""
    if operator_set(environ):
        return False
    mallopt = mallopt or _mallopt()
    if mallopt is None:
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.info("this C library refused mallopt; freed memory goes back to the OS as before")
    return ok
