"""Starcoder2: GQA attention with RoPE and biases, LayerNorm (with bias), and a GELU-tanh MLP.

* ``use_bias`` puts biases on q/k/v/o and on the MLP's ``c_fc``/``c_proj``.
* ``sliding_window`` (4096 in the released models) is handled like Mistral's
  in ``llama.py``: the context is capped at the window, so every sequence the
  runtime serves sees exactly what full attention would give.
* The LM head is tied to the embeddings unless the config says not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import LayerNorm
from ..layers.rotary import RotaryEmbedding
from .gemma import GELU_TANH
from .llama import LlamaAttention, LlamaConfig, LlamaForCausalLM
from .loading import load_checkpoint, materialize


@dataclass
class Starcoder2Config(LlamaConfig):
    norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Starcoder2Config:
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in GELU_TANH:
            raise ValueError(f"unsupported hidden_act {act!r} for Starcoder2 (supported: {', '.join(GELU_TANH)})")
        use_bias = bool(cfg.get("use_bias", True))
        # Llama's parser reads the shared fields; Starcoder2's own ones are set below.
        llama_view = {**cfg, "hidden_act": "silu", "attention_bias": use_bias, "mlp_bias": use_bias,
                      "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        base = super().from_dict(llama_view, architecture)
        base.norm_eps = float(cfg.get("norm_epsilon", 1e-5))
        return base


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: Starcoder2Config, tp: TPContext):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, tp=tp)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, cfg: Starcoder2Config, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.mlp = Starcoder2MLP(cfg, tp)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Starcoder2Model(nn.Module):
    def __init__(self, cfg: Starcoder2Config, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([Starcoder2DecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_hidden_layers)])
        self.norm = LayerNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, None if kv_caches is None else kv_caches[i], meta)
        return self.norm(x)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface (forward, compute_logits, attributes) over a Starcoder2 body."""

    config_class = Starcoder2Config

    def __init__(self, cfg: Starcoder2Config, tp: TPContext, dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # Llama's constructor builds a Llama body; this one builds Starcoder2's
        self.config = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 dtype=dtype, device=device)
        with torch.device("meta"):
            self.model = Starcoder2Model(cfg, rotary, tp)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary
        materialize(self, dtype, device)
        attn0 = self.model.layers[0].self_attn
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = attn0.num_heads
        self.num_kv_heads = attn0.num_kv_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids)
        max_pos = cfg.max_position_embeddings
        self.max_position_embeddings = min(max_pos, int(cfg.sliding_window)) if cfg.sliding_window else max_pos
        self.dtype = dtype
        self.device = torch.device(device)

    def load_weights(self, weights) -> None:
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        load_checkpoint(self, weights, self.packed_modules_mapping, skip)
