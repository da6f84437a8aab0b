"""A mixture-of-experts layer's routed experts on a CPU in one C call (``cpu_moe.c``).

At decode sizes each routed expert gets a few rows, and running each expert as torch calls from Python
(``layers/moe.grouped_experts``) costs more than its products: about ten calls per expert, tens of
experts per layer. The kernel reads each routed expert's weights once and splits the work over the
threads by weight rows. It takes steps whose experts average up to MOST_ROWS_PER_EXPERT rows (decode, and
a prompt or two of prefill: ``takes``); larger steps keep ``grouped_experts``, whose matrix products do
many rows better. Built at first use
(``cpu_kernels``); without a compiler, one warning, and ``grouped_experts`` throughout.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from gaudi_runtime.device import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_moe.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Steps whose routed (token, expert) pairs average at most this many per expert run here; past it (long
# prefills) the experts' matrix products, whose blocking pays off on many rows, do better
# (docs/performance.md).
MOST_ROWS_PER_EXPERT = 32


class MoeKernel:
    """The loaded library, called on tensors' data pointers."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the calls run without the GIL
        fn = lib.moe_experts
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_int] * 2
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def takes(x: torch.Tensor, ids: torch.Tensor, w13, w2) -> bool:
        """Whether this step's experts run here: plain stacked weights of the activations' dtype (not a
        float8 stack that dequantizes when indexed), contiguous, and few rows per expert."""
        if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
            return False
        if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype or x.device.type != "cpu":
            return False
        return (w13.is_contiguous() and w2.is_contiguous()
                and ids.numel() <= MOST_ROWS_PER_EXPERT * w13.shape[0])

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
        """``layers/moe.ExpertsKernel`` for a step ``takes`` accepts."""
        tokens, hidden = x.shape
        experts, inter = w2.shape[0], w2.shape[2]
        if w13.shape != (experts, 2 * inter, hidden) or ids.shape != weights.shape:
            raise ValueError(f"moe: experts {tuple(w13.shape)} / {tuple(w2.shape)} do not fit activations "
                             f"{tuple(x.shape)} and routing {tuple(ids.shape)}")
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        if self._fn(out.data_ptr(), x.data_ptr(), ids.data_ptr(), weights.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                    tokens, ids.shape[1], experts, hidden, inter, DTYPES[x.dtype], torch.get_num_threads()) != 0:
            raise MemoryError("moe: no memory for the experts' work buffers")
        return out


def load(environ=None) -> MoeKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    return cpu_kernels.load(SOURCE, "moe", MoeKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> MoeKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    return cpu_kernels.load_or_warn(load, "mixture-of-experts", "each expert runs as torch calls", log)
