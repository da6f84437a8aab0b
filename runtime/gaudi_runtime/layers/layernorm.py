"""LayerNorm with weight and bias (Falcon, GPTBigCode/Starcoder, Starcoder2), replicated on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import materialize


class LayerNorm(nn.Module):
    """``nn.LayerNorm``'s formula (``F.layer_norm``) on parameters in the model dtype; ``bias=False`` drops the shift."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.data.shape != loaded.shape:
            raise ValueError(f"layer norm shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
        param.data.copy_(materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
