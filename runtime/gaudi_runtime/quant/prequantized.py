"""FP8 checkpoints loaded as published: float8 weights and their scales straight into the linear layers.

Before the checkpoint is read, each linear layer the checkpoint stores in float8 (its `.weight` is F8 in
the safetensors header) gets a float8 ``weight`` and a float32 scale parameter, ``[out, G]``: one scale
per output row and per group of ``in / G`` input columns (G = 1 for per-tensor and per-channel scales,
``in / block columns`` for block scales). Every scale is stored expanded to rows, so the layer's own
``weight_loader`` slices it exactly as it slices the weight (column, merged, QKV and row-parallel alike)
and a per-tensor scale of each fused projection (q, k, v; gate, up) lands on that projection's rows.

The product (``matmul``) dequantizes this one layer's weight to the activation dtype and multiplies:
the activations stay in the model dtype (weight-only FP8, as vLLM runs FP8 checkpoints on hardware
without FP8 matmuls). On Gaudi the layer runs Gaudi's FP8 matmul instead (``device/hpu.py``).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from gaudi_runtime.config import ConfigError
from gaudi_runtime.layers.kernels import LayerKernels, install_kernels
from gaudi_runtime.layers.linear import (
    LazyWeight,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from gaudi_runtime.layers.mla import HeadsUpProjection
from gaudi_runtime.layers.moe import ExpertWeights
from gaudi_runtime.quant.checkpoint import CheckpointQuant, quantized_modules, read_header
from gaudi_runtime.quant.fp8_linear import FP8
from gaudi_runtime.quant.fp8_moe import finish_loading, to_fp8_experts, to_fp8_heads_up, use_hpu_fp8_experts
from gaudi_runtime.quant.fp8_scales import RowScales, dequantize

log = logging.getLogger(__name__)

class Fp8CheckpointMixin:
    """A linear layer holding a checkpoint's float8 weight and its row-expanded scales."""

    weight: nn.Parameter
    scale_name: str
    input_scale: nn.Parameter | None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:  # the device's FP8 matmul (Gaudi: `use_hpu_fp8`)
            return self.kernel(x, bias)
        return F.linear(x, dequantize(self.weight, getattr(self, self.scale_name), x.dtype), bias)

    def extra_repr(self) -> str:
        scale = getattr(self, self.scale_name)
        return f"fp8 checkpoint weight {tuple(self.weight.shape)}, scales {tuple(scale.shape)}"


_CLASSES: dict[type, type] = {}


def _class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Fp8Checkpoint{cls.__name__}", (Fp8CheckpointMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _checkpoint_rows(module: LinearBase, shard) -> int:
    """Rows of the checkpoint tensor (one projection of a fused layer) that `module` loads with `shard`."""
    if hasattr(module, "total_rows"):  # a checkpoint's own fused qkv (layers/fused_qkv.py)
        return module.total_rows
    if isinstance(module, QKVParallelLinear):
        heads = module.total_num_heads if shard == "q" else module.total_num_kv_heads
        return heads * module.head_dim
    if isinstance(module, MergedColumnParallelLinear):
        return module.output_sizes[shard]
    return module.weight.shape[0] * (1 if isinstance(module, (RowParallelLinear, ReplicatedLinear)) else module.tp.size)


def _scale_loader(module: LinearBase, groups: int, rows_per_scale: int | None):
    """A loader for the scale parameter: the checkpoint scale, row-expanded, through the layer's own loader."""
    row_parallel = isinstance(module, RowParallelLinear)

    def load(param: nn.Parameter, loaded, *shard) -> None:
        scale = loaded.load() if isinstance(loaded, LazyWeight) else loaded
        rows = _checkpoint_rows(module, shard[0] if shard else None)
        cols = groups * (module.tp.size if row_parallel else 1)
        per = rows_per_scale or 1
        if scale.dim() == 2 and scale.shape[1] not in (1, cols):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not fit {cols} column groups")
        module.weight_loader(param, LazyWeight(RowScales(scale, per), (rows, cols)), *shard)

    return load


def _input_scale_loader(param: nn.Parameter, loaded, *shard) -> None:
    """Static activation scales of fused projections: the largest covers them all."""
    value = (loaded.load() if isinstance(loaded, LazyWeight) else loaded).float().reshape(-1).max()
    param.data.copy_(torch.maximum(param.data, value.reshape(1)))


