"""The CPU's C kernels as torch operators (``torch.library.custom_op``), so that tracing and ``torch.compile``
see one opaque operator with a known output shape where a ctypes call would break the graph.

``torch.ops.gaudi_serve.few_row_linear(x, weight, bias)`` is ``F.linear`` through the few-row product kernel
(``cpu_gemv``) when it is loaded and takes these rows, else ``F.linear`` itself: the same values either way
(to the kernel's rounding), so a traced graph runs wherever it is replayed. Its fake implementation gives
the output's shape and dtype without running anything. The eager layers call the kernel directly (an
operator's dispatch costs microseconds a decode step does not need to pay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_gemv


@torch.library.custom_op("gaudi_serve::few_row_linear", mutates_args=(), device_types="cpu")
def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``: through the few-row kernel where it takes `x`'s rows, else ``F.linear``."""
    k = cpu_gemv.kernel()
    rows = x.numel() // weight.shape[1] if weight.shape[1] else 0
    if k is None or not cpu_gemv.takes(weight, bias) or x.dtype != weight.dtype or not k.takes_rows(rows, x.dtype):
        return F.linear(x, weight, bias)
    return k.multiply(x, rows, weight, bias)


@few_row_linear.register_fake
def _few_row_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
