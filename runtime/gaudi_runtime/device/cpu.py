"""CPU: eager execution, gloo for collectives."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from gaudi_runtime.device import cpu_gemv, cpu_layer_ops, cpu_lora, cpu_moe, cpu_paged_attention
from gaudi_runtime.device.base import Backend
from gaudi_runtime.device.cpu_attention import CpuAttention, InvariantCpuAttention
from gaudi_runtime.device.cpu_gemm import fixed_order_kernels, linear_kernels, native_bf16
from gaudi_runtime.device.cpu_gptq import gptq_kernels
from gaudi_runtime.device.host_allocator import tune_host_allocator
from gaudi_runtime.layers.attention import Attention
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.kernels import LayerKernels
from gaudi_runtime.layers.moe import grouped_experts


class CpuBackend(Backend):
    name = "cpu"
    distributed_backend = "gloo"
    computes_on_host = True

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

    def layer_kernels(self, model: torch.nn.Module, cfg=None) -> LayerKernels:
        """Linear layers over weights reordered for oneDNN (a few rows through the C kernel, CPU_GEMV), GPTQ's
        packed product, the layer operations' C calls (CPU_LAYER_OPS), the LoRA kernel (CPU_LORA) and the
        experts' one-call kernel (CPU_MOE) or grouped path; the batch-invariant mode's fixed-order kernels instead
        (`cfg`: DeviceConfig)."""
        if cfg is not None and cfg.batch_invariant:
            return _fixed_order(model)
        gemv_on = cfg is None or cfg.cpu_gemv
        linears = {**linear_kernels(model, few_rows=gemv_on), **gptq_kernels(model)}
        ops_kernel = cpu_layer_ops.kernel() if cfg is None or cfg.cpu_layer_ops else None
        ops = LayerKernels() if ops_kernel is None else cpu_layer_ops.layer_ops_kernels(ops_kernel)
        lora = cpu_lora.kernel() if (cfg is None or cfg.cpu_lora) and cpu_lora.has_adapters(model) else None
        return LayerKernels(
            linear=linears.get, norm=ops.norm, rotary=ops.rotary, cache_write=ops.cache_write,
            lora=None if lora is None else cpu_lora.lora_kernels(lora),
            # Eager: each expert runs on its own tokens only; a decode step's experts in one C call (CPU_MOE).
            experts=experts_kernel(cpu_gemv.kernel() if gemv_on else None,
                                   cpu_moe.kernel() if cfg is None or cfg.cpu_moe else None))


def _required(kernel, what: str):
    if kernel is None:
        raise RuntimeError(f"--batch-invariant needs the CPU's {what} kernel, which could not be built here (see the "
                           "warning above)")
    return kernel


def _fixed_order(model: torch.nn.Module) -> LayerKernels:
    """The batch-invariant mode's kernels: fixed-order linear layers and experts, and the per-row C norm
    (docs/design.md, "Batch-invariant mode")."""
    for m in model.modules():
        if isinstance(m, Attention) and (m.head_dim % cpu_paged_attention.HEAD_SIZE_MULTIPLE
                                         or m.head_dim > cpu_paged_attention.MAX_HEAD_SIZE):
            raise RuntimeError(f"--batch-invariant: head size {m.head_dim} is not one the paged attention kernel "
                               f"takes (a multiple of {cpu_paged_attention.HEAD_SIZE_MULTIPLE}, at most "
                               f"{cpu_paged_attention.MAX_HEAD_SIZE})")
    gemv = _required(cpu_gemv.kernel(), "few-row product")
    linears = fixed_order_kernels(model, gemv)
    ops = cpu_layer_ops.layer_ops_kernels(_required(cpu_layer_ops.kernel(), "layer operations"))
    return LayerKernels(linear=linears.get, norm=ops.norm, rotary=ops.rotary, cache_write=ops.cache_write,
                        experts=functools.partial(grouped_experts, linear=lambda x, w: gemv.fixed(x, w, None)))


def experts_kernel(gemv, moe=None):
    """The MoE experts' CPU path: a step whose experts average up to 32 rows through `moe` (``cpu_moe``: every
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
