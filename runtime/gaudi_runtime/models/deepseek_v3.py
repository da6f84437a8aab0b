"""DeepSeek-V3 / R1: multi-head latent attention (``layers/mla.py``) and a mixture of experts with shared
experts and grouped top-k routing (``layers/moe.GroupedFusedMoE``), after ``first_k_dense_replace`` dense
layers.

A layer is a mixture of experts when its index is at least ``first_k_dense_replace`` and a multiple of
``moe_layer_freq`` (DeepSeek's own rule; every published V3/R1 config has frequency 1, where it equals
transformers'). The shared experts are one dense MLP of ``moe_intermediate_size * n_shared_experts``
added to the routed output. YaRN rope over the ``qk_rope_head_dim`` part, with the softmax scale
corrected by ``mscale_all_dim`` (``layers/rotary.yarn_softmax_scale``). Checkpoint tensors of the
multi-token-prediction layers past ``num_hidden_layers`` are not used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..layers.embedding import VocabParallelEmbedding
from ..layers.linear import TPContext
from ..layers.mla import MLAShape, MLAttention
from ..layers.moe import GroupedFusedMoE, expert_params_mapping
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, yarn_softmax_scale
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


@dataclass(kw_only=True)
class DeepseekV3Config(LlamaConfig):
    mla: MLAShape
    moe_intermediate_size: int
    n_routed_experts: int | None
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> DeepseekV3Config:
        cfg = {k: v for k, v in cfg.items() if k != "head_dim"}  # transformers writes the rope dim there
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"unsupported scoring_func {scoring!r} (DeepSeek-V3 routing is sigmoid)")
        base = LlamaConfig.from_dict(cfg, architecture)
        mla = MLAShape(
            hidden_size=base.hidden_size, num_heads=base.num_attention_heads, q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
            norm_eps=base.norm_eps, attention_bias=bool(cfg.get("attention_bias", False)),
            rope_interleave=bool(cfg.get("rope_interleave", True)))
        return cls(
            **{**vars(base), "head_dim": mla.qk_head_dim, "num_kv_heads": 1}, mla=mla,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", base.intermediate_size)),
            n_routed_experts=cfg.get("n_routed_experts"), num_experts_per_tok=int(cfg.get("num_experts_per_tok", 1)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(cfg.get("moe_layer_freq", 1)), n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


class DeepseekV3MoE(GroupedFusedMoE):
    """Routed experts plus the shared experts (checkpoint names ``gate``, ``experts``, ``shared_experts``)."""

    def __init__(self, cfg: DeepseekV3Config, tp: TPContext):
        super().__init__(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         tp, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = LlamaMLP(replace(cfg, intermediate_size=cfg.moe_intermediate_size
                                                   * cfg.n_shared_experts, mlp_bias=False), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is added inside the next norm (as Llama's)."""

    def __init__(self, cfg: DeepseekV3Config, index: int, rotary: RotaryEmbedding, scale: float, tp: TPContext):
        super().__init__()
        self.self_attn = MLAttention(cfg.mla, rotary, scale, tp)
        self.mlp = DeepseekV3MoE(cfg, tp) if cfg.is_moe_layer(index) else LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    # Llama's pre-norm block over these modules (the residual added inside the next norm).
    feed_forward = LlamaDecoderLayer.feed_forward
    forward = LlamaDecoderLayer.forward


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, rotary: RotaryEmbedding, tp: TPContext):
        super().__init__()
        scale = yarn_softmax_scale(cfg.mla.qk_head_dim ** -0.5, cfg.rope_scaling, cfg.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([DeepseekV3DecoderLayer(cfg, i, rotary, scale, tp)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    # Llama's stack over these modules.
    embed = LlamaModel.embed
    forward = LlamaModel.forward


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    config_class = DeepseekV3Config
    attention_class = MLAttention
    attention_name = "multi-head latent attention (torch; decode: absorbed, over the cached latent)"

    def build(self, cfg: DeepseekV3Config, tp: TPContext) -> None:
        with torch.device("cpu"):  # host tables even while building on meta (see base.rotary_embedding)
            rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                     cfg.rope_scaling, dtype=self.dtype, device=self.device)
        self.model = DeepseekV3Model(cfg, rotary, tp)

    @property
    def packed_modules_mapping(self) -> dict[str, tuple[str, object]]:  # type: ignore[override]
        # Experts first: their names also contain the dense MLP's gate_proj / up_proj.
        experts = expert_params_mapping(self.config.n_routed_experts or 0, "gate_proj", "up_proj", "down_proj")
        return {**experts, "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def unused_weight(self, name: str) -> bool:
        parts = name.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_hidden_layers:
            return True  # the multi-token-prediction layer(s) DeepSeek ships after the last decoder layer
        return super().unused_weight(name)
