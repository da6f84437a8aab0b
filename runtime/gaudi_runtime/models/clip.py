"""CLIP vision tower (Llava's image encoder), tensor-parallel like the language model.

Only what Llava reads is built: the hidden states of layer ``num_layers`` (Llava
takes ``vision_feature_layer``, usually the second to last), so later layers
and ``post_layernorm`` are neither built nor loaded. Attention is bidirectional
over one image's patches, with no KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import get_activation
from ..layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPContext, materialize
from ..layers.norm import LayerNorm


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation (transformers' ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


def clip_activation(name: str):
    return quick_gelu if name == "quick_gelu" else get_activation(name, "vision_config.hidden_act")


@dataclass
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ClipVisionConfig:
        if cfg.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"unsupported vision tower {cfg.get('model_type')!r} (only clip_vision_model)")
        clip_activation(cfg.get("hidden_act", "quick_gelu"))  # fails early on an unknown one
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            image_size=cfg["image_size"], patch_size=cfg["patch_size"], num_channels=cfg.get("num_channels", 3),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), hidden_act=cfg.get("hidden_act", "quick_gelu"),
        )


def replicated_param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)

    def load(param: nn.Parameter, loaded) -> None:
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"vision weight shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
        param.data.copy_(materialize(loaded))

    p.weight_loader = load
    return p


class ClipEmbeddings(nn.Module):
    def __init__(self, cfg: ClipVisionConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.class_embedding = replicated_param(cfg.hidden_size)
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = replicated_param(cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Module()
        num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.position_embedding.weight = replicated_param(num_positions, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, 1 + patches, hidden]`` (class token first)."""
        w = self.patch_embedding.weight
        patches = F.conv2d(pixels.to(w.dtype), w, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, cfg: ClipVisionConfig, tp: TPContext):
        super().__init__()
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        heads = cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, heads, heads, bias=True, tp=tp)
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, tp=tp)
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        q, k, v = (t.view(n, s, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, s, self.num_heads * self.head_dim))


class ClipMLP(nn.Module):
    def __init__(self, cfg: ClipVisionConfig, tp: TPContext):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True, tp=tp)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, tp=tp)
        self.act = clip_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, cfg: ClipVisionConfig, tp: TPContext):
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.self_attn = ClipAttention(cfg, tp)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = ClipMLP(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipVisionModel(nn.Module):
    """Parameter names follow the checkpoint's ``vision_model.*`` (``pre_layrnorm`` is CLIP's spelling)."""

    def __init__(self, cfg: ClipVisionConfig, num_layers: int, tp: TPContext):
        super().__init__()
        self.vision_model = nn.Module()
        self.vision_model.embeddings = ClipEmbeddings(cfg)
        self.vision_model.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.vision_model.encoder = nn.Module()
        self.vision_model.encoder.layers = nn.ModuleList([ClipEncoderLayer(cfg, tp) for _ in range(num_layers)])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> hidden states after the last built layer, ``[N, 1 + patches, hidden]``."""
        vm = self.vision_model
        x = vm.pre_layrnorm(vm.embeddings(pixels))
        for layer in vm.encoder.layers:
            x = layer(x)
        return x


def layers_needed(feature_layer: int, num_hidden_layers: int) -> int:
    """How many encoder layers produce ``hidden_states[feature_layer]`` (index 0 is the embeddings)."""
    index = feature_layer if feature_layer >= 0 else num_hidden_layers + 1 + feature_layer
    if not 0 <= index <= num_hidden_layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is outside the {num_hidden_layers}-layer tower")
    return index
