"""Decode attention on a CPU that reads the paged KV cache in place, through a small C kernel.

The torch path gathers every sequence's KV blocks into a contiguous copy each step and each layer
(``index_select``) and masks past each context length; at long contexts that copy and the masked
work are most of a decode step. ``cpu_paged_attention.c`` walks the block table instead, as vLLM's
CPU build does with its own kernel. It is compiled at first use (``cpu_kernels``); no compiler, a
failed compile or a cache that cannot be written: one warning, and decode keeps the gather path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from gaudi_runtime.device import cpu_kernels
from gaudi_runtime.device.cpu_kernels import KernelUnavailable

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The kernel's rows are whole vectors (16 lanes with AVX-512, 8 elsewhere); other head sizes gather.
HEAD_SIZE_MULTIPLE = 16
MAX_HEAD_SIZE = 256  # the C file's bound on a tile's arrays

__all__ = ["KernelUnavailable", "PagedDecodeKernel", "build", "kernel", "load"]


def build(environ=None) -> Path:
    """The compiled kernel, from the cache or compiled into it (``cpu_kernels.build``)."""
    return cpu_kernels.build(SOURCE, "paged_attention", environ)


class PagedDecodeKernel:
    """The loaded library, called on tensors' data pointers."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the call runs without the GIL
        fn = lib.paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 6 + [i64] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_float]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, starts: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor | None:
        """q ``[B, 1, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]`` -> ``[B, Hq, D]`` in q's dtype;
        `starts` ``[B]``: each row's first position (a sliding window; None: 0); `softcap`: scores capped
        by ``softcap * tanh(score / softcap)`` (None: not);
        None when the tensors are not ones the kernel takes (another device or dtype, a strided cache, a
        head size that is not a multiple of HEAD_SIZE_MULTIPLE or exceeds MAX_HEAD_SIZE)."""
        dtype = k_cache.dtype
        num_blocks, block_size, hkv, d = k_cache.shape
        if (dtype not in DTYPES or q.dtype != dtype or v_cache.dtype != dtype or k_cache.device.type != "cpu"
                or d % HEAD_SIZE_MULTIPLE or d > MAX_HEAD_SIZE or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return None
        b = q.shape[0]
        q = q.reshape(b, -1, d).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        first = None if starts is None else starts.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        status = self._fn(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                          lens.data_ptr(), b, hkv, q.shape[1] // hkv, d, block_size, tables.shape[1], num_blocks,
                          scale, DTYPES[dtype], torch.get_num_threads(), None if first is None else first.data_ptr(),
                          softcap or 0.0)
        if status == -2:
            raise MemoryError("paged decode attention: no memory for its scratch rows")
        if status == -3:
            raise ValueError(f"paged decode attention: head size {d} is not one the kernel takes")
        if status != 0:
            raise IndexError("paged decode attention: a block table names a block outside the KV cache, "
                             "or a context length exceeds its block table")
        return out


def load(environ=None) -> PagedDecodeKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    return cpu_kernels.load(SOURCE, "paged_attention", PagedDecodeKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> PagedDecodeKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    return cpu_kernels.load_or_warn(load, "paged decode attention", "decode gathers the KV blocks instead", log)
