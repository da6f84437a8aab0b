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

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..layers.activation import get_activation
from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.fused_qkv import FusedQKVParallelLinear
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import LayerNorm
from ..layers.position import PositionEmbedding
from .loading import load_checkpoint, materialize

# Buffers some GPTBigCode checkpoints carry (the causal mask); nothing to load.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


@dataclass
class GPTBigCodeConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position_embeddings: int
    scale_attn_weights: bool
    activation: str
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> GPTBigCodeConfig:
        if cfg.get("add_cross_attention", False):
            raise ValueError("GPTBigCode with add_cross_attention: true (an encoder-decoder) is not supported")
        activation = cfg.get("activation_function", "gelu_pytorch_tanh")
        get_activation(activation, "GPTBigCode activation_function")  # fail at start on a name we lack
        hidden = cfg.get("n_embd", cfg.get("hidden_size"))
        heads = cfg.get("n_head", cfg.get("num_attention_heads"))
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("n_inner") or 4 * hidden,
            num_hidden_layers=cfg.get("n_layer", cfg.get("num_hidden_layers")),
            num_attention_heads=heads,
            num_kv_heads=1 if cfg.get("multi_query", True) else heads,
            head_dim=hidden // heads,
            layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            max_position_embeddings=int(cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))),
            scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
            activation=activation,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )


class GPTBigCodeAttention(nn.Module):
    def __init__(self, cfg: GPTBigCodeConfig, tp: TPContext):
        super().__init__()
        layout = "multi_query" if cfg.num_kv_heads == 1 else "grouped"
        self.c_attn = FusedQKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                             cfg.num_kv_heads, layout, bias=True, tp=tp)
        self.c_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, tp=tp)
        self.num_heads = self.c_attn.num_heads
        self.num_kv_heads = self.c_attn.num_kv_heads
        self.head_dim = cfg.head_dim
        scale = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=scale)

    def forward(self, x: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        b, s, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.c_attn(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
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
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = GPTBigCodeAttention(cfg, tp)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
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
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        x = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            x = block(x, None if kv_caches is None else kv_caches[i], meta)
        return self.ln_f(x)


class GPTBigCodeForCausalLM(nn.Module):
    """The ``CausalLM`` interface (see ``llama.LlamaForCausalLM``) over a GPTBigCode body named as in checkpoints."""

    config_class = GPTBigCodeConfig

    def __init__(self, cfg: GPTBigCodeConfig, tp: TPContext, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        self.tp = tp
        with torch.device("meta"):
            self.transformer = GPTBigCodeModel(cfg, tp)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.transformer.wte.weight
        materialize(self, dtype, device)
        attn0 = self.transformer.h[0].attn
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = attn0.num_heads
        self.num_kv_heads = attn0.num_kv_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.max_position_embeddings = cfg.max_position_embeddings  # the wpe table ends there
        self.dtype = dtype
        self.device = torch.device(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        return self.transformer(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights) -> None:
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return name.endswith(_MASK_BUFFERS) or name == "transformer.bias" or (tied and name == "lm_head.weight")

        load_checkpoint(self, weights, {}, skip)
