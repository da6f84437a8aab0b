"""Llava-NeXT (Llava-v1.6): a CLIP vision tower and a projector in front of a Llama-family model.

At prefill, the prompt's image placeholder tokens (``image_token_index``; the router
expanded each image into as many as it has features) get the projected image
features instead of their token embeddings; decode is the language model alone.
Images are tiled "anyres" (transformers' LlavaNextImageProcessor): a downscaled
whole image plus a grid of tiles, whose features are unpadded and end each row
with the learned ``image_newline`` (``gaudi_runtime.image_geometry`` has the layout,
which the router counts placeholder tokens by).

The language model is the Llama family's, under the checkpoint's ``language_model``
prefix; its config (the ``text_config``) is the one the base reads.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..image_geometry import ImageGeometry, tile_count, tile_grid, unpadded_shape
from ..layers.activation import get_activation
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext
from .base import rotary_embedding
from .clip import ClipVisionConfig, ClipVisionModel, layers_needed, replicated_param
from .llama import LlamaConfig, LlamaForCausalLM, LlamaModel


def complete_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with transformers' defaults filled in (hub configs list only what differs)."""
    import transformers

    known = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    return transformers.LlavaNextConfig(**known).to_dict()


@dataclass(kw_only=True)
class LlavaNextConfig(LlamaConfig):
    """The language model's config, with the vision tower's and the projector's."""

    vision: ClipVisionConfig
    geometry: ImageGeometry
    image_token_id: int
    vision_feature_layer: int
    projector_hidden_act: str
    projector_bias: bool

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str) -> LlavaNextConfig:
        full = complete_config(cfg)
        text_dict = full["text_config"]
        text_arch = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
            text_dict.get("model_type"), "LlamaForCausalLM")
        if text_dict.get("model_type") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported language model {text_dict.get('model_type')!r} "
                             "(llama, mistral or qwen2)")
        layer = full.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: only one layer is supported")
        strategy = full.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ValueError(f"vision_feature_select_strategy {strategy!r}: only 'default' is supported")
        get_activation(full.get("projector_hidden_act", "gelu"), "projector_hidden_act")
        geometry = ImageGeometry.from_config(full)
        if geometry.image_size % geometry.patch_size:
            raise ValueError("vision_config.image_size must be a multiple of vision_config.patch_size")
        token = full.get("image_token_index", full.get("image_token_id"))
        text = LlamaConfig.from_dict(text_dict, text_arch)
        return cls(
            **{f.name: getattr(text, f.name) for f in fields(LlamaConfig) if f.name != "architecture"},
            architecture=architecture,
            vision=ClipVisionConfig.from_dict(full["vision_config"]),
            geometry=geometry,
            image_token_id=int(token),
            vision_feature_layer=layer,
            projector_hidden_act=full.get("projector_hidden_act", "gelu"),
            projector_bias=bool(full.get("multimodal_projector_bias", True)),
        )


class MultiModalProjector(nn.Module):
    """Vision hidden -> text hidden: column-parallel, activation, row-parallel (one all-reduce)."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, tp: TPContext):
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_hidden, text_hidden, bias=bias, tp=tp)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=bias, tp=tp)
        self.act = get_activation(act, "projector_hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _checkpoint_name(name: str) -> str:
    """Every naming Llava checkpoints use -> ours: llava-hf's (``language_model.model.*``,
    ``vision_tower.vision_model.*``), transformers 5's (``model.language_model.*``, ``lm_head``) and
    the tower without its ``vision_model`` level."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


