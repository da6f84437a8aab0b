"""Qwen3-MoE: Qwen3's attention with many small experts (Qwen3-30B-A3B: 128 of 768, 8 per token).

* Router: softmax over all experts, the top ``num_experts_per_tok``; renormalized to sum to 1 only
  with ``norm_topk_prob`` (``layers/moe.route``).
* Experts ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` of ``moe_intermediate_size`` are
  stacked in ``layers/moe.FusedMoE`` (tensor-parallel inside each expert).
* A layer is sparse unless ``mlp_only_layers`` lists it or ``(index + 1) % decoder_sparse_step``
  is not 0; a dense layer has Qwen3's MLP of ``intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..layers.linear import TPContext
from ..layers.moe import FusedMoE, expert_params_mapping
from ..layers.rotary import RotaryEmbedding
from .llama import LlamaForCausalLM
from .qwen3 import Qwen3Config, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


@dataclass(kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per decoder layer: experts (True) or the dense MLP

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Qwen3MoeConfig:
        base = Qwen3Config.from_dict(cfg, architecture)
        # Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts.
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step {step} must be at least 1")
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                       for i in range(base.num_hidden_layers))
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(**fields, num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
                   moe_intermediate_size=int(cfg.get("moe_intermediate_size", cfg["intermediate_size"])),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, cfg: Qwen3MoeConfig, tp: TPContext) -> None:
        # Named like the checkpoint's container (mlp.gate, mlp.experts.{e}.*).
        self.mlp = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                            tp, renormalize=cfg.norm_topk_prob)


class Qwen3MoeModel(Qwen3Model):
    def build_layer(self, cfg: Qwen3MoeConfig, rotary: RotaryEmbedding, tp: TPContext, index: int) -> nn.Module:
        layer = Qwen3MoeDecoderLayer if cfg.sparse_layers[index] else Qwen3DecoderLayer
        return layer(cfg, rotary, tp)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = Qwen3MoeConfig
    model_class = Qwen3MoeModel

    @property
    def packed_modules_mapping(self) -> dict[str, tuple[str, object]]:  # type: ignore[override]
        # Experts first: their names hold gate_proj / up_proj too, which the dense layers fuse.
        experts = expert_params_mapping(self.config.num_experts, "gate_proj", "up_proj", "down_proj")
        return {**experts, **LlamaForCausalLM.packed_modules_mapping}
