"""bf16 linear layers on a CPU over weights reordered once for oneDNN.

``F.linear`` in bf16 hands the plain ``[out, in]`` weight to oneDNN, which
reorders it into its blocked layout on every call: at decode batch sizes that
reorder is a third of the matmul's time (docs/performance.md). Reordering once
after loading, as vLLM's CPU build does, leaves oneDNN only the product; the
results are the same bits as ``F.linear``'s.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
from torch import nn

from gaudi_runtime.layers.embedding import ParallelLMHead
from gaudi_runtime.layers.linear import LinearBase

log = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this many rows; any row count still runs on it, and neither
# decode batches nor long prompts run slower on it than on a layout picked for their own row count.
ROWS_HINT = 16


def supported() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
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


def _plain_bf16(m: nn.Module) -> bool:
    # An FP8 layer holds ``qweight`` and derives ``weight``; it keeps its own kernel.
    w = m._parameters.get("weight")
    return w is not None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2


def prepack_linears(model: nn.Module, release: bool = True) -> int:
    """Give every bf16 linear layer and LM head a reordered weight; returns how many got one.

    With ``release``, a layer's own weight is dropped (a 0-row tensor, so that a stray ``F.linear``
    on it fails loudly) unless another module shares it: a tied LM head keeps the embedding's table.
    """
    if not supported():
        return 0
    layers = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead)) and _plain_bf16(m)]
    owners = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    for m in layers:
        w = m.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        m.register_buffer("packed_weight", packed, persistent=False)  # counted where the model's memory is
        m.kernel = functools.partial(_packed_linear, packed)
        if release and owners[w.data_ptr()] == 1:
            m.weight = nn.Parameter(w.new_empty(0, w.shape[1]), requires_grad=False)
    if layers:
        log.info("cpu: %d bf16 linear layers use weights reordered for oneDNN", len(layers))
    return len(layers)
