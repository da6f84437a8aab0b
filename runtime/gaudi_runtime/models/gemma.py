"""Gemma (v1): Llama's layout with Gemma's numerics.

* RMSNorm scales by ``1 + weight``, computed in float32 before the cast back
  (Llama casts first, then scales).
* Embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model
  dtype, as ``transformers`` does.
* GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``; the ``gelu`` of the
  original configs means the tanh approximation.
* ``head_dim`` comes from the config (Gemma-7B: 16 heads of 256 with a hidden
  size of 3072); the LM head is tied to the embeddings unless the config says not.

Gemma 2 and 3 (``gemma2.py``, ``gemma3.py``) build on these numerics with
local and global layers, soft-capping and extra norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import MergedColumnParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import RMSNorm
from .base import rotary_embedding
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# Activation names that mean GELU with the tanh approximation in Gemma configs.
GELU_TANH = ("gelu", "gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


@dataclass(kw_only=True)
class GemmaConfig(LlamaConfig):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> GemmaConfig:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise ValueError(f"unsupported hidden_act {act!r} for Gemma (supported: {', '.join(GELU_TANH)})")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not a causal LM")
        # Llama's parser checks for SiLU; the activation is fixed to GeGLU here instead.
        llama_view = {**cfg, "hidden_act": "silu", "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        return super().from_dict(llama_view, architecture)


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)`` in float32, then cast to the input dtype."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: GemmaConfig, tp: TPContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm_class = GemmaRMSNorm
    mlp_class = GemmaMLP


class GemmaModel(LlamaModel):
    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: GemmaConfig, rotary, tp: TPContext, dtype: torch.dtype):
        super().__init__(cfg, rotary, tp)
        # Rounded to the model dtype first (bf16: sqrt(3072) -> 55.5), as transformers does.
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device="cpu"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class GemmaForCausalLM(LlamaForCausalLM):
    config_class = GemmaConfig

    def build(self, cfg: GemmaConfig, tp: TPContext) -> None:
        self.model = GemmaModel(cfg, rotary_embedding(cfg, self.dtype, self.device), tp, self.dtype)
