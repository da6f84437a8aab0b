"""A few activation rows times a weight matrix on a CPU, through a small C kernel (``cpu_gemv.c``).

Decode at small batches multiplies a few rows by every weight matrix: a product bound by reading the
weights. oneDNN's matrix product over its reordered bfloat16 weights, and torch's float32 ``F.linear``, run
it at a fraction of the memory's speed; the kernel streams each plain weight row once (docs/performance.md):
one row in either dtype, up to ``max_rows_f32`` float32 rows and up to ``max_rows_bf16`` bfloat16 rows
(with the CPU's bfloat16 dot product where it has avx512_bf16); and, for --batch-invariant, any number of
rows with each row's bits those it gets alone (``fixed``). It is compiled at first use
(``cpu_kernels``); no compiler or a failed build: one warning, and every product runs on oneDNN.
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
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the calls run without the GIL
        fn = lib.gemv
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 4 + [i64] * 2 + [ctypes.c_int] * 2
        fn.restype = ctypes.c_int
        self._fn = fn
        rows = lib.gemm_rows_bf16
        rows.argtypes = [ptr] * 4 + [i64] * 2 + [ctypes.c_int] * 2
        rows.restype = ctypes.c_int
        self._rows = rows
        rows_f32 = lib.gemm_rows_f32
        rows_f32.argtypes = [ptr] * 4 + [i64] * 2 + [ctypes.c_int] * 2
        rows_f32.restype = ctypes.c_int
        self._rows_f32 = rows_f32
        fixed = lib.gemm_fixed
        fixed.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int] * 2
        fixed.restype = ctypes.c_int
        self._fixed = fixed
        self.max_rows_bf16 = int(lib.max_rows_bf16())
        self.max_rows_f32 = int(lib.max_rows_f32())
        self.bf16_dot = bool(lib.bf16_dot())

    def takes_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether the kernel multiplies this many activation rows of `dtype` (the weight's)."""
        most = self.max_rows_bf16 if dtype == torch.bfloat16 else self.max_rows_f32
        return rows == 1 or 2 <= rows <= most

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for an `x` of rows the kernel takes (``takes_rows``; any leading shape),
        `weight` contiguous ``[out, in]`` and everything in one dtype of DTYPES on the CPU (the caller checks
        the layer once, the rows every call)."""
        rows = x.numel() // weight.shape[1]
        if not self.takes_rows(rows, x.dtype):
            raise ValueError(f"gemv: {rows} rows of {x.dtype} are not ones this kernel takes here")
        return self.multiply(x, rows, weight, bias)

    def multiply(self, x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``__call__`` for a caller that has checked ``takes_rows(rows, x.dtype)`` itself (a layer, every
        call: the check is not made twice)."""
        out_features, in_features = weight.shape
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        args = (y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                in_features, out_features)
        if rows == 1 and self._fn(*args, DTYPES[x.dtype], torch.get_num_threads()) != 0:
            raise MemoryError("gemv: no memory for the widened activation row")
        several = self._rows if x.dtype == torch.bfloat16 else self._rows_f32
        if rows > 1 and (err := several(*args, rows, torch.get_num_threads())) != 0:
            if err == -2:
                raise MemoryError("gemv: no memory for the widened activation rows")
            raise ValueError(f"gemv: {rows} rows are not ones this kernel takes here")
        return y

    def fixed(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for any number of rows (any leading shape), each row summed in one order
        whatever the rest of `x` is (the batch-invariant mode): the bits of a row alone. Everything in one
        dtype of DTYPES on the CPU, `weight` contiguous ``[out, in]``."""
        out_features, in_features = weight.shape
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        rows = x.numel() // in_features
        if rows and self._fixed(y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                0 if bias is None else bias.data_ptr(), in_features, out_features, rows,
                                DTYPES[x.dtype], torch.get_num_threads()) != 0:
            raise MemoryError("gemm: no memory for the widened activation rows")
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
    return cpu_kernels.load_or_warn(load, "few-row product", "small decode batches multiply as larger ones do", log)
