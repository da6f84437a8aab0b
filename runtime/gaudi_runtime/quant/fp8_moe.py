"""Float8 checkpoints' MoE experts and MLA ``kv_b_proj``: what `prequantized.py` does for linear layers.

Experts (``layers/moe.ExpertWeights``) keep the checkpoint's float8 weights stacked as the bf16 experts
are, ``[E, out, in]``, with float32 scales row-expanded as the linear layers keep theirs (``[E, out, G]``,
one per weight row and group of ``in / G`` columns), so each rank's slice is cut exactly as its weight is.
The compute reads them through `Fp8ExpertStack`: indexing it by experts dequantizes only those experts to
the activation dtype (the CPU's grouped path touches the routed experts of each call, nothing else);
Gaudi's fused MoE op takes the float8 experts and their block scales as stored (``device/hpu.py``).

``kv_b_proj`` (``layers/mla.HeadsUpProjection``) is read head by head at decode (absorbed into the query
and the output), so it is dequantized once, after loading, into the model dtype: a few MiB per layer.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gaudi_runtime.config import ConfigError
from gaudi_runtime.layers.linear import LazyWeight, materialize
from gaudi_runtime.layers.mla import HeadsUpProjection
from gaudi_runtime.layers.moe import ExpertWeights
from gaudi_runtime.quant.checkpoint import CheckpointQuant
from gaudi_runtime.quant.fp8_linear import FP8
from gaudi_runtime.quant.fp8_scales import RowScales, dequantize

log = logging.getLogger(__name__)


class Fp8ExpertStack:
    """Stacked float8 experts as the MoE compute reads them: ``stack[ids]`` is those experts dequantized."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                 dtype: torch.dtype, gate_up: bool):
        self.qweight, self.scale, self.block, self.dtype, self.gate_up = qweight, scale, block, dtype, gate_up
        self.shape = qweight.shape

    def __getitem__(self, index) -> torch.Tensor:
        return dequantize(self.qweight[index], self.scale[index], self.dtype)

    @property
    def block_scales(self) -> torch.Tensor | None:
        """``[E, ceil(out / b), in / b]``: the checkpoint's square block scales of this rank's slice, where
        the slice starts every block at a block boundary (Gaudi's blockwise MoE op); else None."""
        if self.block is None or self.block[0] != self.block[1]:
            return None
        rows = self.shape[1] // 2 if self.gate_up else self.shape[1]
        if self.gate_up and rows % self.block[0]:
            return None
        return self.scale[:, ::self.block[0], :]


class Fp8ExpertWeights(ExpertWeights):
    """``ExpertWeights`` holding a checkpoint's float8 experts and their row-expanded scales."""

    scale_name: str
    block: tuple[int, int] | None
    compute_dtype: torch.dtype

    def experts(self, dtype: torch.dtype) -> Fp8ExpertStack:
        return Fp8ExpertStack(self.weight, getattr(self, self.scale_name), self.block, dtype, self.gate_up)

    def extra_repr(self) -> str:
        return f"fp8 checkpoint experts {tuple(self.weight.shape)}, scales {tuple(getattr(self, self.scale_name).shape)}"


class Fp8HeadsUpProjection(HeadsUpProjection):
    """``kv_b_proj`` while a float8 checkpoint loads into it; `finish_loading` makes it dense again."""

    scale_name: str
    compute_dtype: torch.dtype


