"""Starcoder2: GQA attention with RoPE and biases, LayerNorm (with bias), and a GELU-tanh MLP.

Llama's decoder with these modules: its residual stream, added inside each norm,
is the same sum as Starcoder2's ``x + attn(norm(x))``.

* ``use_bias`` puts biases on q/k/v/o and on the MLP's ``c_fc``/``c_proj``.
* ``sliding_window`` (4096 in the released models) caps the context, as
  Mistral's, so every sequence the runtime serves sees exactly what full
  attention would give.
* The LM head is tied to the embeddings unless the config says not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import LayerNorm
from .gemma import GELU_TANH
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(kw_only=True)
class Starcoder2Config(LlamaConfig):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Starcoder2Config:
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in GELU_TANH:
            raise ValueError(f"unsupported hidden_act {act!r} for Starcoder2 (supported: {', '.join(GELU_TANH)})")
        use_bias = bool(cfg.get("use_bias", True))
        # Llama's parser reads the shared fields, given Starcoder2's under Llama's names.
        llama_view = {**cfg, "hidden_act": "silu", "attention_bias": use_bias, "mlp_bias": use_bias,
                      "rms_norm_eps": cfg.get("norm_epsilon", 1e-5),
                      "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        return super().from_dict(llama_view, architecture)


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: Starcoder2Config, tp: TPContext):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, tp=tp)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = Starcoder2MLP


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    config_class = Starcoder2Config
    model_class = Starcoder2Model
