"""LoRA adapters' products on a CPU in one C call per layer (``cpu_lora.c``), rows grouped by adapter.

The portable path (``layers/lora.LoraWeights.delta``) gathers every row's A and B and runs two bmm: at a
decode step of 16 rows that copies rows x rank x out of B per layer (the block-diagonal zeros of a fused
layer included) and multiplies one row per matrix, which on a CPU cost more than the layer's own product
(docs/performance.md, "LoRA adapters against the base model and vLLM"). The kernel groups the tokens by
slot, reads each adapter's A and B once per group, skips slot 0 and a fused layer's off-diagonal blocks,
and adds into the layer's output in place; bfloat16 runs on the CPU's bfloat16 dot product where it has
avx512_bf16 (``LoraKernel.dot_bf16``), else widened to float32. ``CpuBackend.layer_kernels`` gives every
LoRA layer this call (``CPU_LORA``); it returns None for tensors it does not take, and the bmm runs. Built
at first use (``cpu_kernels``); without a compiler, one warning, and the bmm.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from gaudi_runtime.device import cpu_kernels
from gaudi_runtime.layers.kernels import LayerKernels, install_kernels
from gaudi_runtime.layers.linear import LinearBase
from gaudi_runtime.layers.lora import LoraWeights

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def output_slices(layer: LinearBase) -> torch.Tensor:
    """``[slices, 2]`` int64: each fused projection's (offset, size) in this rank's output, in the order of
    the rank axis's blocks (``lora_output_slices``); a layer fusing nothing is one slice of all of it."""
    slices = layer.lora_output_slices()
    if slices is None:
        return torch.tensor([[0, layer.weight.shape[0]]], dtype=torch.int64)
    return torch.tensor([[offset, size] for _, offset, _, size in slices], dtype=torch.int64)


class LoraKernel:
    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the calls run without the GIL
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._add = lib.lora_add
        self._add.argtypes = [ptr] * 6 + [i64] * 7 + [ctypes.c_int] * 2
        self._add.restype = ctypes.c_int
        lib.lora_dot_bf16.restype = ctypes.c_int
        # bfloat16's x A on the CPU's dot product (a build with avx512_bf16), else widened to float32
        self.dot_bf16 = bool(lib.lora_dot_bf16())

    def add(self, slices: torch.Tensor, lora: LoraWeights, x: torch.Tensor, y: torch.Tensor,
            index: torch.Tensor) -> torch.Tensor | None:
        """`y` with each row's adapter's product added in place (`LoraWeights.kernel`; `slices`: the layer's
        ``output_slices``); None for tensors the kernel does not take."""
        buffers = lora._buffers  # not lora.a: nn.Module's attribute lookup costs more than the checks
        a, b = buffers["a"], buffers["b"]
        nslots, in_features, k = a.shape
        out, rows = y.shape[-1], index.numel()
        tokens = x.numel() // in_features if in_features else 0
        dtype = x.dtype
        if (dtype not in DTYPES or y.dtype != dtype or a.dtype != dtype or b.dtype != dtype
                or not (x.is_cpu and y.is_cpu and a.is_cpu and b.is_cpu and index.is_cpu)
                or not (y.is_contiguous() and a.is_contiguous() and b.is_contiguous())
                or x.shape[-1] != in_features or b.shape != (nslots, k, out) or y.numel() != tokens * out
                or index.dtype != torch.int64 or rows == 0 or tokens % rows or k % slices.shape[0]):
            return None
        x, index = x.contiguous(), index.contiguous()
        status = self._add(y.data_ptr(), x.data_ptr(), a.data_ptr(), b.data_ptr(), index.data_ptr(),
                           slices.data_ptr(), rows, tokens // rows, in_features, k, out, nslots, slices.shape[0],
                           DTYPES[dtype], torch.get_num_threads())
        if status == 2:
            raise IndexError(f"LoRA: an adapter slot is outside [0, {nslots})")
        if status != 0:
            raise MemoryError("LoRA: no memory for the kernel's scratch")
        return y


def load(environ=None) -> LoraKernel:
    """Build (or find) and load the kernel; raises KernelUnavailable saying why not."""
    return cpu_kernels.load(SOURCE, "lora", LoraKernel, environ)


@functools.lru_cache(maxsize=1)
def kernel() -> LoraKernel | None:
    """The kernel for this process, or None (warned once) when it cannot be had here."""
    return cpu_kernels.load_or_warn(load, "LoRA", "adapters run as gathered bmm", log)


def lora_kernels(lora_kernel: LoraKernel) -> Callable[[LinearBase], Callable]:
    """`lora_kernel`'s call for each LoRA layer (``LayerKernels.lora``), over that layer's output slices."""
    return lambda layer: functools.partial(lora_kernel.add, output_slices(layer))


def has_adapters(model: torch.nn.Module) -> bool:
    return any(isinstance(m, LinearBase) and m.lora is not None for m in model.modules())


def set_lora_kernel(model: torch.nn.Module, lora_kernel: LoraKernel | None) -> int:
    """Give every LoRA layer of `model` `lora_kernel`'s call (None: take it away, back to the bmm); returns
    how many layers it set."""
    chosen = LayerKernels() if lora_kernel is None else LayerKernels(lora=lora_kernels(lora_kernel))
    return install_kernels(model, chosen, clear=("lora",))["lora"]

