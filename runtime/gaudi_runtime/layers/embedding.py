"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded up to a multiple of the tensor-parallel size; rank r
holds rows ``[r * V_r, (r + 1) * V_r)`` of the padded table (padding rows are
zero). The LM head all-gathers the per-rank logits and drops the padding
columns, so every rank gets ``[N, vocab_size]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import TPContext, materialize


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext = TPContext()):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.padded_num_embeddings = -(-num_embeddings // tp.size) * tp.size
        self.num_embeddings_per_rank = self.padded_num_embeddings // tp.size
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.size(1) != param.data.size(1) or loaded.size(0) < self.num_embeddings:
            raise ValueError(f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, expected "
                             f"({self.num_embeddings}, {param.data.size(1)})")
        n = max(0, min(self.num_embeddings, self.vocab_end) - self.vocab_start)
        if n:
            param.data[:n].copy_(materialize(loaded.narrow(0, self.vocab_start, n)))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = (input_ids - self.vocab_start) * in_range
        y = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    kernel = None  # as LinearBase.kernel: set by the backend after loading

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight) if self.kernel is None else self.kernel(hidden, None)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        if self.padded_num_embeddings != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits.float()
