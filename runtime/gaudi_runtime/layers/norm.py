"""RMSNorm (Llama style: normalize in float32, scale in the model dtype)."""

from __future__ import annotations

import torch
from torch import nn

from .linear import materialize


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.data.shape != loaded.shape:
            raise ValueError(f"norm weight shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
        param.data.copy_(materialize(loaded))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
