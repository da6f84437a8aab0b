"""One activation row times a weight matrix on a CPU, through a small C kernel (``cpu_gemv.c``).

Batch-1 decode multiplies a single row by every weight matrix: a product bound by reading the weights.
oneDNN's matrix product over its reordered bfloat16 weights, and torch's float32 ``F.linear``, run it at a
fraction of the memory's speed; the kernel streams each plain weight row once (docs/performance.md). It is
compiled at first use (``cpu_kernels``); no compiler or a failed build: one warning, and one row is
multiplied as more rows are (oneDNN).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from gaudi_runtime.device import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def build(environ=None) -> Path:
    """The compiled kernel, from the cache or compiled into it (``cpu_kernels.build``)."""
    return cpu_kernels.build(SOURCE, "gemv", environ)


class GemvKernel:
    """The loaded library, called on tensors' data pointers."""

    def __init__(self, path: Path):
        self.path = path
        fn = ctypes.CDLL(str(path)).gemv  # CDLL, not PyDLL: the call runs without the GIL
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 4 + [i64] * 2 + [ctypes.c_int] * 2
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for an `x` of one row (any leading shape of 1s), `weight` contiguous
        ``[out, in]`` and everything in one dtype of DTYPES on the CPU (the caller checks, once per layer)."""
        out_features, in_features = weight.shape
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        status = self._fn(y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                          in_features, out_features, DTYPES[x.dtype], torch.get_num_threads())
        if status != 0:
            raise MemoryError("gemv: no memory for the widened activation row")
        return y


def takes(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel can multiply by this layer's weight (and bias) as they are."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2 and weight.numel() > 0
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous() and bias.device.type == "cpu")))


def load(environ=None) -> GemvKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    return cpu_kernels.load(SOURCE, "gemv", GemvKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> GemvKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    return cpu_kernels.load_or_warn(load, "one-row product", "batch-1 decode multiplies as larger batches do", log)
