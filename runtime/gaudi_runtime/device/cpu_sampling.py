"""The greedy choice of a batch on a CPU through a small C kernel (``cpu_sampling.c``).

A greedy row needs its maximum and that token's log-probability. torch computes a log_softmax over the
whole vocabulary for it, then an argmax; the kernel reads each row twice (its maximum, then the sum of
exp(x - max)) and writes one id and one sum per row. The ids are torch.argmax's; the log-probabilities
are at least as close to the exact value as float32 log_softmax's (the sum is taken in four partial
sums per lane; docs/performance.md). Built at first use (``cpu_kernels``); without a compiler, one
warning, and torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from gaudi_runtime.device import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_sampling.c")
MIN_VOCAB = 16  # one vector: the kernel's first read


class GreedyKernel:
    def __init__(self, path: Path):
        self.path = path
        fn = ctypes.CDLL(str(path)).greedy_rows  # CDLL: the call runs without the GIL
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, log-probabilities) of each row's first maximum, or None where the kernel does not answer:
        not float32 rows of a CPU tensor, a short vocabulary, a NaN or a row without a finite maximum."""
        if (scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2
                or scores.shape[1] < MIN_VOCAB or scores.stride(1) != 1):
            return None
        rows, vocab = scores.shape
        ids = torch.empty(rows, dtype=torch.int64)
        sums = torch.empty(rows, dtype=torch.float32)
        if self._fn(scores.data_ptr(), rows, vocab, scores.stride(0), ids.data_ptr(), sums.data_ptr(),
                    torch.get_num_threads()) != 0:
            return None
        return ids, sums.log_().neg_()


def load(environ=None) -> GreedyKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    return cpu_kernels.load(SOURCE, "sampling", GreedyKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> GreedyKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    return cpu_kernels.load_or_warn(load, "greedy choice", "greedy rows take torch's log_softmax and argmax",
                                    log)
