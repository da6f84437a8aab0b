"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (transformers' ``Phi3ForCausalLM``): Llama's layers with
Phi-3's checkpoint layout and RoPE.

* The checkpoint holds ``qkv_proj`` fused (every query head, then every key
  head, then every value head) and ``gate_up_proj`` fused (gate rows, then up
  rows); each rank cuts its heads and its gate and up rows out of those tensors
  (``layers/fused_qkv.py``'s ``stacked`` layout, ``MergedColumnParallelLinear``).
* LongRoPE (``rope_scaling`` type ``longrope``, or ``su``) with its short and long
  factor sets and attention factor (``layers/rotary.py`` says which set a row
  uses); ``original_max_position_embeddings`` is read from the top level first,
  with Phi-3's default of 4096, as transformers reads it.
* ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the leading part of each head.
* ``sliding_window``, where the config sets one, caps the context
  (``base.ModelConfig.context_length``): transformers masks by the window, and
  a sequence no longer than the window is attended in full, so results stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..layers.fused_qkv import FusedQKVParallelLinear
from ..layers.linear import TPContext
from .llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config's default for original_max_position_embeddings


@dataclass(kw_only=True)
class Phi3Config(LlamaConfig):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Phi3Config:
        view = {"original_max_position_embeddings": ORIGINAL_MAX_POSITIONS, **cfg}
        scaling = cfg.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
            view["rope_scaling"] = {**scaling, "rope_type": "longrope"}  # Phi3Config reads yarn as longrope
        parsed = super().from_dict(view, architecture)
        params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        partial = float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
        if not 0.0 < partial <= 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is outside (0, 1]")
        parsed.rotary_dim = int(parsed.head_dim * partial)
        return parsed


class Phi3Attention(LlamaAttention):
    def build_qkv(self, cfg: Phi3Config, tp: TPContext) -> FusedQKVParallelLinear:
        return FusedQKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads,
                                      "stacked", bias=cfg.qkv_bias, tp=tp)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention


class Phi3Model(LlamaModel):
    layer_class = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    config_class = Phi3Config
    model_class = Phi3Model
    packed_modules_mapping = {}  # qkv_proj and gate_up_proj come fused: loaded whole, cut per rank
