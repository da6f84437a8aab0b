"""GPTQ's packed weights times a few activation rows on a CPU, through a small C kernel (``cpu_gptq.c``).

The layer (``quant/gptq.py``) holds its weight packed; without this kernel each product unpacks and
dequantizes the whole layer first. The kernel reads only the packed words, applying each group's scale
and zero once per group, for up to ``MAX_ROWS`` rows (decode); more rows keep the layer's own path. A
desc_act layer's packed columns are sorted by group once (``quant.packing.sort_groups``), and each product
takes the input columns in that order. Compiled at first use
like ``cpu_gemv.c`` (``cpu_kernels``); no compiler: one warning, and the layer's own path everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn

from gaudi_runtime.device import cpu_kernels
from gaudi_runtime.layers.kernels import LayerKernels, LinearKernel, install_kernels
from gaudi_runtime.quant.packing import sort_groups

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gptq.c")
MAX_ROWS = 8


class GptqKernel:
    def __init__(self, path: Path):
        self.path = path
        fn = ctypes.CDLL(str(path)).gptq_gemm  # CDLL: the call runs without the GIL
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def segment(self, y: torch.Tensor, x: torch.Tensor, layer: nn.Module, start: int, size: int,
                plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        """``y[:, start:start + size] = x @ W[start:start + size]^T`` (float32, contiguous)."""
        q, z, s = layer.qweight, layer.qzeros, layer.scales
        bounds, gid = plan
        err = self._fn(y.data_ptr() + 4 * start, y.shape[1], x.data_ptr(), q.data_ptr() + 4 * start * q.shape[1],
                       z.data_ptr() + 2 * start * z.shape[1], s.data_ptr() + 4 * start * s.shape[1],
                       bounds.data_ptr(), gid.data_ptr(), gid.numel(), x.shape[0], x.shape[1], size, z.shape[1],
                       layer.bits, torch.get_num_threads())
        if err:
            raise MemoryError("gptq: no memory for the activation sums")


def runs(g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Groups as runs of consecutive columns: (bounds, group of each run); None where g_idx goes back."""
    g = g_idx.long()
    if g.numel() and bool((g[1:] < g[:-1]).any()):
        return None
    change = torch.nonzero(g[1:] != g[:-1]).flatten() + 1
    bounds = torch.cat([torch.tensor([0]), change, torch.tensor([g.numel()])]).to(torch.int32)
    return bounds, g[bounds[:-1].long()].to(torch.int32)


def _product(k: GptqKernel, layer: nn.Module, plans: list, x: torch.Tensor, bias: torch.Tensor | None):
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS:
        return None  # the layer's own path: dequantize once, one matrix product
    x2 = x.reshape(rows, x.shape[-1]).float().contiguous()
    y = torch.empty(rows, layer.qweight.shape[0], dtype=torch.float32)
    perms = layer.perms or [None] * len(plans)
    for (start, size), plan, perm in zip(layer.segments, plans, perms):
        k.segment(y, x2 if perm is None else x2[:, perm].contiguous(), layer, start, size, plan)
    y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[1])
    return y if bias is None else y + bias


def gptq_kernels(model: nn.Module) -> dict[nn.Module, LinearKernel]:
    """The kernel of every GPTQ layer (``quant/gptq.py``) whose groups are runs of columns
    (``LayerKernels.linear``); a desc_act layer's packed columns are sorted by group on the way."""
    layers = [m for m in model.modules() if hasattr(m, "g_idx") and hasattr(m, "segments")]
    k = kernel() if layers else None
    if k is None:
        return {}
    kernels: dict[nn.Module, LinearKernel] = {}
    for m in layers:
        if m.qweight.device.type == "cpu":
            sort_groups(m)
        plans = [runs(m.g_idx[i]) for i in range(len(m.segments))]
        if all(p is not None for p in plans) and m.qweight.device.type == "cpu":
            kernels[m] = functools.partial(_product, k, m, plans)
    log.info("cpu: %d of %d GPTQ layers multiply packed weights in the C kernel (up to %d rows)", len(kernels),
             len(layers), MAX_ROWS)
    return kernels


def use_gptq_kernel(model: nn.Module) -> int:
    """`gptq_kernels` installed on `model`; returns how many layers got one."""
    kernels = gptq_kernels(model)
    install_kernels(model, LayerKernels(linear=kernels.get))
    return len(kernels)


def load(environ=None) -> GptqKernel:
    return cpu_kernels.load(SOURCE, "gptq", GptqKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> GptqKernel | None:
    return cpu_kernels.load_or_warn(load, "GPTQ", "GPTQ layers dequantize before each product", log)
