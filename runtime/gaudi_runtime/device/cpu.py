"""CPU: eager execution, gloo for collectives."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_gemv, cpu_moe, cpu_paged_attention
from gaudi_runtime.device.base import Backend
from gaudi_runtime.device.cpu_attention import CpuAttention, InvariantCpuAttention
from gaudi_runtime.device.cpu_gemm import fixed_order_linears, native_bf16, prepack_linears
from gaudi_runtime.device.cpu_gptq import use_gptq_kernel
from gaudi_runtime.device.cpu_layer_ops import kernel as layer_ops_kernel
from gaudi_runtime.device.cpu_layer_ops import set_layer_ops, use_layer_ops
from gaudi_runtime.device.cpu_lora import use_lora_kernel
from gaudi_runtime.device.host_allocator import tune_host_allocator
from gaudi_runtime.layers.attention import Attention
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.moe import grouped_experts, use_experts_kernel


class CpuBackend(Backend):
    name = "cpu"
    distributed_backend = "gloo"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        tune_host_allocator()

    def memory_info(self) -> tuple[int, int] | None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError):
            return None

    def attention(self, use_flash: bool = True, recompute: bool = False, cpu_paged: bool = True,
                  batch_invariant: bool = False) -> AttentionBackend:
        """Decode reads the paged cache in place with the C kernel (`cpu_paged`; compiled here, so a missing
        compiler is found and warned about at start), else over the gathered blocks with
        `grouped_decode_attention`; the matmul prefills where this CPU multiplies bfloat16 in hardware.
        `batch_invariant`: that kernel for every query token, prefill's too (`InvariantCpuAttention`)."""
        if batch_invariant:
            return InvariantCpuAttention(_required(cpu_paged_attention.kernel(), "paged attention"))
        if not use_flash:
            return super().attention(use_flash, recompute, cpu_paged)
        return CpuAttention(cpu_paged_attention.kernel() if cpu_paged else None, native_bf16())

    def prepare_model(self, model: torch.nn.Module, cfg=None) -> None:
        if cfg is not None and cfg.batch_invariant:
            _fixed_order(model)
            return
        prepack_linears(model, few_rows=cfg is None or cfg.cpu_gemv)
        use_gptq_kernel(model)
        if cfg is None or cfg.cpu_layer_ops:
            use_layer_ops(model)
        if cfg is None or cfg.cpu_lora:
            use_lora_kernel(model)
        # Eager: each expert runs on its own tokens only; a decode step's experts in one C call.
        use_experts_kernel(model, experts_kernel(cpu_gemv.kernel() if cfg is None or cfg.cpu_gemv else None,
                                                 cpu_moe.kernel() if cfg is None or cfg.cpu_moe else None))


def _required(kernel, what: str):
    if kernel is None:
        raise RuntimeError(f"--batch-invariant needs the CPU's {what} kernel, which could not be built here (see the "
                           "warning above)")
    return kernel


def _fixed_order(model: torch.nn.Module) -> None:
    """The batch-invariant mode's kernels, installed once: fixed-order linear layers and experts, and the
    per-row C norm (docs/design.md, "Batch-invariant mode")."""
    for m in model.modules():
        if isinstance(m, Attention) and (m.head_dim % cpu_paged_attention.HEAD_SIZE_MULTIPLE
                                         or m.head_dim > cpu_paged_attention.MAX_HEAD_SIZE):
            raise RuntimeError(f"--batch-invariant: head size {m.head_dim} is not one the paged attention kernel "
                               f"takes (a multiple of {cpu_paged_attention.HEAD_SIZE_MULTIPLE}, at most "
                               f"{cpu_paged_attention.MAX_HEAD_SIZE})")
    gemv = _required(cpu_gemv.kernel(), "few-row product")
    fixed_order_linears(model, gemv)
    set_layer_ops(model, _required(layer_ops_kernel(), "layer operations"))
    use_experts_kernel(model, functools.partial(grouped_experts, linear=lambda x, w: gemv.fixed(x, w, None)))


def experts_kernel(gemv, moe=None):
    """The MoE experts' CPU path: a step whose experts average a few rows through `moe` (``cpu_moe``: every
    routed expert in one C call), else `grouped_experts`, an expert's few bfloat16 rows multiplied by the
    few-row C kernel (`gemv`), which reads each expert's weight once where oneDNN's bf16 product of two or
    three rows runs far below the memory's speed (float32 keeps F.linear: MKL's is as fast). None: that
    kernel is not used."""
    grouped = grouped_experts if gemv is None else functools.partial(grouped_experts, linear=_few_rows_linear(gemv))
    if moe is None:
        return grouped

    def experts(x, weights, ids, w13, w2):
        if moe.takes(x, ids, w13, w2):
            return moe(x, weights, ids, w13, w2)
        return grouped(x, weights, ids, w13, w2)

    return experts


def _few_rows_linear(gemv):
    def linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        few = weight.dtype == torch.bfloat16 and rows.dtype == weight.dtype and weight.is_contiguous()
        if few and gemv.takes_rows(rows.shape[0], rows.dtype):
            return gemv.multiply(rows, rows.shape[0], weight, None)
        return F.linear(rows, weight)

    return linear
