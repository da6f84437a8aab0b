"""The shard's one quantization step after loading: FP8 weights (INC on Gaudi, ours elsewhere) and the KV dtype."""

from __future__ import annotations

import logging

import torch
from torch import nn

from gaudi_runtime.config import Config, ServedModelConfig
from gaudi_runtime.device.base import Backend
from gaudi_runtime.quant.apply import load_rank_stats, quantize_model, set_kv_scales
from gaudi_runtime.quant.config import QuantConfig, check_quant_config

log = logging.getLogger(__name__)

KV_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn}


def kv_cache_dtype(model: ServedModelConfig, model_dtype: torch.dtype) -> torch.dtype:
    return KV_DTYPES[model.kv_cache_dtype] if model.kv_cache_dtype else model_dtype


def quant_config(cfg: Config) -> QuantConfig:
    """The QUANT_CONFIG file (checked again: not every start goes through `launch`), or the defaults of a
    bare --quantize fp8: every layer, dynamic input scales."""
    return check_quant_config(cfg) or QuantConfig()


def quantize_loaded(model: nn.Module, cfg: Config, backend: Backend, dtype: torch.dtype, rank: int = 0,
                    world_size: int = 1) -> nn.Module:
    """Apply --quantize / QUANT_CONFIG / --kv-cache-dtype to a freshly loaded model; return the model to serve.
    `backend`: the device's, whose facts say how its FP8 runs (``native_fp8_checkpoints``, ``quantizes_with_inc``)."""
    stats = None
    if getattr(model, "quantization", None):  # a pre-quantized checkpoint: loaded as it is stored
        from gaudi_runtime.quant.prequantized import how_served, use_hpu_fp8

        if backend.native_fp8_checkpoints:
            use_hpu_fp8(model)
        model.quantization = how_served(model.quantization, backend.native_fp8_checkpoints)
        log.info("rank %d: checkpoint loaded as stored: %s", rank, model.quantization)
    elif cfg.model.quantize == "fp8":
        qc = quant_config(cfg)
        if backend.quantizes_with_inc:
            from gaudi_runtime.quant import inc

            model = inc.convert_quantize(model, qc, rank, world_size)
            log.info("rank %d: FP8 through Intel Neural Compressor (%s)", rank, qc.source or "defaults")
        else:
            stats = load_rank_stats(qc, rank, world_size)
            report = quantize_model(model, qc, dtype, stats)
            static = sum(s is not None for s in report.input_scales.values())
            log.info("rank %d: %d layers in FP8 (%d with static input scales), %d kept in %s",
                     rank, len(report.input_scales), static, len(report.kept), cfg.model.dtype)
    if cfg.model.kv_cache_dtype:
        set_kv_scales(model, stats)
        log.info("rank %d: KV cache in %s (%s scales)", rank, cfg.model.kv_cache_dtype,
                 "measured" if stats else "unit")
    return model