def _param(shape, dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def _groups(name: str, cols: int, found: CheckpointQuant, why: str) -> tuple[int, int]:
    """(column groups, weight rows per scale row) of a layer with `cols` input columns on this rank."""
    if found.block is None:
        return 1, 1
    rows, block_cols = found.block
    if cols % block_cols:
        raise ConfigError(f"layer {name}: {cols} input columns {why} are not a multiple of the {block_cols}-column "
                          "weight blocks (use fewer shards)")
    return cols // block_cols, rows


def to_fp8_experts(name: str, module: ExpertWeights, found: CheckpointQuant, scale_name: str) -> None:
    """Give stacked experts a float8 weight and row-expanded scales for the checkpoint to load (in place)."""
    if found.activations == "static-tensor":
        raise ConfigError(f"layer {name}: static activation scales on MoE experts are not read")
    experts, out, cols = module.weight.shape
    groups, per = _groups(name, cols, found, "per rank of each expert")
    tp, device, dtype = module.tp, module.weight.device, module.weight.dtype

    def load_scale(param: nn.Parameter, loaded, shard_id) -> None:
        rows = out // 2 * tp.size if module.gate_up else out  # one projection of one expert, all ranks
        width = groups if module.gate_up else groups * tp.size
        module.weight_loader(param, LazyWeight(RowScales(materialize(loaded), per), (rows, width)), shard_id)

    module.__class__ = Fp8ExpertWeights
    module.scale_name, module.block, module.compute_dtype = scale_name, found.block, dtype
    module.weight = _param((experts, out, cols), FP8, device, module.weight_loader)
    module.register_parameter(scale_name, _param((experts, out, groups), torch.float32, device, load_scale))


def to_fp8_heads_up(name: str, module: HeadsUpProjection, found: CheckpointQuant, scale_name: str) -> None:
    """Give ``kv_b_proj`` a float8 weight and scales to load; `finish_loading` dequantizes them."""
    rows, cols = module.weight.shape
    groups, per = _groups(name, cols, found, "(the latent)")
    device, dtype = module.weight.device, module.weight.dtype

    def load_scale(param: nn.Parameter, loaded) -> None:
        module.weight_loader(param, LazyWeight(RowScales(materialize(loaded), per), (rows * module.tp.size, groups)))

    module.__class__ = Fp8HeadsUpProjection
    module.scale_name, module.compute_dtype = scale_name, dtype
    module.weight = _param((rows, cols), FP8, device, module.weight_loader)
    module.register_parameter(scale_name, _param((rows, groups), torch.float32, device, load_scale))


def finish_loading(model: nn.Module) -> int:
    """Dequantize every loaded float8 ``kv_b_proj`` into the model dtype; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Fp8HeadsUpProjection)]
    for m in layers:
        w = dequantize(m.weight.data, getattr(m, m.scale_name).data, m.compute_dtype)
        delattr(m, m.scale_name)
        m.__class__ = HeadsUpProjection
        m.weight = nn.Parameter(w, requires_grad=False)
    return len(layers)


def use_hpu_fp8_experts(model: nn.Module, fmax: float) -> tuple[int, int]:
    """Ready float8 experts for Gaudi's blockwise fused MoE op (values within the card's E4M3 range `fmax`);
    a layer whose scales that op cannot take (not square blocks, a rank's gate/up slice across a block) has
    both its stacks dequantized into the model dtype for the plain op. Returns (float8 layers, dequantized)."""
    kept, dense = 0, 0
    for moe in model.modules():
        stacks = [w for w in (getattr(moe, "w13", None), getattr(moe, "w2", None)) if isinstance(w, Fp8ExpertWeights)]
        if not stacks:
            continue
        if any(w.experts(w.compute_dtype).block_scales is None for w in stacks):
            for w in stacks:
                _dequantize_stack(w)
            dense += 1
            continue
        if fmax < 448.0:  # Gaudi 2's E4M3: the same values, scaled into its smaller range
            for w in stacks:
                ratio, scale = 448.0 / fmax, getattr(w, w.scale_name).data
                w.weight = nn.Parameter((w.weight.data.float() / ratio).clamp(-fmax, fmax).to(FP8), requires_grad=False)
                w.register_parameter(w.scale_name, nn.Parameter(scale * ratio, requires_grad=False))
        kept += 1
    return kept, dense


def _dequantize_stack(w: Fp8ExpertWeights) -> None:
    dense = dequantize(w.weight.data, getattr(w, w.scale_name).data, w.compute_dtype)
    delattr(w, w.scale_name)
    w.__class__ = ExpertWeights
    w.weight = nn.Parameter(dense, requires_grad=False)
