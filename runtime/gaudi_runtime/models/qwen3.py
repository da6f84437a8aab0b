"""Qwen3 (dense): Llama's layout with an RMSNorm over each head of q and of k, before the rotary embedding.

* ``q_norm`` / ``k_norm`` are one ``head_dim`` weight each, shared by all heads (replicated on
  every rank, so they work the same on a rank's slice of the heads).
* ``head_dim`` comes from the config (Qwen3-8B: 128, which is hidden / heads; smaller Qwen3s are not).
* ``attention_bias`` puts biases on q, k, v and o alike (Qwen2 had them on q/k/v only).
* ``sliding_window`` counts only with ``use_sliding_window``, as for Qwen2; the LM head is tied to
  the embeddings as ``tie_word_embeddings`` says (the small Qwen3s tie it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..layers.attention import AttentionMetadata
from ..layers.linear import TPContext
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(kw_only=True)
class Qwen3Config(LlamaConfig):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Qwen3Config:
        base = super().from_dict(cfg, architecture)
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return replace(base, qkv_bias=bias, o_bias=bias, sliding_window=window)


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: Qwen3Config, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__(cfg, rotary, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata):
        q, k, v = self.attn.split_heads(self.qkv_proj(x))
        q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    config_class = Qwen3Config
    model_class = Qwen3Model
