"""Gemma (v1): Llama's layout with Gemma's numerics.

* RMSNorm scales by ``1 + weight``, computed in float32 before the cast back
  (Llama casts first, then scales).
* Embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model
  dtype, as ``transformers`` does.
* GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``; the ``gelu`` of the
  original configs means the tanh approximation.
* ``head_dim`` comes from the config (Gemma-7B: 16 heads of 256 with a hidden
  size of 3072); the LM head is tied to the embeddings unless the config says not.

Gemma 2 is not served: logit soft-capping, alternating sliding-window layers
and extra norms make it a different model, not a configuration of this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .llama import LlamaAttention, LlamaConfig, LlamaForCausalLM
from .loading import load_checkpoint, materialize

# Activation names that mean GELU with the tanh approximation in Gemma configs.
GELU_TANH = ("gelu", "gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


@dataclass
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


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.mlp = GemmaMLP(cfg, tp)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: GemmaConfig, rotary: RotaryEmbedding, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([GemmaDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_hidden_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Rounded to the model dtype first (bf16: sqrt(3072) -> 55.5), as transformers does.
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device="cpu"))

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        x = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, None if kv_caches is None else kv_caches[i], meta)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface (forward, compute_logits, attributes) over a Gemma body."""

    config_class = GemmaConfig

    def __init__(self, cfg: GemmaConfig, tp: TPContext, dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # Llama's constructor builds a Llama body; this one builds Gemma's
        self.config = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 dtype=dtype, device=device)
        with torch.device("meta"):
            self.model = GemmaModel(cfg, rotary, tp, dtype)
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
        self.max_position_embeddings = cfg.max_position_embeddings
        self.dtype = dtype
        self.device = torch.device(device)

    def load_weights(self, weights) -> None:
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        load_checkpoint(self, weights, self.packed_modules_mapping, skip)
