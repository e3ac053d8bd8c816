"""The object store's pages let go of: mapping gone, data kept (cluster/store_pages.py)."""

import mmap
import os
import sys

import numpy as np
import pytest

from actors.store_pages import RELEASE_EVERY_BYTES, StorePages, store_ranges

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fe:00 1 /usr/bin/python3.12
7f8d42800000-7f8d68000000 rw-s 00000000 00:1b 3013 /dev/shm/plasmaEJUw3E (deleted)
7f8d68000000-7f8d69000000 rw-p 00000000 00:1b 3014 /tmp/plasmaPrivate
7f8dc1741000-7f8dc1748000 r--s 00000000 fe:00 338846 /usr/lib/gconv/gconv-modules.cache
7f8dc1800000-7f8dc1900000 rw-p 00000000 00:00 0
"""


def test_only_shared_plasma_mappings_are_taken():
    # A private mapping's pages would be zeroed by DONTNEED: it must never be advised.
    assert list(store_ranges(MAPS)) == [(0x7F8D42800000, 0x7F8D68000000)]


def _rss_shmem_kb() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssShmem:"))
    return int(line.split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux")
def test_release_drops_written_pages_from_rss_and_keeps_their_data():
    size = 32 << 20
    path = f"/dev/shm/plasma-epd-test-{os.getpid()}"  # a stand-in for the store's file
    with open(path, "w+b") as f:
        f.truncate(size)
        shared = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
    os.unlink(path)  # as the store's file is: mapped, deleted
    try:
        before_kb = _rss_shmem_kb()
        view = np.frombuffer(shared, np.uint8)
        view[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # every page written
        assert _rss_shmem_kb() - before_kb >= size // 1024 * 9 // 10
        assert StorePages().release() >= size
        assert _rss_shmem_kb() - before_kb < 1024  # no longer this process's RSS
        assert np.array_equal(view[:4096], np.arange(4096).astype(np.uint8))  # data kept
        assert int(view[-1]) == (size - 1) % 256
        del view
    finally:
        shared.close()


def test_a_put_releases_once_enough_has_been_put_since_the_last():
    released = []

    class Counting(StorePages):
        def release(self) -> int:
            released.append(True)
            return 0

    put = Counting().putter(lambda value: ("ref", value.nbytes))
    half = RELEASE_EVERY_BYTES // 2
    assert put(np.zeros(half, np.uint8)) == ("ref", half)
    assert released == []  # small puts: their cost spread over a few
    put(np.zeros(half, np.uint8))
    assert released == [True]
    put(np.zeros(16, np.uint8))
    assert released == [True]  # counted afresh after a release
    put(np.zeros(RELEASE_EVERY_BYTES, np.uint8))
    assert released == [True, True]  # a big image's pages go at once


def test_a_process_without_proc_maps_releases_nothing_and_does_not_fail(tmp_path):
    assert StorePages(maps_path=str(tmp_path / "no-such-maps")).release() == 0
