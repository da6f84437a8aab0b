"""CPU: eager execution, gloo for collectives."""

from __future__ import annotations

import os

import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.device.cpu_gemm import prepack_linears
from gaudi_runtime.device.cpu_layer_ops import use_layer_ops
from gaudi_runtime.device.host_allocator import tune_host_allocator


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

    def prepare_model(self, model: torch.nn.Module, cfg=None) -> None:
        prepack_linears(model, few_rows=cfg is None or cfg.cpu_gemv)
        if cfg is None or cfg.cpu_layer_ops:
            use_layer_ops(model)
