"""Mixtral: Mistral's attention with a mixture-of-experts MLP (``layers/moe.py``) in every layer.

Router: softmax over the router logits, top ``num_experts_per_tok`` (2),
renormalized, as ``transformers`` does. Experts are tensor-parallel inside each
expert (see ``layers/moe.py``). ``sliding_window`` is handled like Mistral's in
``llama.py``: the context is capped at the window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..layers.attention import AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import TPContext
from ..layers.moe import FusedMoE, expert_params_mapping
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .llama import LlamaAttention, LlamaConfig, LlamaForCausalLM
from .loading import load_checkpoint, materialize


@dataclass
class MixtralConfig(LlamaConfig):
    num_experts: int = 8
    num_experts_per_tok: int = 2

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> MixtralConfig:
        base = super().from_dict(cfg, architecture)
        return replace(base, num_experts=int(cfg.get("num_local_experts", 8)),
                       num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)))


class MixtralDecoderLayer(nn.Module):
    def __init__(self, cfg: MixtralConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        # Named like the checkpoint's container so router and expert names line up.
        self.block_sparse_moe = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                         cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.block_sparse_moe(x), residual


class MixtralModel(nn.Module):
    def __init__(self, cfg: MixtralConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([MixtralDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, None if kv_caches is None else kv_caches[i], meta)
        x, _ = self.norm(x, residual)
        return x


class MixtralForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface (forward, compute_logits, attributes) over a Mixtral body."""

    config_class = MixtralConfig

    def __init__(self, cfg: MixtralConfig, tp: TPContext, dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # Llama's constructor builds a Llama body; this one builds Mixtral's
        self.config = cfg
        self.tp = tp
        self.packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping,
                                       **expert_params_mapping(cfg.num_experts)}
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 dtype=dtype, device=device)
        with torch.device("meta"):
            self.model = MixtralModel(cfg, rotary, tp)
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