def _new_param(shape, dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def to_fp8_checkpoint(name: str, module: LinearBase, found: CheckpointQuant, scale_name: str) -> None:
    """Give `module` a float8 weight and scale parameters for the checkpoint to load into (in place)."""
    out, cols = module.weight.shape
    groups, rows_per_scale = 1, None
    if found.block is not None:
        rows_per_scale, block_cols = found.block
        if cols % block_cols:
            raise ConfigError(f"layer {name}: {cols} input columns per rank are not a multiple of the "
                              f"{block_cols}-column weight blocks")
        groups = cols // block_cols
    device = module.weight.device
    module.__class__ = _class(type(module))
    module.weight = _new_param((out, cols), FP8, device, module.weight_loader)
    module.scale_name = scale_name
    module.register_parameter(scale_name, _new_param((out, groups), torch.float32, device,
                                                     _scale_loader(module, groups, rows_per_scale)))
    static = found.activations == "static-tensor"
    module.input_scale = _new_param((1,), torch.float32, device, _input_scale_loader) if static else None


def _model_modules(model: nn.Module, ckpt_modules: set[str]) -> dict[str, set]:
    """Checkpoint module names -> the model's module names, each with the fused projections it holds."""
    mapping = getattr(model, "packed_modules_mapping", {})
    out: dict[str, set] = {}
    for ckpt in sorted(ckpt_modules):
        name = model.checkpoint_name(f"{ckpt}.weight")
        if model.unused_weight(name):  # e.g. DeepSeek's multi-token-prediction layer: not loaded at all
            continue
        shard = None
        for frag, (mine, shard_id) in mapping.items():
            if f".{frag}." in name:
                name, shard = name.replace(f".{frag}.", f".{mine}."), shard_id
                break
        out.setdefault(name.rsplit(".", 1)[0], set()).add(shard)
    return out


def _check_fused(name: str, module: LinearBase, shards: set, model: nn.Module) -> None:
    """A fused layer is float8 only if every projection in it is."""
    mapping = getattr(model, "packed_modules_mapping", {})
    leaf = name.rsplit(".", 1)[-1]
    expected = {shard for mine, shard in mapping.values() if mine == leaf} or {None}
    if shards != expected:
        raise ConfigError(f"layer {name}: the checkpoint stores only some of its fused projections in float8 "
                          f"({sorted(map(str, shards))} of {sorted(map(str, expected))})")


def prepare_fp8_checkpoint(model: nn.Module, found: CheckpointQuant, files) -> int:
    """Make every layer the checkpoint stores in float8 ready to load it; returns how many."""
    tensors: dict[str, dict] = {}
    for f in files:
        tensors.update(read_header(f))
    scale_name = "weight_scale_inv" if found.method == "fp8" else "weight_scale"
    modules = dict(model.named_modules())
    targets = _model_modules(model, quantized_modules(tensors, found))
    for name, shards in targets.items():
        module = modules.get(name)
        if not isinstance(module, (LinearBase, ExpertWeights, HeadsUpProjection)):
            raise ConfigError(f"checkpoint module {name!r} is float8, which gaudi-serve reads only for linear "
                              "layers, MoE experts and MLA's kv_b_proj "
                              f"(not {type(module).__name__ if module is not None else 'a known module'})")
        _check_fused(name, module, shards, model)
        convert = (to_fp8_experts if isinstance(module, ExpertWeights) else
                   to_fp8_heads_up if isinstance(module, HeadsUpProjection) else to_fp8_checkpoint)
        convert(name, module, found, scale_name)
    log.info("%d layers load float8 weights (%s)", len(targets), found.describe())
    return len(targets)


def finish_fp8_checkpoint(model: nn.Module) -> None:
    """After loading: what is kept dense for the compute that reads it (MLA's kv_b_proj) is dequantized."""
    finish_loading(model)


def _requantize_per_channel(q: torch.Tensor, scale: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row within ``±fmax``: what Gaudi's FP8 matmul takes (block scales and Gaudi 2's
    smaller E4M3 range are folded in; a per-row scale within 448 is kept exactly)."""
    if scale.shape[1] == 1 and fmax >= 448.0:
        return q, scale.reshape(-1)
    w = dequantize(q, scale, torch.float32)
    s = (w.abs().amax(dim=1) / fmax).clamp(min=1e-12)
    return (w / s[:, None]).clamp(-fmax, fmax).to(FP8), s


def use_hpu_fp8(model: nn.Module) -> int:
    """Run every float8 checkpoint layer on Gaudi's FP8 matmul (per-channel weight scales within the card's
    E4M3 range; inputs cast per tensor, statically where the checkpoint has input scales); returns how many."""
    from gaudi_runtime.device import hpu

    fmax = hpu.fp8_max()
    layers = [m for m in model.modules() if isinstance(m, Fp8CheckpointMixin)]
    kernels = {}
    for m in layers:
        q, s = _requantize_per_channel(m.weight.data, getattr(m, m.scale_name).data, fmax)
        m.weight = nn.Parameter(q, requires_grad=False)
        m.register_parameter(m.scale_name, nn.Parameter(s, requires_grad=False))
        # A static input scale measured for 448 maps the same inputs into a smaller range.
        in_scale = None if m.input_scale is None else m.input_scale.data * (448.0 / fmax)
        kernels[m] = functools.partial(_hpu_kernel, m, in_scale, fmax)
    install_kernels(model, LayerKernels(linear=kernels.get))
    log.info("%d float8 checkpoint layers run on Gaudi's FP8 matmul (E4M3 range %g)", len(layers), fmax)
    kept, dense = use_hpu_fp8_experts(model, fmax)
    if kept or dense:
        log.info("MoE experts: %d layers float8 on Gaudi's blockwise fused MoE, %d dequantized for the bf16 one",
                 kept, dense)
    return len(layers)


def _hpu_kernel(m: nn.Module, in_scale: torch.Tensor | None, fmax: float, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    from gaudi_runtime.device import hpu

    return hpu.fp8_linear(x, m.weight, getattr(m, m.scale_name), in_scale, bias, fmax)


def how_served(described: str, native_fp8: bool) -> str:
    """/info's and the log's account of a checkpoint: its format (`described`), and how this device runs it
    (`native_fp8`: its float8 layers on the device's FP8 matmul, ``Backend.native_fp8_checkpoints``)."""
    if described.startswith(("gptq", "awq")):
        return f"{described}; weights kept packed, dequantized per layer, activations in the model dtype"
    if native_fp8:
        return f"{described}; Gaudi FP8 matmuls"
    return f"{described}; float8 weights dequantized per layer, activations in the model dtype"


def is_fp8_checkpoint_layer(module: nn.Module) -> bool:
    return isinstance(module, Fp8CheckpointMixin)
