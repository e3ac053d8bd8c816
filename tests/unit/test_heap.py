"""actors/heap.py: a model worker's glibc thresholds fixed so freed blocks are reused."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from actors import heap


def test_both_thresholds_are_set_to_keep_freed_memory():
    calls = []
    assert heap.keep_freed_memory(lambda param, value: calls.append((param, value)) or 1, {})
    assert calls == [
        (heap.M_MMAP_THRESHOLD, 32 * 2**20),  # glibc's largest allowed
        (heap.M_TRIM_THRESHOLD, 2**31 - 1),
    ]


def test_a_library_that_refuses_leaves_the_process_as_it_was():
    assert not heap.keep_freed_memory(lambda param, value: 0, {})


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_an_operators_own_malloc_settings_win(environ):
    calls = []
    assert not heap.keep_freed_memory(lambda param, value: calls.append(param) or 1, environ)
    assert calls == []
    assert not heap.operator_set({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not ctypes.util.find_library("c"), reason="glibc only"
)
def test_glibc_takes_the_settings():
    assert heap.keep_freed_memory(environ={})
