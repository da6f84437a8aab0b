"""Our FP8 path (CPU, CUDA): swap the chosen layers of a loaded model to float8, one layer at a time.

Activation scales are static (max-abs of the layer's input measured by
`gaudi-serve calibrate`, / 448) when the config points at statistics, and
dynamic otherwise. KV-cache scales come from the same statistics
(`<attention>.k_cache` / `.v_cache` nodes) when present, else 1.0 (vLLM's default).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from gaudi_runtime.config import ConfigError
from gaudi_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gaudi_runtime.quant.config import QuantConfig
from gaudi_runtime.quant.fp8_linear import FP8_MAX, to_fp8
from gaudi_runtime.quant.layers import attention_layers, quantizable_layers, select_layers
from gaudi_runtime.quant.stats import NodeStats, read_stats

log = logging.getLogger(__name__)


@dataclass
class QuantReport:
    """What was converted: layer -> static input scale (None: dynamic), and what stayed in the model dtype."""

    input_scales: dict[str, float | None] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    kv_scales: dict[str, tuple[float, float]] = field(default_factory=dict)


def load_rank_stats(qc: QuantConfig, rank: int, world_size: int) -> dict[str, NodeStats] | None:
    if qc.mode != "QUANTIZE" or not qc.dump_stats_path:
        return None
    try:
        return read_stats(qc.dump_stats_path, rank, world_size)
    except ValueError as e:
        raise ConfigError(f"QUANT_CONFIG {qc.source or ''}: {e}") from None


def _input_scale(name: str, stats: dict[str, NodeStats] | None, qc: QuantConfig) -> float | None:
    if stats is None:
        return None
    node = stats.get(name)
    if node is None or not node.inputs:
        raise ConfigError(f"QUANT_CONFIG {qc.source or ''}: the statistics at {qc.dump_stats_path!r} "
                          f"have no input measurement for layer {name!r}; were they measured on this model "
                          f"with the same number of shards?")
    return max(node.inputs[0], 1e-12) / FP8_MAX


def quantize_model(model: nn.Module, qc: QuantConfig, act_dtype: torch.dtype,
                   stats: dict[str, NodeStats] | None = None) -> QuantReport:
    """Convert the layers `qc` selects to float8 in place (tied weights quantized once)."""
    chosen = set(select_layers(model, qc))
    report = QuantReport()
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for name, module in quantizable_layers(model).items():
        if name not in chosen:
            report.kept.append(name)
            continue
        if "weight" not in module._parameters:  # a tied layer met again under its second name
            continue
        key = id(module._parameters["weight"])
        scale = None if _is_embedding(module) else _input_scale(name, stats, qc)
        shared[key] = to_fp8(module, act_dtype, scale, shared.get(key))
        report.input_scales[name] = scale
    return report


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)


def set_kv_scales(model: nn.Module, stats: dict[str, NodeStats] | None) -> dict[str, tuple[float, float]]:
    """Per-tensor float8 KV-cache scales on every attention layer (from statistics, else 1.0)."""
    scales = {}
    for name, attn in attention_layers(model).items():
        k = v = 1.0
        if stats is not None:
            ks, vs = stats.get(f"{name}.k_cache"), stats.get(f"{name}.v_cache")
            if ks is not None and ks.inputs:
                k = max(ks.inputs[0], 1e-12) / FP8_MAX
            if vs is not None and vs.inputs:
                v = max(vs.inputs[0], 1e-12) / FP8_MAX
        attn.k_scale, attn.v_scale = k, v
        scales[name] = (k, v)
    return scales
