"""Falcon (transformers' ``FalconForCausalLM``) with rotary positions, in its two decoder layouts.

* New decoder architecture (Falcon-40B/180B): grouped key/value heads
  (``num_kv_heads``), the fused ``query_key_value`` stored group by group, and
  attention and MLP side by side on ``ln_attn``/``ln_mlp`` (or on one
  ``input_layernorm`` when ``num_ln_in_parallel_attn`` is 1).
* The older layout (Falcon-7B): ``multi_query`` (one key/value head, stored
  after all query heads; without it q/k/v are stored per head), and with
  ``parallel_attn`` attention and MLP both read ``input_layernorm``'s output;
  otherwise they run one after the other (``post_attention_layernorm``).

ALiBi Falcons (``alibi: true``, e.g. Falcon-RW) are refused at start: the paged
attention here has no position-bias term.

With attention and MLP in parallel, both row-parallel outputs are summed
before the one all-reduce, so a layer costs one collective instead of two.
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
from ..layers.rotary import RotaryEmbedding, rope_params_from_config
from .base import CausalLMBase, ModelConfig, rotary_embedding

# Older Falcon configs use GPT-2's names for these fields.
FALCON_NAMES = {"hidden_size": ("hidden_size", "n_embed"), "num_attention_heads": ("num_attention_heads", "n_head"),
                "num_hidden_layers": ("num_hidden_layers", "n_layer")}


@dataclass(kw_only=True)
class FalconConfig(ModelConfig):
    ffn_hidden_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    bias: bool
    new_decoder_architecture: bool
    parallel_attn: bool
    num_ln_in_parallel_attn: int
    activation: str

    @property
    def qkv_layout(self) -> str:
        # Old-layout multi-query checkpoints put k and v after every query head; the others store group by group.
        return "multi_query" if not self.new_decoder_architecture and self.num_kv_heads == 1 else "grouped"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> FalconConfig:
        if cfg.get("alibi", False):
            raise ValueError("Falcon with alibi: true (ALiBi position biases, as in Falcon-RW) is not supported; "
                             "only rotary Falcon models (alibi: false) are")
        activation = cfg.get("activation", "gelu")
        get_activation(activation, "Falcon activation")  # fail at start on a name we do not implement
        shared = cls.shared_fields(cfg, architecture, FALCON_NAMES, tied=True)
        heads = shared["num_attention_heads"]
        new_arch = bool(cfg.get("new_decoder_architecture", False))
        parallel_attn = bool(cfg.get("parallel_attn", True))
        if new_arch:
            if not parallel_attn:
                raise ValueError("Falcon new_decoder_architecture needs parallel_attn: true (as transformers does)")
            kv_heads = cfg.get("num_kv_heads", cfg.get("n_head_kv")) or heads
        else:
            kv_heads = 1 if cfg.get("multi_query", True) else heads
        theta, scaling = rope_params_from_config(cfg)
        return cls(
            **shared,
            ffn_hidden_size=cfg.get("ffn_hidden_size") or 4 * shared["hidden_size"],
            num_kv_heads=kv_heads,
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            bias=bool(cfg.get("bias", False)),
            new_decoder_architecture=new_arch,
            parallel_attn=parallel_attn,
            num_ln_in_parallel_attn=int(cfg.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)),
            activation=activation,
        )


def row_partial(layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """This rank's share of a row-parallel product (bias on rank 0), before the all-reduce."""
    return layer.matmul(x, layer.bias if layer.tp.rank == 0 else None)


class FalconAttention(nn.Module):
    def __init__(self, cfg: FalconConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.query_key_value = FusedQKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                                      cfg.num_kv_heads, cfg.qkv_layout, bias=cfg.bias, tp=tp)
        self.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias, tp=tp)
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.query_key_value.num_heads, self.query_key_value.num_kv_heads, cfg.head_dim)

    def context(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output before ``dense``: ``[B, S, heads_per_rank * head_dim]``."""
        q, k, v = self.attn.split_heads(self.query_key_value(x))
        q, k = self.rotary(positions, q, k)
        return self.attn(q, k, v, kv_cache, meta)


class FalconMLP(nn.Module):
    def __init__(self, cfg: FalconConfig, tp: TPContext):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias, tp=tp)
        self.dense_4h_to_h = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.bias, tp=tp)
        self.act = get_activation(cfg.activation)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activated up-projection, before ``dense_4h_to_h``."""
        return self.act(self.dense_h_to_4h(x))


class FalconDecoderLayer(nn.Module):
    def __init__(self, cfg: FalconConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.self_attention = FalconAttention(cfg, rotary, tp)
        self.mlp = FalconMLP(cfg, tp)
        self.parallel = cfg.new_decoder_architecture or cfg.parallel_attn
        self.two_norms = cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2
        eps = cfg.norm_eps
        if self.two_norms:
            self.ln_attn = LayerNorm(cfg.hidden_size, eps)
            self.ln_mlp = LayerNorm(cfg.hidden_size, eps)
        else:
            self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
            if not self.parallel:
                self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)

    def forward(self, x, positions, kv_cache, meta):
        if not self.parallel:
            ctx = self.self_attention.context(self.input_layernorm(x), positions, kv_cache, meta)
            x = x + self.self_attention.dense(ctx)
            return x + self.mlp.dense_4h_to_h(self.mlp.hidden(self.post_attention_layernorm(x)))
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        ctx = self.self_attention.context(attn_in, positions, kv_cache, meta)
        out = row_partial(self.mlp.dense_4h_to_h, self.mlp.hidden(mlp_in)) \
            + row_partial(self.self_attention.dense, ctx)
        return x + self.tp.all_reduce(out)


class FalconModel(nn.Module):
    def __init__(self, cfg: FalconConfig, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.h = nn.ModuleList([FalconDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_hidden_layers)])
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, inputs_embeds=None):
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for i, layer in enumerate(self.h):
            x = layer(x, positions, None if kv_caches is None else kv_caches[i], meta)
        return self.ln_f(x)


class FalconForCausalLM(CausalLMBase):
    config_class = FalconConfig
    decoder = "transformer"

    def build(self, cfg: FalconConfig, tp: TPContext) -> None:
        self.transformer = FalconModel(cfg, rotary_embedding(cfg, self.dtype, self.device), tp)
