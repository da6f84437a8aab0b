"""glibc malloc settings for a process whose tensors live in host memory (the CPU backend).

With glibc's defaults every block above the mmap threshold (128 KiB at first) is a fresh
``mmap`` and every free above the trim threshold gives memory back to the kernel. A decode
step allocates and frees megabytes per layer (the gathered KV blocks, the MLP activations),
so each step then pays page faults and the kernel's zeroing of every page it touches
(docs/performance.md has what that cost on the reference model).
Raising both thresholds keeps those blocks in the heap, reused from one step to the next.
The price is that the process keeps its peak heap instead of shrinking after a burst.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
# Large enough for a long batch's gathered KV; older glibc refuses more than 32 MiB (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = 1 << 30

# Set by the user: their allocator settings win (glibc reads these env vars at start-up).
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def tune_host_allocator(environ: Mapping[str, str] = os.environ, libc=None) -> bool:
    """Raise glibc's mmap and trim thresholds unless the user set allocator options or preloaded
    another allocator. Returns whether the settings were applied."""
    if any(name in environ for name in USER_SETTINGS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        log.info("host allocator: left as the environment configures it")
        return False
    if environ.get("LD_PRELOAD"):  # tcmalloc / jemalloc, as vLLM's CPU guide suggests: not glibc's malloc
        log.info("host allocator: LD_PRELOAD is set, glibc's malloc left alone")
        return False
    try:
        libc = libc if libc is not None else ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    # mallopt returns 1 on success; setting either threshold also ends glibc's dynamic adjustment of both.
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return False
    for threshold in MMAP_THRESHOLDS:
        if mallopt(M_MMAP_THRESHOLD, threshold) == 1:
            log.info("host allocator: glibc mmap threshold %d MiB, trim threshold %d MiB",
                     threshold >> 20, TRIM_THRESHOLD >> 20)
            return True
    return False
