"""The normalizations the model families use, replicated on every rank.

* ``RMSNorm`` (Llama style): normalize in float32, scale in the model dtype.
* ``LayerNorm`` (Falcon, GPTBigCode, Starcoder2, CLIP): ``nn.LayerNorm``'s formula
  on parameters in the model dtype.

Either can take the residual stream and add it first, so a pre-norm decoder carries
the residual between layers and adds it inside the next norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import materialize


def _replicated(hidden_size: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
    param.weight_loader = _load_whole
    return param


def _load_whole(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.data.shape != loaded.shape:
        raise ValueError(f"norm weight shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


class _Norm(nn.Module):
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class RMSNorm(_Norm):
    # ``(x, residual, weight, eps)`` -> what ``forward`` returns, or None for tensors it does not take; set
    # by the backend after loading (the CPU's fused call, ``device/cpu_layer_ops.py``). None: torch's code.
    kernel = None

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _replicated(hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel is not None:
            out = self.kernel(x, residual, self.weight, self.eps)
            if out is not None:
                return out
        return super().forward(x, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class LayerNorm(_Norm):
    """Weight and bias; ``bias=False`` drops the shift."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = _replicated(hidden_size)
        if bias:
            self.bias = _replicated(hidden_size)
        else:
            self.register_parameter("bias", None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
