"""A decoder layer's small operations on a CPU through one C call each (``cpu_layer_ops.c``).

RMSNorm with its residual add, rotary embedding of q and k, and the paged cache's writes are five to
fifteen torch operators each on a few thousand values; at decode batch sizes their fixed costs are a
large part of a step (docs/performance.md). ``CpuBackend.layer_kernels`` gives the model's RMSNorm,
RotaryEmbedding and Attention modules these calls (``CPU_LAYER_OPS``); each returns None (or False) for
tensors it does not take, and the module then runs its torch code. Results are torch's bits, except
RMSNorm's where its sum of squares, taken in another order, rounds differently. Built at first use
(``cpu_kernels``); without a compiler, one warning, and torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from gaudi_runtime.device import cpu_kernels
from gaudi_runtime.layers.kernels import LayerKernels, install_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_layer_ops.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _rows(t: torch.Tensor, inner: int) -> torch.Tensor | None:
    """`t` as ``[rows, inner]`` without a copy (rows evenly spaced, each contiguous), else None."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, inner)
    except RuntimeError:
        return None


def _cpu(*tensors: torch.Tensor) -> bool:
    """Whether the tensors are CPU tensors of one dtype the kernel takes (a loop: this runs several times a
    decode step)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES:
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype:
            return False
    return True


class LayerOpsKernel:
    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the calls run without the GIL
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._norm = lib.rms_norm
        self._norm.argtypes = [ptr] * 5 + [i64] * 4 + [ctypes.c_float, c_int, c_int]
        self._norm.restype = None
        self._rotary = lib.rotary
        self._rotary.argtypes = [ptr] * 7 + [i64] * 7 + [c_int, c_int]
        self._write = lib.write_kv
        self._write.argtypes = [ptr] * 5 + [i64] * 5
        for fn in (self._rotary, self._write):
            fn.restype = c_int

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """``norm(x)``, or with `residual` ``(norm(x + residual), x + residual)``, as ``layers/norm.RMSNorm``
        computes them; None for tensors the kernel does not take."""
        hidden = x.shape[-1]
        rows = _rows(x, hidden)
        res = residual if residual is None else _rows(residual, hidden)
        if (rows is None or (residual is not None and (res is None or residual.shape != x.shape))
                or not _cpu(x, weight, *(() if residual is None else (residual,)))
                or weight.shape != (hidden,) or not weight.is_contiguous()):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        total = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
        self._norm(out.data_ptr(), None if total is None else total.data_ptr(), rows.data_ptr(),
                   None if res is None else res.data_ptr(), weight.data_ptr(), rows.shape[0], hidden, rows.stride(0),
                   0 if res is None else res.stride(0), eps, DTYPES[x.dtype], torch.get_num_threads())
        return out if total is None else (out, total)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor):
        """(q, k) rotated as ``layers/rotary.RotaryEmbedding`` rotates them (q ``[..., Hq, D]``, k ``[..., Hk,
        D]``, positions ``[...]``, tables ``[P, D / 2]``), new contiguous tensors; None for tensors the kernel
        does not take. A position outside the tables raises IndexError, as torch's indexing does."""
        d = q.shape[-1]
        if (q.shape[:-2] != positions.shape or k.shape[:-2] != positions.shape or k.shape[-1] != d
                or not _cpu(q, k, cos, sin) or not (cos.is_contiguous() and sin.is_contiguous())
                or d % 2 or cos.shape != (cos.shape[0], d // 2) or sin.shape != cos.shape
                or positions.dtype != torch.int64 or positions.device.type != "cpu"):
            return None
        hq, hk = q.shape[-2], k.shape[-2]
        q_rows, k_rows = _rows(q, hq * d), _rows(k, hk * d)
        if q_rows is None or k_rows is None:
            return None
        pos = positions.contiguous()
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        status = self._rotary(q_out.data_ptr(), k_out.data_ptr(), q_rows.data_ptr(), k_rows.data_ptr(),
                              cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), q_rows.shape[0], hq, hk, d,
                              q_rows.stride(0), k_rows.stride(0), cos.shape[0], DTYPES[q.dtype],
                              torch.get_num_threads())
        if status != 0:
            raise IndexError(f"rotary embedding: a position is outside [0, {cos.shape[0]})")
        return q_out, k_out

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """``layers/attention.write_kv`` for caches of k's own dtype (float32 or bfloat16); False (nothing
        written) for tensors the kernel does not take. A slot outside the caches raises IndexError, as
        index_copy_ does."""
        h, d = k_cache.shape[-2:]
        k_rows, v_rows = _rows(k, h * d), _rows(v, h * d)
        if (k_rows is None or v_rows is None or k_rows.shape != v_rows.shape or not _cpu(k_cache, v_cache, k, v)
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape
                or k.shape[-2:] != (h, d) or v.shape[-2:] != (h, d)
                or slots.dtype != torch.int64 or slots.numel() != k_rows.shape[0]):
            return False
        flat = slots.reshape(-1).contiguous()
        size = k.element_size()
        if self._write(k_cache.data_ptr(), v_cache.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(),
                       flat.data_ptr(), flat.numel(), h * d * size, k_rows.stride(0) * size,
                       v_rows.stride(0) * size, k_cache.numel() // (h * d)) != 0:
            raise IndexError("KV cache write: a slot is outside the cache")
        return True


def load(environ=None) -> LayerOpsKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    return cpu_kernels.load(SOURCE, "layer_ops", LayerOpsKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> LayerOpsKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    return cpu_kernels.load_or_warn(load, "layer operations", "norms, rotary and cache writes run in torch", log)


def layer_ops_kernels(ops: LayerOpsKernel) -> LayerKernels:
    """`ops`' calls as the model's RMSNorm, RotaryEmbedding and Attention modules' kernels (subclasses with
    formulas of their own, Gemma's norm, keep theirs: ``layers/kernels.install_kernels``)."""
    return LayerKernels(norm=ops.rms_norm, rotary=ops.rotary, cache_write=ops.write_kv)


def set_layer_ops(model: torch.nn.Module, ops: LayerOpsKernel | None) -> int:
    """Give the model's RMSNorm, RotaryEmbedding and Attention modules `ops`' calls (None: take them away,
    back to torch's code); returns how many modules it set."""
    kinds = ("norm", "rotary", "cache_write")
    if ops is None:
        install_kernels(model, LayerKernels(), clear=kinds)
        return 0
    return sum(install_kernels(model, layer_ops_kernels(ops), clear=kinds).values())