class LlavaNextForConditionalGeneration(LlamaForCausalLM):
    config_class = LlavaNextConfig
    # Images enter at prefill through `embed_prompt`; the runner preprocesses them with
    # `load_image_processor` / `pixel_inputs` below.
    takes_images = True
    decoder = "language_model.model"
    head = "language_model.lm_head"

    def build(self, cfg: LlavaNextConfig, tp: TPContext) -> None:
        self.language_model = nn.Module()
        self.language_model.model = LlamaModel(cfg, rotary_embedding(cfg, self.dtype, self.device), tp)
        self.vision_layers = layers_needed(cfg.vision_feature_layer, cfg.vision.num_hidden_layers)
        self.vision_tower = ClipVisionModel(cfg.vision, self.vision_layers, tp)
        self.multi_modal_projector = MultiModalProjector(cfg.vision.hidden_size, cfg.hidden_size,
                                                         cfg.projector_hidden_act, cfg.projector_bias, tp)
        self.image_newline = replicated_param(cfg.hidden_size)

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    # -- images ------------------------------------------------------------------------------
    def image_features(self, pixel_values: torch.Tensor, image_sizes: list[tuple[int, int]]) -> torch.Tensor:
        """Processor output (``[images, max_tiles, C, H, W]``, original (height, width) of each) ->
        the features of every image in order, ``[sum of image tokens, hidden]``."""
        geo = self.config.geometry
        tiles = [tile_count(h, w, geo) for h, w in image_sizes]
        pixels = torch.cat([pv[:n] for pv, n in zip(pixel_values, tiles, strict=True)])
        hidden = self.vision_tower(pixels.to(self.device, self.dtype))[:, 1:]  # drop CLS ("default")
        feats = self.multi_modal_projector(hidden)
        out = []
        for f, (h, w) in zip(feats.split(tiles), image_sizes, strict=True):
            out += [f[0], self._grid_features(f[1:], h, w)]
        return torch.cat(out)

    def _grid_features(self, f: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Tile features ``[rows*cols, side*side, D]`` -> the unpadded patch rows, each ended by the newline."""
        geo, side = self.config.geometry, self.config.geometry.side
        rows, cols = tile_grid(height, width, geo)
        d = f.shape[-1]
        # [rows, cols, side, side, D] -> [D, rows*side, cols*side]: patches in image order.
        grid = f.view(rows, cols, side, side, d).permute(4, 0, 2, 1, 3).reshape(d, rows * side, cols * side)
        keep_r, keep_c = unpadded_shape(height, width, rows * side, cols * side)
        top, left = (rows * side - keep_r) // 2, (cols * side - keep_c) // 2
        grid = grid[:, top:top + keep_r, left:left + keep_c]
        newline = self.image_newline[:, None, None].expand(d, keep_r, 1).to(grid.dtype)
        return torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)

    def embed_prompt(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                     image_sizes: list[tuple[int, int]]) -> torch.Tensor:
        """Token embeddings ``[B, S, hidden]`` with image features at the placeholder positions
        (row-major order: the images of the batch's requests, in order)."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        feats = self.image_features(pixel_values, image_sizes)
        mask = input_ids == self.image_token_id
        n = int(mask.sum())
        if n != feats.shape[0]:
            raise ValueError(f"the prompt has {n} image tokens but its images have {feats.shape[0]} features")
        return embeds.masked_scatter(mask[..., None], feats.to(embeds.dtype))

    # -- weights -----------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        return _checkpoint_name(name)

    def unused_weight(self, name: str) -> bool:
        """Vision weights past the feature layer, the pooled output's norm, cached position ids."""
        if super().unused_weight(name) or "post_layernorm" in name or name.endswith("position_ids"):
            return True
        marker = "encoder.layers."
        if name.startswith("vision_tower.") and marker in name:
            return int(name.split(marker, 1)[1].split(".", 1)[0]) >= self.vision_layers
        return False


# -- preprocessing (on the shard: the router sends the image bytes) -------------------------

def load_image_processor(model_dir: str):
    """The model's own LlavaNextImageProcessor (preprocessor_config.json), as transformers loads it."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir)


def pixel_inputs(processor, images: list[bytes]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Encoded images -> (pixel values ``[n, max_tiles, C, H, W]``, (height, width) of each)."""
    from PIL import Image

    decoded = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    out = processor(decoded, return_tensors="pt")
    return out["pixel_values"], [(im.height, im.width) for im in decoded]
