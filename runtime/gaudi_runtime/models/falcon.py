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
from ..layers.rotary import RotaryEmbedding, rope_params_from_config
from .loading import load_checkpoint, materialize


@dataclass
class FalconConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    bias: bool
    new_decoder_architecture: bool
    parallel_attn: bool
    num_ln_in_parallel_attn: int
    activation: str
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)

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
        hidden = cfg.get("hidden_size", cfg.get("n_embed"))
        heads = cfg.get("num_attention_heads", cfg.get("n_head"))
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
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            ffn_hidden_size=cfg.get("ffn_hidden_size") or 4 * hidden,
            num_hidden_layers=cfg.get("num_hidden_layers", cfg.get("n_layer")),
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hidden // heads,
            layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            bias=bool(cfg.get("bias", False)),
            new_decoder_architecture=new_arch,
            parallel_attn=parallel_attn,
            num_ln_in_parallel_attn=int(cfg.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)),
            activation=activation,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
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
        self.num_heads = self.query_key_value.num_heads
        self.num_kv_heads = self.query_key_value.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def context(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output before ``dense``: ``[B, S, heads_per_rank * head_dim]``."""
        b, s, _ = x.shape
        qkv = self.query_key_value(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
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
        eps = cfg.layer_norm_eps
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
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        x = self.word_embeddings(input_ids)
        for i, layer in enumerate(self.h):
            x = layer(x, positions, None if kv_caches is None else kv_caches[i], meta)
        return self.ln_f(x)


class FalconForCausalLM(nn.Module):
    """The ``CausalLM`` interface (see ``llama.LlamaForCausalLM``) over a Falcon body named as in checkpoints."""

    config_class = FalconConfig

    def __init__(self, cfg: FalconConfig, tp: TPContext, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 dtype=dtype, device=device)
        with torch.device("meta"):
            self.transformer = FalconModel(cfg, rotary, tp)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.transformer.word_embeddings.weight
        self.rotary = rotary
        materialize(self, dtype, device)
        attn0 = self.transformer.h[0].self_attention
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        return self.transformer(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights) -> None:
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        load_checkpoint(self, weights, {}, skip)
