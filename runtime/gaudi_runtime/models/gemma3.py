"""Gemma 3 (text; ``model_type`` gemma3_text): Gemma 2's layers with

* each head's query and key normed (``q_norm``, ``k_norm``: Gemma's ``1 + weight`` RMSNorm over the
  head) before the rotation;
* five local layers to a global one by default (``layer_types``, or ``sliding_window_pattern`` 6);
* two RoPE tables: the local layers rotate with base ``rope_local_base_freq`` (10,000) and no
  scaling, the global ones with ``rope_theta`` (1,000,000 by default) and the config's scaling (the
  larger models' linear factor 8);
* no attention soft-capping: transformers' Gemma 3 ignores ``attn_logit_softcapping`` (the released
  configs leave it null), so it is ignored here too; the final logits are capped where the config says.

``Gemma3ForConditionalGeneration`` checkpoints (the published 4B-27B models) are served as text models:
their ``text_config`` (transformers' Gemma3TextConfig defaults for the fields it leaves out) and their
``language_model`` weights; the SigLIP tower and projector are not loaded, and images are not taken. As
transformers' class, it does not soft-cap the final logits.
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


# Gemma3TextConfig's defaults for the fields a published Gemma3ForConditionalGeneration text_config leaves out.
TEXT_DEFAULTS = {"vocab_size": 262_208, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "hidden_activation": "gelu_pytorch_tanh"}
VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_PARTS = (("language_model.model.", "model."), ("model.language_model.", "model."),
              ("language_model.lm_head.", "lm_head."))


@dataclass(kw_only=True)
class Gemma3TextOfConditionalConfig(Gemma3Config):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> Gemma3TextOfConditionalConfig:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json of {architecture} has no text_config")
        text = {**TEXT_DEFAULTS, "tie_word_embeddings": cfg.get("tie_word_embeddings", True), **text}
        # transformers' Gemma3ForConditionalGeneration caps no logits (the published configs set no cap).
        return dataclasses.replace(super().from_dict(text, architecture), final_softcap=None)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 image-text checkpoint (see the module's docstring)."""

    config_class = Gemma3TextOfConditionalConfig

    def checkpoint_name(self, name: str) -> str:
        for prefix, ours in TEXT_PARTS:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name

    def unused_weight(self, name: str) -> bool:
        return name.startswith(VISION_PARTS) or super().unused_weight(name)
