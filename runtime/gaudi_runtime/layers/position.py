"""Learned absolute position embedding (GPT-2 style ``wpe``), replicated on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import materialize


class PositionEmbedding(nn.Module):
    def __init__(self, num_positions: int, embedding_dim: int):
        super().__init__()
        self.num_positions = num_positions
        self.weight = nn.Parameter(torch.empty(num_positions, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.data.shape != loaded.shape:
            raise ValueError(f"position embedding shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
        param.data.copy_(materialize(loaded))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # Real tokens are always below num_positions (the engine caps the context at it); padding rows of a
        # bucket may run past it, and clamping keeps their lookup in the table without a host-side check.
        return F.embedding(positions.clamp(max=self.num_positions - 1), self.weight)
