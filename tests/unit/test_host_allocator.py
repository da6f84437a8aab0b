"""The CPU backend keeps glibc from handing each decode step's megabytes back to the kernel, unless the
user configured the allocator (env or a preloaded tcmalloc/jemalloc)."""

from __future__ import annotations

import ctypes

import pytest

from gaudi_runtime.device.host_allocator import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLDS,
    TRIM_THRESHOLD,
    tune_host_allocator,
)


class RecordingLibc:
    """mallopt as glibc: 1 if accepted; an mmap threshold above ``max_mmap`` is refused (older glibc: 32 MiB)."""

    def __init__(self, result: int = 1, max_mmap: int = 1 << 62):
        self.calls: list[tuple[int, int]] = []
        self.result, self.max_mmap = result, max_mmap

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return int(self.result == 1 and not (param == M_MMAP_THRESHOLD and value > self.max_mmap))


def test_raises_both_thresholds_by_default():
    libc = RecordingLibc()
    assert tune_host_allocator({}, libc)
    assert libc.calls == [(M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_THRESHOLD, MMAP_THRESHOLDS[0])]


def test_older_glibc_gets_its_largest_mmap_threshold():
    libc = RecordingLibc(max_mmap=32 << 20)
    assert tune_host_allocator({}, libc)
    assert libc.calls[-1] == (M_MMAP_THRESHOLD, 32 << 20)


@pytest.mark.parametrize("environ", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
                                     {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}])
def test_user_allocator_settings_win(environ):
    libc = RecordingLibc()
    assert not tune_host_allocator(environ, libc)
    assert libc.calls == []


def test_refused_setting_is_reported():
    assert not tune_host_allocator({}, RecordingLibc(result=0))


def test_real_glibc_accepts_the_settings():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        pytest.skip("not a glibc system")
    assert tune_host_allocator({}, libc)
