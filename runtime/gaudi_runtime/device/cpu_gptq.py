"""GPTQ's packed weights times activation rows on a CPU, through a small C kernel (``cpu_gptq.c``).

The layer (``quant/gptq.py``) holds its weight packed; without this kernel each product unpacks and
dequantizes the whole layer in torch first. Up to ``GEMM_ROWS`` rows (decode) the kernel reads only the
packed words: 4x fewer bytes than bfloat16 at 4 bits, unpacked with a mask and a conversion per vector of
values (bfloat16 activations at 4 bits: the CPU's bfloat16 dot product where it has one), each chunk's
scales and each group's zeros applied once. Between ``FOLD_ROWS`` bfloat16 rows at 4 bits on such a CPU,
each unpacked weight is rounded to bfloat16 once in registers and meets a block of rows there (the
weight the layer's own path multiplies, so the rows give its products). More rows (prefill) dequantize
each segment in one vector pass in C, then one matrix product (oneDNN). A desc_act layer's packed
columns are sorted by group once (``quant.packing.sort_groups``), and each product takes the input
columns in that order; a layer whose packed words mix groups (a row-parallel rank's share of desc_act
columns can) keeps its own path. Prebuilt or compiled at first use like ``cpu_gemv.c`` (``cpu_kernels``);
neither: one warning, and the layer's own path everywhere. Figures: docs/performance.md, "int4 kernel,
issue 45", "int4 at 16 rows", "int4 at one to four rows" and "int4 streamed from memory"."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gaudi_runtime.device import cpu_kernels
from gaudi_runtime.layers.kernels import LayerKernels, LinearKernel, install_kernels
from gaudi_runtime.quant.packing import sort_groups

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gptq.c")
GEMM_ROWS = 16  # more rows: dequantize in C, then oneDNN (at 16 the two cost about the same: docs/performance.md)
# bfloat16 rows a 4-bit product takes with each weight rounded to bfloat16 in registers (where the CPU has
# the bfloat16 dot product): fewer rows unpack faster on the packed path, more multiply faster dequantized
# (docs/performance.md, "int4 at 16 rows" and, for four rows, "int4 streamed from memory").
FOLD_ROWS = (4, 48)


class GptqKernel:
    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL: the calls run without the GIL
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn = lib.gptq_gemm
        fn.argtypes = [ptr, i64, ptr, c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_int, c_int]
        fn.restype = c_int
        self._fn = fn
        deq = lib.gptq_dequantize
        deq.argtypes = [ptr, c_int, ptr, ptr, ptr, ptr, i64, i64, i64, c_int, c_int]
        deq.restype = c_int
        self._dequantize = deq
        self.max_rows = int(lib.gptq_max_rows())
        folded = lib.gptq_folded_gemm
        folded.argtypes = [ptr, i64, c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_int]
        folded.restype = c_int
        self._folded = folded
        self.folds = bool(lib.gptq_folds())

    def segment(self, y: torch.Tensor, x: torch.Tensor, layer: nn.Module, start: int, size: int,
                g_idx: torch.Tensor) -> None:
        """``y[:, start:start + size] = x @ W[start:start + size]^T`` (y float32, x float32 or bfloat16, both
        contiguous; x's columns in the stored order, `g_idx` the segment's)."""
        q, z, s = layer.qweight, layer.qzeros, layer.scales
        err = self._fn(y.data_ptr() + 4 * start, y.shape[1], x.data_ptr(), int(x.dtype == torch.bfloat16), q.data_ptr() + 4 * start * q.shape[1],
                       z.data_ptr() + 2 * start * z.shape[1], s.data_ptr() + 4 * start * s.shape[1],
                       g_idx.data_ptr(), x.shape[0], x.shape[1], size, z.shape[1], layer.bits,
                       torch.get_num_threads())
        if err == -2:
            raise MemoryError("gptq: no memory for the regrouped activations")
        if err:
            raise ValueError(f"gptq: {x.shape[0]} rows of {size} outputs are not ones the kernel takes")

    def folded_segment(self, y: torch.Tensor, x: torch.Tensor, layer: nn.Module, start: int, size: int,
                       g_idx: torch.Tensor) -> None:
        """As `segment`, for bfloat16 x and 4-bit W (`takes_folded`): each weight rounded to bfloat16 once,
        in registers, then any number of rows; y float32 or bfloat16."""
        q, z, s = layer.qweight, layer.qzeros, layer.scales
        err = self._folded(y.data_ptr() + y.element_size() * start, y.shape[1], int(y.dtype == torch.bfloat16),
                           x.data_ptr(), q.data_ptr() + 4 * start * q.shape[1],
                           z.data_ptr() + 2 * start * z.shape[1], s.data_ptr() + 4 * start * s.shape[1],
                           g_idx.data_ptr(), x.shape[0], x.shape[1], size, z.shape[1], torch.get_num_threads())
        if err == -2:
            raise MemoryError("gptq: no memory for the reordered activations")
        if err:
            raise ValueError(f"gptq: {x.shape[1]} input columns are not whole chunks of 128")

    def takes_folded(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return self.folds and layer.bits == 4 and x.dtype == torch.bfloat16 and x.shape[-1] % 128 == 0

    def dequantize(self, layer: nn.Module, start: int, size: int, g_idx: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        """Rows start .. start + size - 1 of W in `dtype` (float32 or bfloat16), its columns in the stored
        order (`g_idx`: their groups)."""
        q, z, s = layer.qweight, layer.qzeros, layer.scales
        w = torch.empty(size, g_idx.numel(), dtype=dtype)
        err = self._dequantize(w.data_ptr(), int(dtype == torch.bfloat16), q.data_ptr() + 4 * start * q.shape[1],
                         z.data_ptr() + 2 * start * z.shape[1], s.data_ptr() + 4 * start * s.shape[1],
                         g_idx.data_ptr(), g_idx.numel(), size, z.shape[1], layer.bits, torch.get_num_threads())
        if err:
            raise MemoryError("gptq: no memory for the groups of the packed words")
        return w


def whole_words(g_idx: torch.Tensor, bits: int) -> bool:
    """Whether every packed word's values belong to one group (what the kernel takes)."""
    g = g_idx.view(-1, 32 // bits)
    return bool((g == g[:, :1]).all())


Segment = tuple[int, int, torch.Tensor, "torch.Tensor | None"]  # (first output, outputs, g_idx, input order)


def product_segments(layer: nn.Module) -> list[Segment]:
    """The calls a product of `layer` makes: one per fused projection (q, k, v; gate, up) where their
    groups or input orders differ (desc_act), else one over all outputs (one parallel region, not three)."""
    perms = layer.perms or [None] * len(layer.segments)
    first = layer.g_idx[0]
    if all(p is None for p in perms) and all(torch.equal(g, first) for g in layer.g_idx):
        return [(0, layer.qweight.shape[0], first, None)]
    return [(start, size, g_idx, perm) for (start, size), g_idx, perm in zip(layer.segments, layer.g_idx, perms)]


def _packed_product(k: GptqKernel, layer: nn.Module, segments: list[Segment], x2: torch.Tensor,
                    folded: bool) -> torch.Tensor:
    """y float32, or bfloat16 on the folded path (rounded in C, as `.to` would)."""
    y = torch.empty(x2.shape[0], layer.qweight.shape[0], dtype=torch.bfloat16 if folded else torch.float32)
    segment = k.folded_segment if folded else k.segment
    for start, size, g_idx, perm in segments:
        segment(y, x2 if perm is None else x2[:, perm].contiguous(), layer, start, size, g_idx)
    return y


def _dense_product(k: GptqKernel, layer: nn.Module, segments: list[Segment], x2: torch.Tensor) -> torch.Tensor:
    """More rows: each segment's weight dequantized in one pass, then the matrix product (compute-bound)."""
    parts = [F.linear(x2 if perm is None else x2[:, perm], k.dequantize(layer, start, size, g_idx, x2.dtype))
             for start, size, g_idx, perm in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _product(k: GptqKernel, layer: nn.Module, segments: list[Segment], x: torch.Tensor, bias: torch.Tensor | None):
    rows = x.numel() // x.shape[-1]
    folded = FOLD_ROWS[0] <= rows <= FOLD_ROWS[1] and k.takes_folded(layer, x)
    if rows <= GEMM_ROWS or folded:
        x2 = x.reshape(rows, x.shape[-1])
        x2 = (x2 if x2.dtype == torch.bfloat16 else x2.float()).contiguous()
        y = _packed_product(k, layer, segments, x2, folded).to(x.dtype)
    elif x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 16 == 0:
        y = _dense_product(k, layer, segments, x.reshape(rows, x.shape[-1]).contiguous())
    else:
        return None  # the layer's own path
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def gptq_kernels(model: nn.Module) -> dict[nn.Module, LinearKernel]:
    """The kernel of every GPTQ layer (``quant/gptq.py``) whose packed words each lie in one group (after
    sorting desc_act columns by group): ``LayerKernels.linear``'s entries."""
    layers = [m for m in model.modules() if hasattr(m, "g_idx") and hasattr(m, "segments")]
    k = kernel() if layers else None
    if k is None:
        return {}
    kernels: dict[nn.Module, LinearKernel] = {}
    for m in layers:
        if m.qweight.device.type != "cpu":
            continue
        sort_groups(m)
        if all(whole_words(m.g_idx[i], m.bits) and size % 4 == 0 for i, (_, size) in enumerate(m.segments)):
            kernels[m] = functools.partial(_product, k, m, product_segments(m))
    log.info("cpu: %d of %d GPTQ layers multiply packed weights in the C kernel (up to %d rows, and %d-%d "
             "bfloat16 rows folded%s; more: dequantized in one pass)", len(kernels), len(layers), GEMM_ROWS,
             *FOLD_ROWS, "" if k.folds else ": not on this CPU")
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
