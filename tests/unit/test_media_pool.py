"""cluster/media/pool.py: a few decodes at once, and freed memory handed back to the OS."""

from __future__ import annotations

import threading
import time

import numpy as np
import psutil
import pytest

from cluster.media import pool as media_pool

MB = 2**20


def test_decode_slots_bound_concurrency() -> None:
    inside, most, lock = [0], [0], threading.Lock()

    def decode() -> None:
        with media_pool.decode_slot(2):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=decode) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 2


def test_freed_heap_memory_goes_back_to_the_os() -> None:
    """Buffers below glibc's mmap threshold live on the heap; one still in use above them
    pins it, so freeing them leaves the process's RSS where it was until the trim."""
    if not media_pool.release_memory():
        pytest.skip("no malloc_trim in this C library")
    rss = lambda: psutil.Process().memory_info().rss
    buffers = [np.ones(64 * 1024 - 64, np.uint8) for _ in range(3000)]  # ~190 MB, 64 KB each
    pin = np.ones(64 * 1024 - 64, np.uint8)
    del buffers
    freed = rss()
    media_pool.release_memory()
    assert freed - rss() > 150 * MB, (freed, rss())
    del pin


def test_memory_release_is_a_no_op_without_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(media_pool, "_malloc_trim", None)
    assert media_pool.release_memory() is False
    with media_pool.decode_slot(1):
        pass
    with pytest.raises(ValueError, match="at least 1"):
        with media_pool.decode_slot(0):
            pass
