"""Llama-family causal LM: Llama 2/3/3.1 (llama3 RoPE), CodeLlama, Mistral, Qwen2.

Differences between the families are configuration only:

* Qwen2 has biases on q/k/v (not on o_proj); Llama's ``attention_bias`` puts
  biases on q/k/v/o and ``mlp_bias`` on the MLP.
* Mistral's ``sliding_window`` (and Qwen2's when ``use_sliding_window``) is
  not implemented as windowed attention; instead ``max_position_embeddings``
  is capped at the window so the runtime never serves a sequence where the
  window would matter (results stay exact).
* ``tie_word_embeddings``: the LM head shares the embedding parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_params_from_config
from .loading import load_checkpoint, materialize


@dataclass
class LlamaConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> LlamaConfig:
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        model_type = cfg.get("model_type", "")
        is_qwen2 = architecture == "Qwen2ForCausalLM" or model_type == "qwen2"
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding_window = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            sliding_window = None
        theta, scaling = rope_params_from_config(cfg)
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding_window,
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias, tp=tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata):
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TPContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       bias=cfg.mlp_bias, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.mlp = LlamaMLP(cfg, tp)
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
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        # inputs_embeds: a multimodal model's prompt (token embeddings with image features merged in).
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, None if kv_caches is None else kv_caches[i], meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """The ``CausalLM`` interface the shard drives.

    Attributes: ``num_layers``, ``num_kv_heads`` (per rank), ``head_dim``,
    ``vocab_size`` (true vocab), ``eos_token_ids``, ``max_position_embeddings``.
    """

    config_class = LlamaConfig
    # checkpoint name fragment -> (parameter name fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: LlamaConfig, tp: TPContext, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        self.tp = tp
        max_pos = cfg.max_position_embeddings
        if cfg.sliding_window:
            max_pos = min(max_pos, int(cfg.sliding_window))
        # Rotary table is built for the config's full range (it is also what llama3/dynamic formulas use).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 dtype=dtype, device=device)
        with torch.device("meta"):
            self.model = LlamaModel(cfg, rotary, tp)
            if cfg.tie_word_embeddings:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
                self.lm_head.weight = self.model.embed_tokens.weight
            else:
                self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
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
        self.max_position_embeddings = max_pos
        self.dtype = dtype
        self.device = torch.device(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None):
        """``input_ids``/``positions`` ``[B, S]`` -> final-normed hidden states ``[B, S, hidden]``."""
        if inputs_embeds is None:  # the families built on this class whose models take no embeddings
            return self.model(input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 ``[N, vocab_size]`` (gathered over ranks, padding dropped)."""
        return self.lm_head(hidden)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Load from an iterable of ``(name, tensor)`` (full checkpoint tensors; each layer slices its part)."""
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        load_checkpoint(self, weights, self.packed_modules_mapping, skip)
