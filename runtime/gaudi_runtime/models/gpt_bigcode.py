"""GPTBigCode (Starcoder, SantaCoder): transformers' ``GPTBigCodeForCausalLM``.

* Multi-query attention: one key/value head, replicated on every rank; the
  fused ``c_attn`` holds q (hidden), k (head_dim), v (head_dim). Without
  ``multi_query`` it holds q, k, v per head.
* Learned absolute positions ``wpe`` (``n_positions`` entries, which is also the
  context the model serves); no rotary.
* Pre-norm blocks with LayerNorm, biases everywhere, a GELU MLP (``c_fc``,
  ``c_proj``), and an LM head tied to ``wte`` unless the config says not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers.activation import get_activation
from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import VocabParallelEmbedding
from ..layers.fused_qkv import FusedQKVParallelLinear
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import LayerNorm
from ..layers.position import PositionEmbedding
from .base import CausalLMBase, ModelConfig

# Buffers some GPTBigCode checkpoints carry (the causal mask); nothing to load.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


# GPT-2's names, which GPTBigCode configs use (transformers' attribute_map), before the common ones.
GPT2_NAMES = {"hidden_size": ("n_embd", "hidden_size"), "num_attention_heads": ("n_head", "num_attention_heads"),
              "num_hidden_layers": ("n_layer", "num_hidden_layers"),
              "max_position_embeddings": ("n_positions", "max_position_embeddings")}


@dataclass(kw_only=True)
class GPTBigCodeConfig(ModelConfig):
    intermediate_size: int
    scale_attn_weights: bool
    activation: str

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> GPTBigCodeConfig:
        if cfg.get("add_cross_attention", False):
            raise ValueError("GPTBigCode with add_cross_attention: true (an encoder-decoder) is not supported")
        activation = cfg.get("activation_function", "gelu_pytorch_tanh")
        get_activation(activation, "GPTBigCode activation_function")  # fail at start on a name we lack
        # The wpe table ends at n_positions: positions past it have no embedding.
        shared = cls.shared_fields(cfg, architecture, GPT2_NAMES, max_positions=1024, tied=True)
        heads = shared["num_attention_heads"]
        return cls(
            **shared,
            intermediate_size=cfg.get("n_inner") or 4 * shared["hidden_size"],
            num_kv_heads=1 if cfg.get("multi_query", True) else heads,
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
            activation=activation,
        )


class GPTBigCodeAttention(nn.Module):
    def __init__(self, cfg: GPTBigCodeConfig, tp: TPContext):
        super().__init__()
        layout = "multi_query" if cfg.num_kv_heads == 1 else "grouped"
        self.c_attn = FusedQKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                             cfg.num_kv_heads, layout, bias=True, tp=tp)
        self.c_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, tp=tp)
        scale = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        self.attn = Attention(self.c_attn.num_heads, self.c_attn.num_kv_heads, cfg.head_dim, scale=scale)

    def forward(self, x: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.attn.split_heads(self.c_attn(x))
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPTBigCodeMLP(nn.Module):
    def __init__(self, cfg: GPTBigCodeConfig, tp: TPContext):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True, tp=tp)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, tp=tp)
        self.act = get_activation(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, cfg: GPTBigCodeConfig, tp: TPContext):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = GPTBigCodeAttention(cfg, tp)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GPTBigCodeMLP(cfg, tp)

    def forward(self, x, kv_cache, meta):
        x = self.attn(self.ln_1(x), kv_cache, meta) + x
        return x + self.mlp(self.ln_2(x))


class GPTBigCodeModel(nn.Module):
    def __init__(self, cfg: GPTBigCodeConfig, tp: TPContext):
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.wpe = PositionEmbedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList([GPTBigCodeBlock(cfg, tp) for _ in range(cfg.num_hidden_layers)])
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, inputs_embeds=None):
        x = (self.wte(input_ids) if inputs_embeds is None else inputs_embeds) + self.wpe(positions)
        for i, block in enumerate(self.h):
            x = block(x, None if kv_caches is None else kv_caches[i], meta)
        return self.ln_f(x)


class GPTBigCodeForCausalLM(CausalLMBase):
    config_class = GPTBigCodeConfig
    decoder = "transformer"

    def build(self, cfg: GPTBigCodeConfig, tp: TPContext) -> None:
        self.transformer = GPTBigCodeModel(cfg, tp)

    def unused_weight(self, name: str) -> bool:
        return name.endswith(_MASK_BUFFERS) or name == "transformer.bias"
