"""Granite 3.x (transformers' ``GraniteForCausalLM``): Llama with four multipliers from config.json.

* ``embedding_multiplier`` scales the token embeddings;
* ``attention_multiplier`` is the softmax scale (in place of ``head_dim ** -0.5``);
* ``residual_multiplier`` scales each attention and MLP output before it joins the residual stream;
* ``logits_scaling`` divides the logits.

Each defaults to 1.0, transformers' default, when the config leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..layers.linear import TPContext
from .llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(kw_only=True)
class GraniteConfig(LlamaConfig):
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> GraniteConfig:
        parsed = super().from_dict(cfg, architecture)
        for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
            setattr(parsed, name, float(cfg.get(name, 1.0)))
        if parsed.logits_scaling == 0:
            raise ValueError("logits_scaling is 0 (the logits are divided by it)")
        return parsed


class GraniteAttention(LlamaAttention):
    def __init__(self, cfg: GraniteConfig, rotary, tp: TPContext):
        super().__init__(cfg, rotary, tp)
        self.attn.scale = cfg.attention_multiplier
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x, positions, kv_cache, meta):
        return super().forward(x, positions, kv_cache, meta) * self.residual_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_class = GraniteAttention

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * self.self_attn.residual_multiplier


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, cfg: GraniteConfig, rotary, tp: TPContext):
        super().__init__(cfg, rotary, tp)
        self.embedding_multiplier = cfg.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    config_class = GraniteConfig
    model_class = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
