"""Llama-family causal LM: Llama 2/3/3.1 (llama3 RoPE), CodeLlama, Mistral, Qwen2.

Differences between the families are configuration only:

* Qwen2 has biases on q/k/v (not on o_proj); Llama's ``attention_bias`` puts
  biases on q/k/v/o and ``mlp_bias`` on the MLP.
* Mistral's ``sliding_window`` (and Qwen2's when ``use_sliding_window``) caps
  the context (``base.ModelConfig.context_length``), so results stay exact.
* ``tie_word_embeddings``: the LM head shares the embedding parameter.

Gemma, Mixtral, Starcoder2, Phi-3, Granite and Llava's language model reuse these
modules; the decoder layer and stack take their attention, MLP and norm from
overridable hooks, and the attention its q/k/v projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPContext
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_params_from_config
from .base import CausalLMBase, ModelConfig, rotary_embedding


@dataclass(kw_only=True)
class LlamaConfig(ModelConfig):
    model_type: str
    intermediate_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> LlamaConfig:
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        shared = cls.shared_fields(cfg, architecture)
        model_type = cfg.get("model_type", "")
        is_qwen2 = architecture == "Qwen2ForCausalLM" or model_type == "qwen2"
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            shared["sliding_window"] = None  # declared, but only used with use_sliding_window
        attention_bias = bool(cfg.get("attention_bias", False))
        theta, scaling = rope_params_from_config(cfg)
        return cls(
            **shared,
            model_type=model_type,
            intermediate_size=cfg["intermediate_size"],
            num_kv_heads=cfg.get("num_key_value_heads") or shared["num_attention_heads"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.qkv_proj = self.build_qkv(cfg, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias, tp=tp)
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim)

    def build_qkv(self, cfg: LlamaConfig, tp: TPContext) -> QKVParallelLinear:
        """The fused q/k/v projection, loaded from the checkpoint's q_proj, k_proj and v_proj."""
        return QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads,
                                 bias=cfg.qkv_bias, tp=tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata):
        q, k, v = self.attn.split_heads(self.qkv_proj(x))
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
    """Pre-norm block; the residual stream is added inside the next norm (one add per norm)."""

    norm_class: ClassVar[type[nn.Module]] = RMSNorm
    mlp_class: ClassVar[type[nn.Module]] = LlamaMLP
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.self_attn = self.attention_class(cfg, rotary, tp)
        self.build_mlp(cfg, tp)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.norm_eps)

    def build_mlp(self, cfg: LlamaConfig, tp: TPContext) -> None:
        """The feed-forward module, under its checkpoint name."""
        self.mlp = self.mlp_class(cfg, tp)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def forward(self, x, residual, positions, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual


class LlamaModel(nn.Module):
    layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([self.build_layer(cfg, rotary, tp, i) for i in range(cfg.num_hidden_layers)])
        self.norm = self.layer_class.norm_class(cfg.hidden_size, cfg.norm_eps)

    def build_layer(self, cfg: LlamaConfig, rotary: RotaryEmbedding, tp: TPContext, index: int) -> nn.Module:
        """Decoder layer `index` (a family whose layers differ by index, as Gemma 2's local and global ones,
        builds its own)."""
        return self.layer_class(cfg, rotary, tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        # inputs_embeds: a multimodal model's prompt (token embeddings with image features merged in).
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, None if kv_caches is None else kv_caches[i], meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLMBase):
    config_class = LlamaConfig
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    model_class: ClassVar[type[nn.Module]] = LlamaModel

    def build(self, cfg: LlamaConfig, tp: TPContext) -> None:
        self.model = self.model_class(cfg, rotary_embedding(cfg, self.dtype, self.device), tp)
