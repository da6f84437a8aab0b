"""Float8 weights with row-expanded scales: the view a layer's loader slices a checkpoint scale through,
and the dequantization every float8 checkpoint layer (linear, experts, ``kv_b_proj``) shares."""

from __future__ import annotations

import torch

from gaudi_runtime.quant.fp8_linear import fp8_to


class RowScales:
    """A checkpoint scale seen as one value per (weight row, column group): indexable like a tensor slice."""

    def __init__(self, scale: torch.Tensor, rows_per_scale: int):
        self.scale = scale.float().reshape(scale.shape[0] if scale.dim() else 1, -1)
        self.rows_per_scale = rows_per_scale

    def __getitem__(self, index: tuple[slice, slice]) -> torch.Tensor:
        rows = torch.arange(index[0].start, index[0].stop) // self.rows_per_scale
        if self.scale.shape[0] == 1:  # per tensor
            rows = torch.zeros_like(rows)
        cols = torch.arange(index[1].start, index[1].stop)
        if self.scale.shape[1] == 1:  # one group per row: every column group (rank) reads it
            cols = torch.zeros_like(cols)
        return self.scale[rows][:, cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 ``[..., out, in]`` times ``[..., out, G]`` scales (each over ``in / G`` columns) in ``dtype``."""
    *lead, out, cols = q.shape
    groups = scale.shape[-1]
    w = fp8_to(q, torch.float32 if dtype == torch.float32 else dtype)
    return (w.view(*lead, out, groups, cols // groups) * scale.to(w.dtype)[..., None]).view(*lead, out, cols).to(dtype)
