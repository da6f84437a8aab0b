"""Linear layers on a CPU: weights reordered once for oneDNN, few-row products through a C kernel.

``F.linear`` in bf16 hands the plain ``[out, in]`` weight to oneDNN, which
reorders it into its blocked layout on every call: at decode batch sizes that
reorder is a third of the matmul's time (docs/performance.md). Reordering once
after loading, as vLLM's CPU build does, leaves oneDNN only the product; the
results are the same bits as ``F.linear``'s. In float32 ``F.linear`` goes to
MKL's sgemm instead, which oneDNN over reordered weights outruns at every row
count measured (same sums in another order: float32 rounding apart).

A product of a few rows (decode at small batches) is bound by reading the
weights, and oneDNN reads them far below the memory's speed; ``cpu_gemv``
streams the plain weight instead (up to eight rows in either dtype), which a layer then keeps beside
the reordered copy (CPU_GEMV=false gives that memory back).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
from torch import nn
from torch.nn import functional as F

from gaudi_runtime.device import cpu_gemv
from gaudi_runtime.layers.embedding import ParallelLMHead
from gaudi_runtime.layers.kernels import LayerKernels, LinearKernel, install_kernels
from gaudi_runtime.layers.linear import LinearBase

log = logging.getLogger(__name__)

# Where the few-row kernel runs on the bfloat16 dot product, oneDNN over the reordered weight (the same
# instruction) multiplies several rows faster once x outgrows what stays in L1 beside the weight rows the
# kernel streams: past this many values of x (rows x inputs), bfloat16 rows go to oneDNN
# (docs/performance.md, "bfloat16 few-row products against oneDNN"; `python -m gaudi_runtime.bench.few_rows`).
BF16_DOT_X_VALUES = 8192

# oneDNN picks the blocked layout for this many rows; any row count still runs on it, and neither
# decode batches nor long prompts run slower on it than on a layout picked for their own row count.
ROWS_HINT = 16


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN here multiplies `dtype` (one of PACKED_DTYPES) over reordered weights."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (avx512_bf16 or AMX), not by widening to float32."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def _packed_linear(packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _plain_linear(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _plain(m: nn.Module, dtype: torch.dtype) -> bool:
    # An FP8 layer holds ``qweight`` and derives ``weight``; it keeps its own kernel. A released weight
    # (0 rows) was reordered already.
    w = m._parameters.get("weight")
    return w is not None and w.dtype == dtype and w.device.type == "cpu" and w.dim() == 2 and w.numel() > 0


def kernel_first(gemv: cpu_gemv.GemvKernel, rows: int, dtype: torch.dtype, inputs: int) -> bool:
    """Whether `rows` rows of `dtype` times a weight of `inputs` columns go to the few-row kernel rather
    than to oneDNN over the reordered weight."""
    if not gemv.takes_rows(rows, dtype):
        return False
    return rows == 1 or not (gemv.bf16_dot and dtype == torch.bfloat16) or rows * inputs <= BF16_DOT_X_VALUES


def _few_rows_or(many, gemv: cpu_gemv.GemvKernel, weight: torch.Tensor):
    """A layer kernel: the rows `gemv` takes through it over the plain `weight`, more rows (or an
    activation of another dtype, which `many` then refuses as F.linear would) through `many`."""
    def kernel(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.dtype == weight.dtype and kernel_first(gemv, rows, x.dtype, weight.shape[1]):
            return gemv.multiply(x, rows, weight, bias)
        return many(x, bias)
    return kernel


def _linears(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead)) and _plain(m, dtype)]


def linear_kernels(model: nn.Module, release: bool = True, few_rows: bool = True) -> dict[nn.Module, LinearKernel]:
    """Every bf16 and float32 linear layer's and LM head's kernel (``LayerKernels.linear``), each over a
    weight reordered once for oneDNN, which the layer holds as its ``packed_weight``.

    With `few_rows` (and the C kernel built here), a product of the few rows ``cpu_gemv`` takes runs
    through it over the plain weight, which the layer then keeps. Otherwise, with ``release``, a layer's
    own weight is dropped (a 0-row tensor, so that a stray ``F.linear`` on it fails loudly) unless another
    module shares it: a tied LM head keeps the embedding's table.
    """
    gemv = cpu_gemv.kernel() if few_rows else None
    layers = [m for dtype in PACKED_DTYPES if supported(dtype) for m in _linears(model, dtype)]
    owners = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    kernels: dict[nn.Module, LinearKernel] = {}
    few_row_layers = 0
    for m in layers:
        w = m.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        m.register_buffer("packed_weight", packed, persistent=False)  # counted where the model's memory is
        kernels[m] = functools.partial(_packed_linear, packed)
        if gemv is not None and cpu_gemv.takes(w, m._parameters.get("bias")):
            kernels[m] = _few_rows_or(kernels[m], gemv, w)
            few_row_layers += 1
        elif release and owners[w.data_ptr()] == 1:
            m.weight = nn.Parameter(w.new_empty(0, w.shape[1]), requires_grad=False)
    others = [m for dtype in PACKED_DTYPES if not supported(dtype) for m in _linears(model, dtype)
              if gemv is not None and cpu_gemv.takes(m.weight, m._parameters.get("bias"))]
    for m in others:
        w = m.weight.detach()
        kernels[m] = _few_rows_or(functools.partial(_plain_linear, w), gemv, w)
    if layers:
        log.info("cpu: %d linear layers use weights reordered for oneDNN", len(layers))
    if gemv is not None:
        log.info("cpu: few-row products of %d linear layers run through the C kernel (bf16 rows: up to %d)",
                 few_row_layers + len(others), gemv.max_rows_bf16)
    return kernels


def prepack_linears(model: nn.Module, release: bool = True, few_rows: bool = True) -> int:
    """`linear_kernels` installed on `model`; returns how many layers got a reordered weight."""
    kernels = linear_kernels(model, release, few_rows)
    install_kernels(model, LayerKernels(linear=kernels.get))
    return sum(1 for m in kernels if "packed_weight" in m._buffers)


def _fixed_linear(gemv: cpu_gemv.GemvKernel, weight: torch.Tensor, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return gemv.fixed(x, weight, bias)


def fixed_order_kernels(model: nn.Module, gemv: cpu_gemv.GemvKernel) -> dict[nn.Module, LinearKernel]:
    """The batch-invariant mode's linear kernels: every bf16 and float32 linear layer and LM head multiplies
    through `gemv`'s fixed-order kernel, whatever the row count (oneDNN's blocking and the few-row kernel's
    accumulators depend on it). Raises RuntimeError for a layer whose weight the kernel does not take: the
    mode could not then hold its promise."""
    layers = [m for dtype in PACKED_DTYPES for m in _linears(model, dtype)]
    kernels: dict[nn.Module, LinearKernel] = {}
    for m in layers:
        w = m.weight.detach()
        if not cpu_gemv.takes(w, m._parameters.get("bias")):
            raise RuntimeError(f"--batch-invariant: a {type(m).__name__}'s weight is not one the fixed-order kernel "
                               "takes (contiguous [out, in] with a bias of its dtype)")
        kernels[m] = functools.partial(_fixed_linear, gemv, w)
    log.info("cpu: batch-invariant: %d linear layers multiply each row in one fixed order", len(layers))
    return kernels


def fixed_order_linears(model: nn.Module, gemv: cpu_gemv.GemvKernel) -> int:
    """`fixed_order_kernels` installed on `model`; returns how many layers got one."""
    kernels = fixed_order_kernels(model, gemv)
    install_kernels(model, LayerKernels(linear=kernels.get))
    return len(kernels)
