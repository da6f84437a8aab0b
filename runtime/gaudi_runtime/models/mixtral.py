"""Mixtral: Mistral's attention with a mixture-of-experts MLP (``layers/moe.py``) in every layer.

Router: softmax over the router logits, top ``num_experts_per_tok`` (2),
renormalized, as ``transformers`` does. Experts are tensor-parallel inside each
expert (see ``layers/moe.py``). ``sliding_window`` caps the context, as Mistral's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..layers.linear import TPContext
from ..layers.moe import FusedMoE, expert_params_mapping
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(kw_only=True)
class MixtralConfig(LlamaConfig):
    num_experts: int = 8
    num_experts_per_tok: int = 2

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> MixtralConfig:
        base = super().from_dict(cfg, architecture)
        return replace(base, num_experts=int(cfg.get("num_local_experts", 8)),
                       num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg: MixtralConfig, tp: TPContext) -> None:
        # Named like the checkpoint's container so router and expert names line up.
        self.block_sparse_moe = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                         cfg.intermediate_size, tp)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    config_class = MixtralConfig
    model_class = MixtralModel

    @property
    def packed_modules_mapping(self) -> dict[str, tuple[str, object]]:  # type: ignore[override]
        return {**LlamaForCausalLM.packed_modules_mapping, **expert_params_mapping(self.config.num_experts)}
