"""Gemma 3 (text; ``model_type`` gemma3_text): Gemma 2's layers with

* each head's query and key normed (``q_norm``, ``k_norm``: Gemma's ``1 + weight`` RMSNorm over the
  head) before the rotation;
* five local layers to a global one by default (``layer_types``, or ``sliding_window_pattern`` 6);
* two RoPE tables: the local layers rotate with base ``rope_local_base_freq`` (10,000) and no
  scaling, the global ones with ``rope_theta`` (1,000,000 by default) and the config's scaling (the
  larger models' linear factor 8);
* no attention soft-capping: transformers' Gemma 3 ignores ``attn_logit_softcapping`` (the released
  configs leave it null), so it is ignored here too; the final logits are capped where the config says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..layers.rotary import RotaryEmbedding
from .gemma2 import SLIDING, Gemma2Attention, Gemma2Config, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model


@dataclass(kw_only=True)
class Gemma3Config(Gemma2Config):
    local_rope_theta: float = 10000.0

    DEFAULTS: ClassVar[dict[str, Any]] = {"attn_logit_softcapping": None, "final_logit_softcapping": None,
                                          "sliding_window": 4096, "query_pre_attn_scalar": 256}
    LOCAL_EVERY: ClassVar[int] = 6

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Gemma3Config:
        if "rope_theta" not in cfg and not isinstance(cfg.get("rope_parameters"), dict):
            cfg = {**cfg, "rope_theta": 1_000_000.0}  # transformers' global base for Gemma 3
        local = (cfg.get("rope_parameters") or {}).get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_parameters.{SLIDING}: only the default rope_type is served "
                             f"on local layers, got {local['rope_type']!r}")
        theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
        return dataclasses.replace(super().from_dict(cfg, architecture), local_rope_theta=float(theta),
                                   attn_softcap=None)


class Gemma3Attention(Gemma2Attention):
    qk_norm = True


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_class = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    config_class = Gemma3Config
    model_class = Gemma3Model

    def rotaries(self, cfg: Gemma3Config) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        global_rotary, _ = super().rotaries(cfg)
        local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
        return global_rotary, super().rotaries(local)[0]
