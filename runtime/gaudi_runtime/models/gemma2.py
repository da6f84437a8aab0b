"""Gemma 2: Gemma's numerics (``1 + weight`` norms, scaled embeddings, GeGLU, tied head) with

* local and global layers: a layer of type ``sliding_attention`` (``layer_types``; by default every
  other layer, the first one local) attends over a window of ``sliding_window`` positions, the others
  over the whole sequence. The window is real windowed attention (``layers/attention_window.py``), so
  the context is the model's full ``max_position_embeddings``, not the window;
* attention logits soft-capped (``attn_logit_softcapping``: ``c * tanh(score / c)``) and the LM head's
  logits too (``final_logit_softcapping``);
* a norm after attention and a pair around the MLP (``pre_/post_feedforward_layernorm``), each added
  to the residual stream after its output is normed;
* attention scaled by ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..layers.attention import Attention, AttentionMetadata
from ..layers.linear import QKVParallelLinear, RowParallelLinear, TPContext
from ..layers.rotary import RotaryEmbedding
from .base import rotary_embedding
from .gemma import GemmaConfig, GemmaForCausalLM, GemmaMLP, GemmaModel, GemmaRMSNorm

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(kw_only=True)
class Gemma2Config(GemmaConfig):
    query_pre_attn_scalar: float = 256.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it attends over the window only

    # transformers' defaults for fields a config.json leaves out
    DEFAULTS: ClassVar[dict[str, Any]] = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                          "sliding_window": 4096, "query_pre_attn_scalar": 256}
    LOCAL_EVERY: ClassVar[int] = 2  # without layer_types: each LOCAL_EVERY-th layer is global, the others local

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Gemma2Config:
        cfg = {**{k: v for k, v in cls.DEFAULTS.items() if k not in cfg}, **cfg}
        base = super().from_dict(cfg, architecture)
        n = base.num_hidden_layers
        types = cfg.get("layer_types") or [
            SLIDING if (i + 1) % int(cfg.get("sliding_window_pattern", cls.LOCAL_EVERY)) else FULL for i in range(n)]
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ValueError(f"config.json layer_types must be {n} entries of {SLIDING!r} or {FULL!r}, got {types}")
        sliding = tuple(t == SLIDING and bool(base.sliding_window) for t in types)  # no window: full attention
        return dataclasses.replace(
            base, query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            attn_softcap=cfg.get("attn_logit_softcapping") or None,
            final_softcap=cfg.get("final_logit_softcapping") or None, sliding_layers=sliding)

    @property
    def context_length(self) -> int:
        """The local layers attend over their window (never a cap on the sequence)."""
        return self.max_position_embeddings


class Gemma2Attention(nn.Module):
    qk_norm = False  # Gemma 3 norms each head's query and key before the rotation

    def __init__(self, cfg: Gemma2Config, rotary: RotaryEmbedding, tp: TPContext, sliding: bool):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_kv_heads, bias=cfg.qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias, tp=tp)
        self.rotary = rotary  # shared by the layers of one kind (local or global)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim,
                              scale=cfg.query_pre_attn_scalar ** -0.5, window=cfg.sliding_window if sliding else None,
                              softcap=cfg.attn_softcap)
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata):
        q, k, v = self.attn.split_heads(self.qkv_proj(x))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Gemma2DecoderLayer(nn.Module):
    """Norms before and after attention and the MLP; the residual stream is added inside the next
    pre-norm (as Llama's layers do), the post-norms' outputs are what is added."""

    norm_class = GemmaRMSNorm
    attention_class = Gemma2Attention

    def __init__(self, cfg: Gemma2Config, rotary: RotaryEmbedding, tp: TPContext, sliding: bool):
        super().__init__()
        self.self_attn = self.attention_class(cfg, rotary, tp, sliding)
        self.mlp = GemmaMLP(cfg, tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, self.norm_class(cfg.hidden_size, cfg.norm_eps))

    def forward(self, x, residual, positions, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(GemmaModel):
    """`rotary`: (global layers' RoPE, local layers'): the same tables in Gemma 2, two bases in Gemma 3."""

    layer_class = Gemma2DecoderLayer

    def build_layer(self, cfg: Gemma2Config, rotary, tp: TPContext, index: int) -> nn.Module:
        sliding = cfg.sliding_layers[index]
        return self.layer_class(cfg, rotary[1] if sliding else rotary[0], tp, sliding)


class Gemma2ForCausalLM(GemmaForCausalLM):
    config_class = Gemma2Config
    model_class = Gemma2Model

    def rotaries(self, cfg: Gemma2Config) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """The global layers' RoPE and the local layers'."""
        rotary = rotary_embedding(cfg, self.dtype, self.device)
        return rotary, rotary

    def build(self, cfg: Gemma2Config, tp: TPContext) -> None:
        self.model = self.model_class(cfg, self.rotaries(cfg), tp, self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
